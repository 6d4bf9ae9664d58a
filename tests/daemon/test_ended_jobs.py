"""A job's last record stays in ``commd status`` after it ends (``DaemonStatus.ended``): a
finished job with its iterations and plan, a failed one with its message, the last 8 only."""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Any

import pytest

from commd.daemon.ended import KEPT
from commd.daemon.server import Daemon
from commd.testing.ranks import JobSpec, collect, daemon_status, start_ranks

from inprocess import hello
from polling import until

LAYERS = [("conv1.weight", 27), ("conv1.bias", 3), ("fc.weight", 130), ("fc.bias", 10)]


def ended_record(socket: str, job: str, timeout: float = 30.0) -> tuple[dict[str, Any],
                                                                         dict[str, Any]]:
    """``commd status --json`` once ``job`` is under ``ended`` (its ranks' exits reach the
    daemon a moment after they exit), and that record."""
    deadline = time.monotonic() + timeout
    while True:
        status = daemon_status(socket)
        record = next((r for r in status.get("ended", []) if r["status"]["job"] == job), None)
        if record is not None:
            return status, record
        assert time.monotonic() < deadline, f"{job} never ended: {status}"
        time.sleep(0.05)  # polling a condition, with a deadline


def status_text(socket: str) -> str:
    return subprocess.run(
        [sys.executable, "-m", "commd.cli", "status", "--socket", socket],
        capture_output=True, text=True, timeout=30, check=True).stdout


@pytest.mark.timeout(120)
def test_a_finished_job_stays_in_status(start_daemon) -> None:
    node = start_daemon()
    spec = JobSpec("short", [node], 2, LAYERS, iterations=3)
    started = time.time()
    for result in collect(start_ranks(spec)):
        assert result["returncode"] == 0 and "error" not in result, result
    status, record = ended_record(node.socket, "short")
    assert [job["job"] for job in status["jobs"]] == []  # gone from the job table
    assert record["outcome"] == "finished"
    assert started <= record["ended_at"] <= time.time()
    job = record["status"]
    assert job["state"] == "closed" and job["iteration"] == 3
    assert job["planner"] == "wfbp" and job["plan_version"] is not None
    assert len(job["groups"]) == len(LAYERS) and job["plan_reason"]
    assert job["local_ranks"] == [0, 1] and job["iteration_s"]["mean"] > 0
    text = status_text(node.socket)
    assert "no jobs\nended (newest first):\nshort: finished " in text, text
    assert ": 3 iteration(s), step " in text and "short: plan v" in text, text


@pytest.mark.timeout(120)
def test_a_failed_job_stays_in_status_with_its_message(start_daemon, tmp_path) -> None:
    node = start_daemon()
    progress = {rank: {"progress_dir": str(tmp_path)} for rank in range(2)}
    spec = JobSpec("doomed", [node], 2, LAYERS, iterations=5, timeout=60,
                   overrides={**progress, 1: {**progress[1], "die_at": 2}})
    results = collect(start_ranks(spec))
    assert results[1]["returncode"] == 17
    assert "rank 1" in results[0]["error"], results[0]
    _, record = ended_record(node.socket, "doomed")
    assert record["outcome"].startswith("failed: commd: job 'doomed': rank 1 "), record
    assert record["outcome"] == f"failed: {record['status']['error']}"
    assert record["status"]["state"] == "failed" and record["status"]["iteration"] == 2
    text = status_text(node.socket)
    assert "doomed: failed " in text and ": 2 iteration(s)" in text, text
    assert f"doomed: {record['status']['error']}" in text.splitlines(), text


async def test_the_daemon_keeps_the_last_8_ended_jobs(daemon: Daemon, connect: Any) -> None:
    """Jobs whose one rank said goodbye before registering: each ends "closed while
    forming"; after ten, the last eight are kept, newest first, and sent on the wire."""
    for number in range(KEPT + 2):
        client = connect()
        assert (await client.ask(hello(job=f"j{number}")))["type"] == "welcome"
        await client.send({"type": "goodbye"})
        await until(lambda n=number: any(r.status.job == f"j{n}" for r in daemon.status().ended),
                    f"j{number} among the ended jobs")
    ended = daemon.status().ended
    assert [r.status.job for r in ended] == [f"j{n}" for n in range(KEPT + 1, 1, -1)]
    assert {r.outcome for r in ended} == {"closed while forming"}
    assert daemon.status().jobs == []
    reply = await connect().ask({"type": "status"})
    assert [r["status"]["job"] for r in reply["status"]["ended"]] == [r.status.job for r in ended]
