"""A rank's ``wait()`` that times out names the ranks the job waits for, whatever
``--stall-warn-s`` is: with the daemon's defaults (60 s) the stall inspector has not spoken
when a client's timeout (here 8 s) runs out, yet the waiting ranks must learn who stopped.

Real daemons and ranks; one rank is SIGSTOPped (always continued and killed in clean-up), the
others' waits are bounded by their own client timeout. The wording and its bounds are
tested in tests/unit/test_timeout_wording.py."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest

from commd.testing.processes import kill_all
from commd.testing.ranks import JobSpec, assert_exact, await_registered, collect, start_ranks

LAYERS = [("conv.weight", 27), ("conv.bias", 3), ("fc.weight", 130), ("fc.bias", 10)]
# Far below the default stall_warn_s (60 s); above the 1 s a node waits before it names a
# rank plus the heartbeat, status and progress (2 s each) that carry the name to a rank.
CLIENT_TIMEOUT_S = 12.0
SLACK_S = 30.0  # a loaded 2-core machine: start-up, then the client's own timeout


def endless(job: str, nodes: list[Any], ranks_per_node: int, stopped: int,
            failed_dir: Path) -> JobSpec:
    """A job that runs until a rank's wait times out; results are not kept. A rank that
    timed out stays until the others (all but ``stopped``) have too: its exit would
    otherwise end the job for a rank whose own timeout runs out a moment later."""
    world = len(nodes) * ranks_per_node
    waiting = [r for r in range(world) if r != stopped]
    return JobSpec(job, nodes, ranks_per_node, LAYERS, iterations=10**6,
                   timeout=CLIENT_TIMEOUT_S,
                   overrides={r: {"skip_results": True, "failed_dir": str(failed_dir),
                                  "hold_for": waiting} for r in range(world)})


def timeouts_with_one_stopped(processes: list[Any], stopped: int) -> list[dict[str, Any]]:
    """Stop rank ``stopped``; the others' results (each times out on its own)."""
    try:
        await_registered(processes)
        processes[stopped].send_signal(signal.SIGSTOP)  # it stops marking, silently
        others = [p for i, p in enumerate(processes) if i != stopped]
        return collect(others, timeout=CLIENT_TIMEOUT_S + SLACK_S)
    finally:
        processes[stopped].send_signal(signal.SIGCONT)
        kill_all(processes)


@pytest.mark.timeout(240)
def test_a_timeout_names_a_stopped_rank_on_another_node_and_on_this_one(
        start_daemon, tmp_path: Path) -> None:
    nodes = [start_daemon(), start_daemon()]  # defaults: stall_warn_s 60, no stall timeout
    results = timeouts_with_one_stopped(
        start_ranks(endless("culprit", nodes, 2, stopped=3, failed_dir=tmp_path)), stopped=3)
    # ranks 0 and 1 on node 0 hear the coordinator's words; rank 2, beside rank 3, its node's
    for result, where in zip(results, ["node 1, 127.0.0.1", "node 1, 127.0.0.1",
                                       "node 1, this node"], strict=True):
        assert result.get("error_type") == "CommdTimeout", result
        error = result["error"]
        assert error.startswith(f"commd: timed out after {CLIENT_TIMEOUT_S:g}s waiting for "
                                "iteration "), error
        assert f"rank 3 ({where}) has not marked layer " in error, error
        assert error.endswith("; check that process (stopped? stuck in data loading?)"), error
        assert "rank 0 " not in error and "rank 1 " not in error, error  # they all marked
    assert_a_job_runs_exact(nodes)


def assert_a_job_runs_exact(nodes: list[Any]) -> None:
    """The daemons serve the next job, and its sums are exact."""
    spec = JobSpec("after-culprit", nodes, 2, LAYERS, iterations=3, timeout=60)
    assert_exact(spec, collect(start_ranks(spec), timeout=120))


def test_a_timeout_names_a_stopped_rank_of_a_one_node_job(start_daemon, tmp_path: Path) -> None:
    node = start_daemon()
    results = timeouts_with_one_stopped(
        start_ranks(endless("culprit-local", [node], 2, stopped=1, failed_dir=tmp_path)),
        stopped=1)
    (result,) = results
    assert result.get("error_type") == "CommdTimeout", result
    assert "rank 1 (node 0, this node) has not marked layer " in result["error"], result
