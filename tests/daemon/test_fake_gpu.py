"""The whole device path on CPU, with tests/fake_cupy standing in for cupy: real daemons and
the real GPU worker (tests/gpu_worker.py) exchange "device" buffers through IPC handles
(shared-memory segments in the fake), events and done events. This checks the plumbing —
registration fields, CudaOps, the stream-ordered pipeline, the watcher, the client's device
buffer — not CUDA itself: the fake runs every kernel at once with host_ops and its events do
nothing. tests/daemon/test_gpu.py runs the same jobs on a real GPU."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from commd.cli.status import query

from gpu_jobs import assert_gpu_ranks_exact, run_job

FAKE = {"PYTHONPATH": os.pathsep.join(
    [str(Path(__file__).parents[1] / "fake_cupy"), *os.environ.get("PYTHONPATH", "").split(
        os.pathsep)]).rstrip(os.pathsep)}


@pytest.fixture(autouse=True)
def no_fake_device_memory_left() -> Iterator[None]:
    before = {n for n in os.listdir("/dev/shm") if n.startswith("fakegpu-")}
    yield
    left = {n for n in os.listdir("/dev/shm") if n.startswith("fakegpu-")} - before
    for name in left:
        Path("/dev/shm", name).unlink(missing_ok=True)
    assert not left, f"fake device memory left behind: {sorted(left)}"


def test_two_ranks_through_device_buffers(start_daemon: Any) -> None:
    daemon = start_daemon("--backend", "auto", env=FAKE)
    assert "chose nccl (NCCL 2.21.5, 1 GPU(s))" in daemon.log()
    results = run_job("fake-two", [daemon], 2, iterations=6, env=FAKE)
    assert_gpu_ranks_exact(results, 6)
    status = query(daemon.socket)
    assert status["backend"] == "nccl" and status["jobs"] == []  # the job is over and gone


@pytest.mark.parametrize(("dtype", "op"), [("bfloat16", "avg"), ("float16", "sum"),
                                           ("float64", "avg")])
def test_dtypes_and_ops(start_daemon: Any, dtype: str, op: str) -> None:
    daemon = start_daemon("--backend", "auto", env=FAKE)
    results = run_job(f"fake-{dtype}", [daemon], 3, dtype=dtype, op=op, iterations=3, env=FAKE)
    assert_gpu_ranks_exact(results, 3, op, dtype)


def test_a_dead_rank_fails_the_others(start_daemon: Any) -> None:
    daemon = start_daemon("--backend", "auto", env=FAKE)
    results = run_job("fake-dies", [daemon], 2, iterations=6, overrides={1: {"die_at": 2}},
                      timeout=30, env=FAKE)
    assert results[1]["returncode"] == 17
    assert results[0].get("code") == "rank_lost", results[0]
    assert daemon.process.poll() is None
    # The dead rank's fake device memory is its own to free; the test cleans it up.
    for name in os.listdir("/dev/shm"):
        if name.startswith("fakegpu-"):
            Path("/dev/shm", name).unlink(missing_ok=True)


def test_a_multi_node_device_job_is_refused_by_a_gloo_daemon(start_daemon: Any) -> None:
    nodes = [start_daemon("--backend", "gloo", env=FAKE) for _ in range(2)]
    results = run_job("fake-nodes", nodes, 1, iterations=1, timeout=20, env=FAKE)
    for result in results:
        assert "cannot reduce cuda buffers across nodes" in result.get("error", ""), result


def test_an_engine_failure_on_one_node_reaches_every_rank(start_daemon: Any) -> None:
    """Node 0's NCCL set-up fails; node 1's hangs. Both ranks get the error at once."""
    nodes = [start_daemon("--backend", "nccl", env=FAKE),
             start_daemon("--backend", "nccl", env={**FAKE, "FAKE_CUPY_NCCL": "hang"})]
    results = run_job("fake-nccl", nodes, 1, iterations=1, timeout=30, env=FAKE)
    for result in results:
        assert result.get("code") == "engine", result
        assert "ncclCommInitRank failed: RuntimeError: the fake cupy has no NCCL " \
               "communicator" in result["error"], result
