"""The GPU path for real: device kernels bit-exact against host_ops, the NCCL engine on one
rank, and daemons with training ranks on one GPU through CUDA IPC handles and events —
including two daemons as two "nodes" joined by NCCL (NCCL_HOSTID makes one GPU look like two
hosts). Skipped without a CUDA GPU, cupy and NCCL; scripts/gpu-check runs them."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from commd.engines import EngineConfig, host_ops

from gpu_jobs import assert_gpu_ranks_exact, run_job


def _gpu_ready() -> bool:
    try:
        import cupy
        from cupy.cuda import nccl

        return bool(nccl.available) and int(cupy.cuda.runtime.getDeviceCount()) > 0
    except Exception:
        return False


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _gpu_ready(), reason="needs a CUDA GPU with cupy and NCCL"),
    pytest.mark.timeout(240),
]

DTYPES = ("float32", "float64", "float16", "bfloat16")
# Two daemons on one GPU as two NCCL "hosts", over loopback sockets.
NODE_ENV = {"NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1", "NCCL_DEBUG": "WARN"}


def bus_id() -> str:
    import cupy

    return str(cupy.cuda.Device(0).pci_bus_id)


def host_values(rng: np.random.Generator, dtype: str, n: int) -> np.ndarray:
    values = rng.uniform(-1e3, 1e3, n) * np.exp2(rng.integers(-20, 3, n))
    values[::17] = 0.0
    if dtype == "bfloat16":
        words = np.zeros(n, np.uint16)
        host_ops._f32_to_bf16(values.astype(np.float32), words)
        return words
    return values.astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sources", [1, 3])
def test_device_kernels_match_host_ops_bit_for_bit(dtype: str, sources: int) -> None:
    import cupy

    from commd.engines.cuda.ops import CudaOps

    rng = np.random.default_rng(sources)
    n = 100_003
    target = host_values(rng, dtype, n)
    others = [host_values(rng, dtype, n) for _ in range(sources)]
    copy = np.zeros_like(target)

    async def on_device() -> tuple[np.ndarray, np.ndarray]:
        ops = CudaOps(bus_id(), timeout_s=60)
        try:
            await ops.prepare(dtype)
            with ops.device:
                device_target, device_copy = cupy.asarray(target), cupy.asarray(copy)
                device_others = [cupy.asarray(o) for o in others]
                cupy.cuda.Device().synchronize()
            ops.sum_into(device_target, device_others, dtype)
            ops.finish(device_target, [device_copy], 1 / 3, dtype)
            await ops.fence()
            return cupy.asnumpy(device_target), cupy.asnumpy(device_copy)
        finally:
            ops.close()

    got, got_copy = asyncio.run(on_device())
    host_ops.sum_into(target, others, dtype)
    host_ops.scale(target, 1 / 3, dtype)
    assert got.tobytes() == target.tobytes()
    assert got_copy.tobytes() == target.tobytes()


def test_nccl_engine_on_one_rank() -> None:
    import cupy

    from commd.engines.cuda.ops import CudaOps
    from commd.engines.nccl import NcclEngine

    async def run() -> None:
        ops = CudaOps(bus_id(), timeout_s=60)
        engine = NcclEngine()
        engine.bind(ops)
        try:
            await engine.start(EngineConfig(key="gpu/1", rank=0, size=1, store_host="",
                                            store_port=0, host="", timeout_s=60))
            with ops.device:
                data = cupy.arange(1 << 20, dtype=cupy.float32)
                gathered = cupy.zeros(1 << 20, dtype=cupy.float32)
                cupy.cuda.Device().synchronize()
            took = await engine.allreduce(data, "float32")
            assert isinstance(took, float) and 0 < took < 10
            await engine.allgather(gathered, data, "float32")
            await engine.broadcast(data, 0, "float32")
            assert bool((cupy.asnumpy(gathered) == np.arange(1 << 20)).all())
            with pytest.raises(Exception, match="4-byte"):
                await engine.allreduce(data, "float64")
        finally:
            engine.close()
            ops.close()

    asyncio.run(run())


def test_two_ranks_share_one_gpu_exactly(start_daemon: Any) -> None:
    daemon = start_daemon("--backend", "nccl")
    results = run_job("gpu-two", [daemon], 2, iterations=50)
    assert_gpu_ranks_exact(results, 50)
    assert "backend nccl" in daemon.log() or "nccl" in daemon.log()


@pytest.mark.parametrize(("dtype", "op"), [("bfloat16", "avg"), ("float16", "sum"),
                                           ("float64", "avg"), ("float32", "avg")])
def test_dtypes_and_ops_on_one_gpu(start_daemon: Any, dtype: str, op: str) -> None:
    daemon = start_daemon("--backend", "nccl")
    results = run_job(f"gpu-{dtype}-{op}", [daemon], 3, dtype=dtype, op=op, iterations=5)
    assert_gpu_ranks_exact(results, 5, op, dtype)


def test_a_dead_rank_fails_the_others(start_daemon: Any) -> None:
    daemon = start_daemon("--backend", "nccl")
    results = run_job("gpu-dies", [daemon], 2, iterations=10, overrides={1: {"die_at": 3}},
                      timeout=60)
    assert results[1]["returncode"] == 17
    assert results[0].get("code") == "rank_lost", results[0]
    assert daemon.process.poll() is None  # the daemon lives on


def test_two_nodes_through_nccl_on_one_gpu(start_daemon: Any) -> None:
    nodes = [start_daemon("--backend", "nccl", "--timeout-s", "60",
                          env={**NODE_ENV, "NCCL_HOSTID": f"commd-node-{i}"}) for i in range(2)]
    results = run_job("gpu-nccl", nodes, 1, iterations=20)
    assert_gpu_ranks_exact(results, 20)
    results = run_job("gpu-nccl-avg", nodes, 2, op="avg", dtype="bfloat16", iterations=5)
    assert_gpu_ranks_exact(results, 5, "avg", "bfloat16")
