"""Start rank_worker.py processes for a job and collect their JSON results."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from commd.testing.processes import finish, start_json_worker

from rank_worker import numel, value

WORKER = str(Path(__file__).with_name("rank_worker.py"))


@dataclass
class JobSpec:
    job: str
    nodes: list[Any]  # DaemonProcess per node
    ranks_per_node: int
    layers: list[tuple[str, int | list[int]]]  # (name, size) or (name, shape)
    dtype: str = "float32"
    op: str = "sum"
    iterations: int = 3
    planner: str = "wfbp"
    compression: str = "none"
    timeout: float = 60.0
    overrides: dict[int, dict[str, Any]] = field(default_factory=dict)  # per rank

    @property
    def world_size(self) -> int:
        return len(self.nodes) * self.ranks_per_node


def start_ranks(spec: JobSpec) -> list[subprocess.Popen[str]]:
    processes = []
    for rank in range(spec.world_size):
        node = rank // spec.ranks_per_node
        worker_spec = {
            "job": spec.job, "rank": rank, "world_size": spec.world_size,
            "local_rank": rank % spec.ranks_per_node, "local_world_size": spec.ranks_per_node,
            "coordinator": spec.nodes[0].address, "socket": spec.nodes[node].socket,
            "timeout": spec.timeout, "layers": spec.layers, "dtype": spec.dtype, "op": spec.op,
            "iterations": spec.iterations, "planner": spec.planner,
            "compression": spec.compression,
            **spec.overrides.get(rank, {}),
        }
        processes.append(start_json_worker([sys.executable, WORKER], worker_spec))
    return processes


def await_registered(processes: list[subprocess.Popen[str]]) -> None:
    """Block until every rank printed that its job formed (skip_results ranks)."""
    for process in processes:
        assert process.stdout is not None
        assert json.loads(process.stdout.readline())["registered"]


def daemon_status(socket: str) -> dict[str, Any]:
    """``commd status --json`` of the daemon at ``socket``."""
    completed = subprocess.run(
        [sys.executable, "-m", "commd.cli", "status", "--socket", socket, "--json"],
        capture_output=True, text=True, timeout=30, check=True)
    status: dict[str, Any] = json.loads(completed.stdout)
    return status


def collect(processes: list[subprocess.Popen[str]], timeout: float = 90.0) -> list[dict[str, Any]]:
    """The final JSON line of every rank, with its returncode and stderr, all within
    ``timeout``; kills stragglers so nothing outlives the test."""
    results = []
    for done in finish(processes, timeout):
        final = done.last_json()
        final["returncode"] = done.returncode
        final["stderr"] = done.stderr
        results.append(final)
    return results


def expected(spec: JobSpec, iteration: int) -> list[np.ndarray]:
    """The reduced value every rank must see, computed in float64."""
    sums = [
        sum(value(r, iteration, i, numel(size)).astype(np.float64)
            for r in range(spec.world_size))
        for i, (_, size) in enumerate(spec.layers)
    ]
    return [s / spec.world_size for s in sums] if spec.op == "avg" else sums


def assert_exact(spec: JobSpec, results: list[dict[str, Any]]) -> None:
    """Every rank of ``spec`` ran every iteration without an error and saw exactly the
    reduced values ``expected`` computes, element by element (dense throughout, without
    compression)."""
    for result in results:
        assert "error" not in result, result
        assert result["returncode"] == 0, result["stderr"]
        assert len(result["iterations"]) == spec.iterations, result
        if spec.compression == "none":
            assert result["dense"] == [True] * spec.iterations, result["dense"]
        for iteration, layers in enumerate(result["iterations"]):
            for got, want in zip(layers, expected(spec, iteration), strict=True):
                np.testing.assert_array_equal(np.array(got), want)
