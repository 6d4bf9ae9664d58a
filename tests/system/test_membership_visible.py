"""A membership change is visible (issue 36, item 5): Prometheus counts it on every survivor's
daemon, `commd status` shows the epoch, the members and what changed, `commd trace` marks it.
Real daemons on 127.0.0.1 (one rank each, real Gloo) and a rank killed mid-iteration; the
survivors are held alive in the new epoch while the daemons are asked."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest
from metrics_scrape import metrics_address, scrape, value
from prometheus_client.parser import text_string_to_metric_families
from test_fault_tolerance import LAYERS, expected_digest, results

from commd.cli.status import CHANGES_SHOWN, render
from commd.daemon.metrics import Counts, Metrics
from commd.job.schedule import make_plan
from commd.job.trace import MAX_CHANGE, TraceRecorder
from commd.testing.daemons import LocalDaemon, daemon_set
from commd.testing.processes import start_json_worker, stop_process
from commd.testing.ranks import daemon_status
from commd_protocol import Layer, Register, TraceReply, TraceRequest
from commd_protocol.status import DaemonStatus, read_status

pytestmark = pytest.mark.timeout(180)

WORKER = str(Path(__file__).parents[1] / "membership_worker.py")
PEER_TIMEOUT_S = 3
WAIT_S = 60.0  # for a rank to reach a gate, a trace to be armed


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[list[LocalDaemon]]:
    """Three daemons serving metrics on free ports."""
    with daemon_set(tmp_path, 3, "--peer-timeout-s", str(PEER_TIMEOUT_S),
                    "--metrics-listen", "127.0.0.1:0") as started:
        yield started


def await_condition(check: Callable[[], bool], what: str,
                    processes: list[subprocess.Popen[str]]) -> None:
    """Poll ``check`` (a file, a daemon's answer) until it holds; fails at WAIT_S, or at once
    when every rank has exited (it never will then)."""
    deadline = time.monotonic() + WAIT_S
    while not check():
        if all(p.poll() is not None for p in processes):
            pytest.fail(f"the ranks exited before {what}: {results(processes)}")
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.02)  # polling a condition, with a deadline


def traces_running(socket: str) -> int:
    shares = daemon_status(socket).get("shares", [])
    return sum(share["held"] for share in shares if share["kind"] == "traces running")


def status_text(socket: str) -> str:
    """`commd status` (the human form) of the daemon at ``socket``."""
    completed = subprocess.run(
        [sys.executable, "-m", "commd.cli", "status", "--socket", socket],
        capture_output=True, text=True, timeout=30, check=True)
    return completed.stdout


def test_a_lost_rank_is_counted_shown_and_traced(nodes: list[LocalDaemon],
                                                  tmp_path: Path) -> None:
    """Rank 2 dies on the wire in iteration 2 while `commd trace` records the survivors'
    daemons; held in iteration 5, the survivors' daemons count one loss, their status names
    epoch 1 and rank 2's node, the coordinator's section says epoch 1, and the trace holds
    an "epoch 1" mark naming the lost ranks."""
    job = f"vis-{uuid.uuid4().hex[:8]}"
    progress = tmp_path / job
    progress.mkdir()
    env = {**os.environ, "COMMD_FAULT_TOLERANCE": "continue"}
    iterations, lost_at, hold_after = 8, 2, 5
    processes = []
    for rank, node in enumerate(nodes):
        spec = {"job": job, "rank": rank, "world_size": 3, "coordinator": nodes[0].address,
                "socket": node.socket, "timeout": 60.0, "layers": LAYERS,
                "iterations": iterations, "progress_dir": str(progress), "gate_before": 1,
                **({"die_at": lost_at} if rank == 2 else
                   {"loss_at": lost_at, "hold_after": hold_after})}
        processes.append(start_json_worker([sys.executable, WORKER], spec, env=env))
    trace_file = tmp_path / "trace.json"
    tracer: subprocess.Popen[str] | None = None
    try:
        await_condition(lambda: all((progress / f"gated-{r}").exists() for r in range(3)),
                        "every rank reached the gate", processes)
        tracer = subprocess.Popen(
            [sys.executable, "-m", "commd.cli", "trace", "--socket", nodes[0].socket,
             "--socket", nodes[1].socket, "--job", job, "-n", "4", "-o", str(trace_file),
             "--timeout", "90"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        await_condition(lambda: all(traces_running(n.socket) == 1 for n in nodes[:2]),
                        "the trace was armed on both survivors' daemons", processes)
        (progress / "go").touch()
        await_condition(lambda: all((progress / f"held-{r}").exists() for r in (0, 1)),
                        "both survivors held in the new epoch", processes)

        # Prometheus: one loss on each survivor's daemon; the victim's never resumed.
        for index, expected in ((0, 1.0), (1, 1.0), (2, 0.0)):
            samples, kinds = scrape(metrics_address(nodes[index]))
            assert "commd_membership_changes counter" in kinds
            assert value(samples, "commd_membership_changes_total", kind="lost") == expected
            assert value(samples, "commd_membership_changes_total", kind="joined") == 0.0
        for node in nodes[:2]:
            samples, _ = scrape(metrics_address(node))
            assert value(samples, "commd_job_membership_epoch", job=job) == 1.0
            assert value(samples, "commd_job_membership_ranks", job=job) == 2.0

        # `commd status`: the mode, epoch and members, and the change naming rank 2's node.
        for node in nodes[:2]:
            text = status_text(node.socket)
            assert f"{job}: fault tolerance continue: epoch 1, ranks 0,1 (2 of 3)" in text, text
            change = next(line for line in text.splitlines()
                          if line.startswith(f"{job}: epoch 1: "))
            assert "(ranks [2]) lost" in change, text
        coordinator = status_text(nodes[0].socket)
        assert f"coordinating {job}: formed, 2 node(s) of a world of 3 rank(s), epoch 1" \
            in coordinator, coordinator
    finally:
        (progress / "go").touch()
        (progress / "release").touch()
    outcome = results(processes)
    assert outcome[2]["returncode"] == 17
    for rank in (0, 1):
        assert "error" not in outcome[rank], outcome[rank]
        assert outcome[rank]["members"] == [0, 1]
        assert len(outcome[rank]["digests"]) == iterations
    assert outcome[0]["digests"] == outcome[1]["digests"]
    assert outcome[0]["digests"][-1] == expected_digest([0, 1], iterations - 1)

    # `commd trace`: an instant "epoch 1" on the membership row of both survivors' nodes.
    assert tracer is not None
    try:
        _, err = tracer.communicate(timeout=60)
    finally:
        stop_process(tracer)
    assert tracer.returncode == 0, err
    trace = json.loads(trace_file.read_text())
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"]
               if e["name"] == "thread_name"}
    marks = [e for e in trace["traceEvents"] if e.get("cat") == "membership"]
    assert sorted(e["pid"] for e in marks) == [1, 2], marks
    for mark in marks:
        assert mark["name"] == "epoch 1" and mark["ph"] == "i", mark
        assert threads[mark["pid"], mark["tid"]] == "membership"
        assert "(ranks [2]) lost" in mark["args"]["change"], mark
        assert mark["args"]["ranks"] == "0,1" and mark["args"]["world_size"] == 2
        # The iteration the survivors go on from: the lost one again, or the next where the
        # lost one's commit went through before the loss.
        assert mark["args"]["iteration"] in (lost_at, lost_at + 1), mark


def tolerant_status(changes: int) -> DaemonStatus:
    history = [f"epoch {n}: node 10.0.0.{n} (ranks [{n}]) lost: rank {n} exited"
               for n in range(1, changes + 1)]
    return read_status({
        "version": "0.1.0", "protocol": 2, "backend": "gloo", "uptime_s": 5.0,
        "jobs": [{"job": "ft", "state": "running", "world_size": 40, "local_ranks": [0],
                  "nodes": 40 - changes, "node_index": 0, "iteration": 70,
                  "fault_tolerance": "continue", "epoch": changes,
                  "members": [0, *range(changes + 1, 40)], "membership_changes": history},
                 {"job": "plain", "state": "running", "world_size": 2, "local_ranks": [0],
                  "nodes": 2, "node_index": 0, "iteration": 3}],
        "coordinating": [{"job": "ft", "formed": True, "nodes": 40 - changes,
                          "world_size": 40, "epoch": changes, "membership_changes": history},
                         {"job": "orphan", "formed": True, "nodes": 1, "world_size": 2,
                          "epoch": 1, "membership_changes": ["epoch 1: rank 0 lost"]}]})


def test_status_shows_the_last_changes_and_how_many_came_before() -> None:
    lines = render(tolerant_status(CHANGES_SHOWN + 3)).splitlines()
    epoch = CHANGES_SHOWN + 3
    head = next(line for line in lines if line.startswith("ft: fault tolerance"))
    assert head.startswith(f"ft: fault tolerance continue: epoch {epoch}, ranks 0,{epoch + 1},")
    assert head.endswith(",38,39 (32 of 40)")
    assert "ft: ... 3 earlier change(s) (--json lists them)" in lines
    shown = [line for line in lines if line.startswith("ft: epoch ")]
    assert [line.split(":")[1] for line in shown] == \
        [f" epoch {n}" for n in range(4, epoch + 1)]
    # The coordinator's section: the epoch; the changes only where no job row tells them.
    assert f"coordinating ft: formed, {40 - epoch} node(s) of a world of 40 rank(s), " \
           f"epoch {epoch}" in lines
    assert not any(line.startswith("coordinating ft: epoch") for line in lines)
    assert "coordinating orphan: epoch 1: rank 0 lost" in lines
    # A job without fault tolerance shows none of it.
    assert not any(line.startswith("plain: ") for line in lines)


def test_a_tolerant_job_before_any_change_says_every_rank() -> None:
    status = tolerant_status(0)
    lines = render(status).splitlines()
    assert "ft: fault tolerance continue: epoch 0, ranks 0,1,2,3,4,5,6,7,8,9,10,11,12,13,14," \
           "15,16,17,18,19,20,21,22,23,24,25,26,27,28,29,30,31,... (+8) (40 of 40)" in lines
    status.jobs[0].members = []
    assert "ft: fault tolerance continue: epoch 0, every rank (40)" in render(status).splitlines()
    assert "coordinating ft: formed, 40 node(s) of a world of 40 rank(s)" in render(status)


def counter(metrics: Metrics) -> dict[str, float]:
    text = metrics.render().decode()
    return {sample.labels["kind"]: sample.value
            for family in text_string_to_metric_families(text)
            if family.name == "commd_membership_changes" for sample in family.samples
            if sample.name.endswith("_total")}


@pytest.mark.parametrize("kind", ["", "LOST", "x" * 100_000, "lost\n", "joined "],
                         ids=["empty", "upper", "huge", "newline", "space"])
def test_the_kind_label_stays_bounded(kind: str) -> None:
    """Whatever word a caller passes, the counter keeps its three series."""
    status = DaemonStatus(version="0", protocol=2, backend="gloo", uptime_s=0.0)
    metrics = Metrics(lambda: status, Counts, {})
    assert counter(metrics) == {"lost": 0.0, "joined": 0.0, "other": 0.0}
    metrics.membership_changed("j", "lost")
    metrics.membership_changed("j", "joined")
    metrics.membership_changed("j", kind)
    assert counter(metrics) == {"lost": 1.0, "joined": 1.0, "other": 1.0}


def test_a_job_without_fault_tolerance_has_no_epoch_gauge() -> None:
    status = tolerant_status(2)
    metrics = Metrics(lambda: status, Counts, {})
    samples: dict[tuple[str, str], float] = {
        (sample.name, sample.labels.get("job", "")): sample.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for sample in family.samples}
    assert samples["commd_job_membership_epoch", "ft"] == 2.0
    assert samples["commd_job_membership_ranks", "ft"] == 38.0
    assert ("commd_job_membership_epoch", "plain") not in samples
    assert ("commd_job_iterations_total", "plain") in samples


class Traced:
    """What a recorder needs of a pipeline (``commd.job.trace.Traced``), between iterations."""

    def __init__(self) -> None:
        self.trace: TraceRecorder | None = None
        self.iteration = 4
        self.in_flight = False


def registration() -> Register:
    return Register(layers=[Layer(name="w", size=8), Layer(name="b", size=2)], dtype="float32",
                    op="avg", fault_tolerance="continue")


async def test_a_mark_before_the_first_iteration_and_at_the_timeout_is_kept() -> None:
    """Marked as soon as it happens, also before the first recorded iteration; at the timeout
    the iteration under way goes, its membership mark stays; the node's new place is told."""
    replies: list[msgspec.Struct] = []
    pipeline = Traced()
    recorder = TraceRecorder(TraceRequest(job="j", iterations=3, timeout_s=0.2),
                             replies.append)
    recorder.arm(pipeline, registration(), None)
    change = "node 10.0.0.3 (ranks [2]) lost: " + "why " * 200
    recorder.membership(1, [0, 1], change, (1, 2), 4)
    plan = make_plan(1, [[0, 1]], [8, 2])
    recorder.iteration(4, plan, np.array([1.0, 1.0]))
    recorder.membership(2, [1], "node 10.0.0.1 (ranks [0]) lost: gone", (0, 1), 5)
    recorder.group(5, plan, 0)  # iteration 5 begins, never ends
    await until_replied(replies)
    (reply,) = replies
    assert isinstance(reply, TraceReply) and reply.iterations == [4]
    assert (reply.node_index, reply.nodes) == (0, 1)
    marks = [e for e in reply.events if e.row == "membership"]
    assert [(m.name, m.iteration, m.duration_s) for m in marks] == \
        [("epoch 1", 4, None), ("epoch 2", 5, None)]
    assert marks[0].args["change"] == change[:MAX_CHANGE]
    assert (marks[0].args["ranks"], marks[0].args["world_size"], marks[0].args["node"]) == \
        ("0,1", 2, "1/2")
    assert "timeout" in reply.truncated and pipeline.trace is None


async def until_replied(replies: list[msgspec.Struct]) -> None:
    while not replies:
        await asyncio.sleep(0.01)  # polling a condition, bounded by the test's timeout
