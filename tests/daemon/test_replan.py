"""Runtime profiling drives a re-plan that takes effect at the same iteration everywhere."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from commd.testing.processes import kill_all
from commd.testing.ranks import JobSpec, await_registered, collect, daemon_status, start_ranks


@pytest.mark.timeout(180)
def test_replan_takes_effect_at_the_same_iteration_on_every_node(start_daemon) -> None:
    nodes = [start_daemon(), start_daemon()]
    # Four 1 MiB layers, 8 ms of "backward" each: overlapping pays, so once the profile is
    # measured the optimal plan splits the single group it started with (nothing measured).
    layers = [(f"layer{i}", 262144) for i in range(4)]
    spec = JobSpec("replan", nodes, 2, layers, iterations=16, planner="optimal", timeout=60,
                   overrides={r: {"backward_sleep_s": [0.008] * 4, "skip_results": True}
                              for r in range(4)})
    processes = start_ranks(spec)
    results = collect(processes)
    for result in results:
        assert "error" not in result, result
    plans = [result["plans"] for result in results]
    assert all(p == plans[0] for p in plans), plans  # every rank, every node, same iteration
    first, last = plans[0][0], plans[0][-1]
    assert last > first, plans[0]
    switch = plans[0].index(last)
    assert 10 <= switch <= 13, plans[0]  # reported after iteration 9, effective 2 later

    histories = []
    for node in nodes:
        status = json.loads(subprocess.run(
            [sys.executable, "-m", "commd.cli", "status", "--socket", node.socket, "--json"],
            capture_output=True, text=True, timeout=30, check=True).stdout)
        histories.append(status)
    assert histories[0]["jobs"] == []  # the job ended and was cleaned up on both nodes


def test_status_reports_model_and_prediction(start_daemon) -> None:
    nodes = [start_daemon(), start_daemon()]
    layers = [(f"layer{i}", 65536) for i in range(3)]
    spec = JobSpec("model", nodes, 1, layers, iterations=1000, timeout=30,
                   overrides={r: {"skip_results": True} for r in range(2)})
    processes = start_ranks(spec)
    try:
        await_registered(processes)
        (job,) = daemon_status(nodes[0].socket)["jobs"]
        # Fitted by the probe (a noisy machine may pin one term at 0, never both).
        assert job["alpha_s"] >= 0 and job["beta_s_per_byte"] >= 0, job
        assert job["alpha_s"] + job["beta_s_per_byte"] * (1 << 20) > 0, job
        assert job["predicted_comm_s"] is not None and job["plan_version"] >= 1
        assert job["plan_history"][0]["iteration"] == 0
    finally:
        kill_all(processes)
        collect(processes)
