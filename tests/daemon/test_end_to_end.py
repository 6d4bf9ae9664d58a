"""Two real daemons on 127.0.0.1, real ranks as processes, exact results."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from commd.compression import native
from commd.testing.processes import kill_all
from commd.testing.ranks import JobSpec, assert_exact, collect, start_ranks

LAYERS = [("conv1.weight", 27), ("conv1.bias", 3), ("fc.weight", 130), ("fc.bias", 10)]


@pytest.mark.timeout(180)
def test_two_jobs_at_once_two_ranks_per_node(start_daemon) -> None:
    nodes = [start_daemon(), start_daemon()]
    sum_job = JobSpec("job-sum", nodes, 2, LAYERS, dtype="float32", op="sum", iterations=4)
    avg_job = JobSpec("job-avg", nodes, 2, LAYERS, dtype="float64", op="avg", iterations=4,
                      planner="syncea")
    running = [start_ranks(sum_job), start_ranks(avg_job)]
    assert_exact(sum_job, collect(running[0]))
    assert_exact(avg_job, collect(running[1]))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_dtypes(start_daemon, dtype: str) -> None:
    nodes = [start_daemon(), start_daemon()]
    spec = JobSpec(f"job-{dtype}", nodes, 2, LAYERS, dtype=dtype, op="avg", iterations=2)
    assert_exact(spec, collect(start_ranks(spec)))


def test_lost_rank_fails_every_other_rank_and_other_jobs_go_on(start_daemon, tmp_path) -> None:
    nodes = [start_daemon(), start_daemon()]
    # Rank 3 dies at iteration 2 once the others have finished iteration 1.
    progress = {rank: {"progress_dir": str(tmp_path)} for rank in range(4)}
    doomed = JobSpec("doomed", nodes, 2, LAYERS, iterations=5, timeout=60,
                     overrides={**progress, 3: {**progress[3], "die_at": 2}})
    healthy = JobSpec("healthy", nodes, 1, LAYERS, iterations=3)
    doomed_ranks = start_ranks(doomed)
    results = collect(doomed_ranks)
    assert results[3]["returncode"] == 17
    for result in results[:3]:
        assert result["error_type"] == "CommdError", result
        assert "rank 3" in result["error"], result["error"]
        assert result["error"].startswith("commd: ")
        assert len(result["iterations"]) == 2
    # The daemons keep serving: a new job on the same daemons completes.
    assert_exact(healthy, collect(start_ranks(healthy)))


# The same layers given by their shapes: rows 3 for conv1.weight (3 x 9), 10 for fc.weight.
SHAPED = [("conv1.weight", [3, 3, 3]), ("conv1.bias", [3]), ("fc.weight", [10, 13]),
          ("fc.bias", 10)]


@pytest.mark.parametrize(("other", "words"), [
    ([*LAYERS[:2], ("fc.weight", 131), LAYERS[3]],
     "first differing layer is 2: 'fc.weight' (130 elements) vs 'fc.weight' (131 elements)"),
    # the same sizes, only the matrix rows differ (13 x 10 against 10 x 13)
    ([*SHAPED[:2], ("fc.weight", [13, 10]), SHAPED[3]],
     "first differing layer is 2: 'fc.weight' (130 elements) has rows 10 (10 x 13) vs rows 13 "
     "(13 x 10)"),
], ids=["size", "rows"])
def test_layer_mismatch_is_reported_to_every_rank(start_daemon, other: list, words: str) -> None:
    nodes = [start_daemon(), start_daemon()]
    mine = SHAPED if "rows" in words else LAYERS
    spec = JobSpec("mismatch", nodes, 1, mine, overrides={1: {"layers": other}})
    results = collect(start_ranks(spec))
    for result in results:
        assert result.get("code") == "mismatch", result
        assert words in result["error"], result["error"]
        assert "ranks [0]" in result["error"] and "ranks [1]" in result["error"]


def test_layers_given_by_their_shapes_reduce_exactly(start_daemon) -> None:
    """``Client.register`` with (name, shape) layers (and one bare size) against real
    daemons: the job forms and every layer sums exactly, as with sizes."""
    nodes = [start_daemon(), start_daemon()]
    spec = JobSpec("shaped", nodes, 2, SHAPED, op="avg", iterations=2)
    assert_exact(spec, collect(start_ranks(spec)))


def test_status_shows_running_job(start_daemon) -> None:
    nodes = [start_daemon(), start_daemon()]
    spec = JobSpec("observed", nodes, 1, LAYERS, iterations=1000, timeout=30)
    processes = start_ranks(spec)
    try:
        for process in processes:  # the first line says the job formed
            assert process.stdout is not None
            assert json.loads(process.stdout.readline())["registered"]
        out = subprocess.run(
            [sys.executable, "-m", "commd.cli", "status", "--socket", nodes[1].socket, "--json"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout
        status = json.loads(out)
        assert status["backend"] == "gloo" and status["uptime_s"] > 0
        assert status["compression_loops"] == native.describe()  # the daemon's, as here
        (job,) = status["jobs"]
        assert job["job"] == "observed" and job["world_size"] == 2
        assert job["local_ranks"] == [1] and job["nodes"] == 2 and job["node_index"] == 1
        assert job["planner"] == "wfbp" and len(job["groups"]) == len(LAYERS)
        table = subprocess.run(
            [sys.executable, "-m", "commd.cli", "status", "--socket", nodes[0].socket],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout
        assert "observed" in table and "running" in table
    finally:
        kill_all(processes)
        collect(processes)


def test_sigterm_removes_socket_and_segments(start_daemon) -> None:
    node = start_daemon()
    spec = JobSpec("single", [node], 2, LAYERS, iterations=1000, timeout=30)
    processes = start_ranks(spec)
    for process in processes:
        assert process.stdout is not None
        assert json.loads(process.stdout.readline())["registered"]
    assert node.stop() == 0
    results = collect(processes)
    for result in results:
        assert result.get("code") in ("shutdown", "rank_lost"), result
    import os

    assert not os.path.exists(node.socket)


def test_a_killed_daemon_fails_every_rank_of_the_job(start_daemon) -> None:
    nodes = [start_daemon(), start_daemon()]
    spec = JobSpec("orphaned", nodes, 2, LAYERS, iterations=100000, timeout=60,
                   overrides={r: {"skip_results": True} for r in range(4)})
    processes = start_ranks(spec)
    for process in processes:
        assert process.stdout is not None
        assert json.loads(process.stdout.readline())["registered"]
    nodes[1].process.kill()  # SIGKILL: no drain, no goodbye
    results = collect(processes, timeout=90)
    for result in results:
        assert result.get("error_type") in ("CommdError", "CommdTimeout"), result
        assert result["error"].startswith("commd: ")
    # Node 0's ranks learn it from the failed collective, long before their 60 s timeout.
    assert all(r["error_type"] == "CommdError" for r in results[:2]), results[:2]
    assert all("lost the connection" in r["error"] for r in results[2:]), results[2:]
