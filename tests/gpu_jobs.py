"""Run tests/gpu_worker.py ranks for a job and check what they saw (real or fake GPU)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from commd.testing.processes import finish, start_json_worker

WORKER = str(Path(__file__).with_name("gpu_worker.py"))


def gpu_present() -> bool:
    """cupy imports and sees at least one CUDA device."""
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount()) > 0
    except Exception:
        return False


def run_job(job: str, daemons: list[Any], ranks_per_node: int, *, dtype: str = "float32",
            op: str = "sum", iterations: int = 20, layers: list[tuple[str, int]] | None = None,
            overrides: dict[int, dict[str, Any]] | None = None,
            timeout: float = 120, env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    layers = layers or [("conv", 3 * 3 * 64), ("bias", 5), ("fc", 1 << 18), ("out", 1000)]
    world = len(daemons) * ranks_per_node
    processes = []
    for rank in range(world):
        node = rank // ranks_per_node
        spec = {"job": job, "rank": rank, "world_size": world,
                "local_rank": rank % ranks_per_node, "local_world_size": ranks_per_node,
                "coordinator": daemons[0].address, "socket": daemons[node].socket,
                "timeout": timeout, "layers": layers, "dtype": dtype, "op": op,
                "iterations": iterations, "streams": 1 + rank % 2, "device": "cuda:0",
                **(overrides or {}).get(rank, {})}
        processes.append(start_json_worker([sys.executable, WORKER], spec, env=env))
    results = []
    for done in finish(processes, timeout + 60):
        result = done.last_json()
        result.update(returncode=done.returncode, stderr=done.stderr[-3000:])
        results.append(result)
    return results


# One rounding of the avg's scaling; sums of these small integers are exact in every dtype.
EPSILON = {"float64": 2.0**-52, "float32": 2.0**-23, "float16": 2.0**-10, "bfloat16": 2.0**-7}


def assert_gpu_ranks_exact(results: list[dict[str, Any]], iterations: int, op: str = "sum",
                           dtype: str = "float32") -> None:
    """Every gpu_worker rank ran ``iterations`` and its own comparison (the worker checks
    its device buffers) found sums exact and averages within one rounding of ``dtype``."""
    for result in results:
        assert "error" not in result and result["returncode"] == 0, result
        assert len(result["errors"]) == iterations, result
        if op == "sum":
            assert max(result["errors"]) == 0.0, result
        else:
            assert max(result["relative"]) <= EPSILON[dtype], result
