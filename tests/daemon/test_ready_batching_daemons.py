"""Ready marks batched per group of the plan, through real daemons: one ready message per group
instead of one per layer (the batching itself is tested in tests/unit/test_ready_batching.py)."""

from __future__ import annotations

from typing import Any

from commd.testing.processes import kill_all
from commd.testing.ranks import JobSpec, await_registered, collect, daemon_status, start_ranks


def test_daemon_gets_one_notification_per_group(start_daemon: Any) -> None:
    """Eight layers marked one by one, one group (syncea): one ready message per iteration
    instead of eight, through real daemons."""
    nodes = [start_daemon(), start_daemon()]
    layers = [(f"layer{i}", 1024) for i in range(8)]
    spec = JobSpec("batched", nodes, 1, layers, iterations=100_000, planner="syncea", timeout=30,
                   overrides={r: {"skip_results": True} for r in range(2)})
    processes = start_ranks(spec)
    try:
        await_registered(processes)
        job: dict[str, Any] = {}
        for _ in range(200):
            (job,) = daemon_status(nodes[0].socket)["jobs"]
            if job["iteration"] >= 20:
                break
        assert job["iteration"] >= 20, job
        # Iteration 0 may run before the client knows the plan (then: a message per layer).
        assert job["ready_messages"] <= job["iteration"] + 1 + len(layers), job
    finally:
        kill_all(processes)
        collect(processes)
