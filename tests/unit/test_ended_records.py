"""The daemon's last ended jobs (``DaemonStatus.ended``): the bounded records, how an ending is
worded, the status map an older daemon sends without them, and their text rendering."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest

from commd.cli.main import build_parser
from commd.cli.status import render
from commd.daemon.ended import KEPT, MAX_TEXT, EndedJobs, outcome
from commd_protocol import StatusReply, encode
from commd_protocol.status import (
    CandidateTiming,
    DaemonStatus,
    EndedJob,
    IterationTiming,
    JobState,
    JobStatus,
    read_status,
    status_map,
)

BASE: dict[str, Any] = {"version": "0.1.0", "protocol": 2, "backend": "gloo", "uptime_s": 60.0,
                        "pid": 7, "socket": "/run/commd/commd.sock", "listen": "0.0.0.0:29600"}


def snapshot(job: str, **fields: Any) -> JobStatus:
    fields = {"state": JobState.CLOSED, "nodes": 2, "node_index": 0, **fields}
    return JobStatus(job=job, world_size=4, local_ranks=[0, 1], **fields)


def test_the_records_are_capped_newest_first() -> None:
    ended = EndedJobs()
    for number in range(KEPT + 5):
        ended.add(snapshot(f"job{number}", iteration=number), "finished", 1000.0 + number)
    records = ended.status()
    assert len(records) == len(ended) == KEPT == 8
    assert [r.status.job for r in records] == [f"job{n}" for n in range(KEPT + 4, 4, -1)]
    assert [r.ended_at for r in records] == [1000.0 + n for n in range(KEPT + 4, 4, -1)]


def test_peer_given_texts_are_cut() -> None:
    """A coordinator's failure or stall message may be megabytes: a record keeps MAX_TEXT."""
    ended = EndedJobs()
    huge = "x" * (1 << 20)
    ended.add(snapshot("j", state=JobState.FAILED, error=huge, stall=huge,
                       membership_changes=[huge, "epoch 1: fine"], compression=huge),
              outcome(JobState.RUNNING, huge), 0.0)
    (record,) = ended.status()
    job = record.status
    for text in (record.outcome, job.error, job.stall, job.membership_changes[0],
                 job.compression):
        assert text is not None and len(text) <= MAX_TEXT + len("failed: ")
    assert record.outcome.startswith("failed: xxx") and record.outcome.endswith("...")
    assert job.membership_changes[1] == "epoch 1: fine"


def test_how_a_job_ended_is_worded() -> None:
    assert outcome(JobState.RUNNING, None) == "finished"
    assert outcome(JobState.REFORMING, None) == "finished"
    assert outcome(JobState.FAILED, "commd: job 'j': rank 3 exited") == \
        "failed: commd: job 'j': rank 3 exited"
    assert outcome(JobState.RUNNING, "commd: boom") == "failed: commd: boom"
    assert outcome(JobState.FORMING, None) == "closed while forming"
    assert outcome(JobState.STARTING, None) == "closed while starting"


def test_an_older_daemons_status_decodes_without_ended() -> None:
    status = read_status(BASE)  # no "ended" key, as an older daemon sends
    assert status.ended == []
    assert "ended" not in render(status, now=0.0)


def test_ended_jobs_travel_the_wire() -> None:
    record = EndedJob(status=snapshot("demo", iteration=17, plan_version=1),
                      outcome="finished", ended_at=1_700_000_000.5)
    sent = status_map(DaemonStatus(**BASE, ended=[record]))
    assert sent["ended"][0]["outcome"] == "finished"
    assert sent["ended"][0]["status"]["iteration"] == 17
    reply = msgspec.msgpack.decode(encode(StatusReply(status=sent)), type=StatusReply)
    assert read_status(reply.status).ended == [record]
    # a newer daemon's extra keys in a record are ignored
    newer = {**sent, "ended": [{**sent["ended"][0], "by_uid": 1000, "more": [1]}]}
    assert read_status(newer).ended == [record]


def test_render_ended_jobs_after_the_running_ones() -> None:
    ended_at = 1_700_000_000.0
    finished = EndedJob(
        status=snapshot(
            "demo", iteration=17, planner="optimal", plan_version=2, groups=[[3, 2], [1, 0]],
            plan_reason="measured comm 12% under the model",
            iteration_s=IterationTiming(last=0.0209, mean=0.0214),
            compression="auto", ratio=0.01, exchanges=["allgather", "dense"], gain=0.25,
            selection="measured",
            choice="auto: low-rank (PowerSGD rank 4, 3.1% of the bytes): the network held 40% "
                   "of the dense step (8.0 of 20.0 ms)",
            candidates=[CandidateTiming(name="dense", predicted_s=0.0031, measured_s=0.0030),
                        CandidateTiming(name="allgather@0.01", predicted_s=0.0012)]),
        outcome="finished", ended_at=ended_at)
    failed = EndedJob(
        status=snapshot("doomed", state=JobState.FAILED, iteration=2, planner="wfbp",
                        plan_version=1, groups=[[0]], plan_reason="first plan",
                        error="commd: job 'doomed': rank 3 exited"),
        outcome="failed: commd: job 'doomed': rank 3 (pid 9) exited without closing its client",
        ended_at=ended_at - 120)
    never = EndedJob(status=snapshot("early", state=JobState.CLOSED, nodes=None,
                                     node_index=None),
                     outcome="closed while forming", ended_at=ended_at - 7200)
    running = snapshot("live", state=JobState.RUNNING, iteration=5, planner="wfbp")
    status = DaemonStatus(**BASE, jobs=[running], ended=[finished, failed, never])
    lines = render(status, now=ended_at + 12).splitlines()
    clock = time.strftime("%H:%M:%S", time.localtime(ended_at))
    start = lines.index("ended (newest first):")
    assert any(line.startswith("live ") for line in lines[:start])  # the running table first
    assert lines[start + 1:] == [
        f"demo: finished {clock} (12s ago): 17 iteration(s), step 21.4 ms (last 20.9), "
        "ranks 0,1 of 4, node 0/2",
        "demo: plan v2 optimal, 2 group(s) (measured comm 12% under the model)",
        "demo: compression auto: ratio 0.01, groups by exchange: 1 allgather, 1 dense, "
        "gain 0.250, exchange measured",
        "demo: candidates (ms per iteration): dense predicted 3.1 measured 3.0, "
        "allgather@0.01 predicted 1.2",
        "demo: choice auto: low-rank (PowerSGD rank 4, 3.1% of the bytes): the network held 40% "
        "of the dense step (8.0 of 20.0 ms)",
        f"doomed: failed {time.strftime('%H:%M:%S', time.localtime(ended_at - 120))} "
        "(2m ago): 2 iteration(s), ranks 0,1 of 4, node 0/2",
        "doomed: commd: job 'doomed': rank 3 (pid 9) exited without closing its client",
        "doomed: plan v1 wfbp, 1 group(s) (first plan)",
        f"early: closed while forming {time.strftime('%H:%M:%S', time.localtime(ended_at - 7200))}"
        " (2h ago): 0 iteration(s), ranks 0,1 of 4",
    ]


def test_render_ended_jobs_with_none_running() -> None:
    record = EndedJob(status=snapshot("demo", iteration=3), outcome="finished", ended_at=100.0)
    lines = render(DaemonStatus(**BASE, ended=[record]), now=100.0).splitlines()
    assert lines[lines.index("no jobs") + 1] == "ended (newest first):"
    assert lines[-1].startswith("demo: finished ") and "(0s ago): 3 iteration(s)" in lines[-1]


def test_help_names_the_ended_jobs(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["status", "--help"])
    text = capsys.readouterr().out
    assert "last 8 jobs that ended here" in text and "'ended'" in text
