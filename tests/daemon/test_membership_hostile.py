"""Membership messages that do not fit (issue 36's hostile cases), on the node's side: a node
fails its job with a typed INVALID error on a resume that does not fit; the codec refuses
malformed frames of the four reform messages, and a daemon's peer port drops them. The node is
a real in-process daemon whose own coordinator sends the frames over its real peer sockets.
The coordinator's side is in tests/unit/test_membership_coordinator.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import msgpack
import msgspec
import pytest
import zmq.asyncio
from membership_cases import JOB

from commd.daemon.server import Daemon
from commd.daemon.sockets import bind_peers
from commd.job.membership import MAX_CHANGE_CHARS
from commd_client.host_buffer import HostBuffer
from commd_protocol import (
    ErrorCode,
    PeerAbort,
    PeerJoin,
    PeerPlan,
    PeerRedirect,
    PeerReform,
    PeerResume,
    ProtocolViolation,
)
from commd_protocol.codec import MAX_MESSAGE_BYTES, peer_codec
from commd_protocol.limits import MAX_LOCAL_RANKS
from commd_protocol.status import JobState

from inprocess import RawClient, coordinator_of, hand_over, hello, peer_dealer, still_serving
from polling import until

WAIT_S = 90.0  # every wait on the daemon here, inside the test's timeout: a hang is named

# --- the node: a resume that does not fit ------------------------------------------------------


@pytest.fixture
async def tolerant_job(daemon: Daemon, connect: Any) -> AsyncIterator[tuple[RawClient, str]]:
    """A one-rank fault_tolerance="continue" job that this in-process daemon coordinates and
    runs, stopped for epoch 1 by its coordinator's PeerReform: the job id and its rank."""
    client = connect()
    buffer = HostBuffer("commd-test-tolerant", 16)
    try:
        welcome = await client.ask(hello(job=JOB, coordinator=coordinator_of(daemon)))
        assert welcome["type"] == "welcome", welcome
        token = await hand_over(daemon, buffer)
        reply = await client.ask({"type": "register", "dtype": "float32", "op": "sum",
                                  "planner": "wfbp", "buffer_token": token,
                                  "layers": [{"name": "w", "size": 4}],
                                  "fault_tolerance": "continue"})
        assert reply["type"] == "registered", reply
        await until(lambda: daemon.jobs[JOB].state is JobState.RUNNING, "the job running", WAIT_S)
        send_to_node(daemon, PeerReform(job=JOB, epoch=1, change="node x (ranks [7]) lost"))
        await until(lambda: daemon.jobs[JOB].state is JobState.REFORMING, "the job reforming",
                    WAIT_S)
        yield client, JOB
    finally:
        buffer.close()


async def join_one_of_two(daemon: Daemon, client: RawClient, buffer: HostBuffer) -> None:
    """Rank 0 of a two-rank tolerant job that the in-process daemon coordinates registers:
    the node joins, and waits there for rank 1, which never comes."""
    welcome = await client.ask(hello(job=JOB, world=2, coordinator=coordinator_of(daemon)))
    assert welcome["type"] == "welcome", welcome
    token = await hand_over(daemon, buffer)
    await client.send({"type": "register", "dtype": "float32", "op": "sum", "planner": "wfbp",
                       "buffer_token": token, "layers": [{"name": "w", "size": 4}],
                       "fault_tolerance": "continue"})
    await until(lambda: JOB in daemon._coordinator._jobs,  # its join reached it: joining
                "the job's join at its coordinator", WAIT_S)
    assert daemon.jobs[JOB].state is JobState.JOINING


def send_to_node(daemon: Daemon, message: msgspec.Struct) -> None:
    """``message`` from the job's coordinator to its one node, over the real peer sockets."""
    node = next(iter(daemon._coordinator._jobs[JOB].joins))
    daemon._coordinator._send(node, message)


def resume(**fields: Any) -> PeerResume:
    base: dict[str, Any] = {"job": JOB, "epoch": 1, "node_index": 0, "nodes": 1,
                            "store_port": 0, "store_prefix": "p", "members": [0],
                            "iteration": 0, "change": "node x (ranks [7]) lost"}
    return PeerResume(**{**base, **fields})


@pytest.mark.parametrize(("fields", "words"), [
    ({"epoch": 2}, "a resume for epoch 2 while the job is reforming (stopped for epoch 1)"),
    ({"epoch": 0}, "a resume for epoch 0"),
    ({"node_index": 1}, "node index 1 of 1 nodes"),
    ({"node_index": -1}, "node index -1 of 1 nodes"),
    ({"nodes": 0}, "node index 0 of 0 nodes"),
    ({"members": []}, "its ranks must be distinct and sorted"),
    ({"members": [0, 0]}, "its ranks must be distinct and sorted"),
    ({"members": [1, 0], "nodes": 2}, "its ranks must be distinct and sorted"),
    ({"members": [-1]}, "its ranks must lie in 0..0"),
    ({"members": [2**40]}, "its ranks must lie in 0..0"),
    ({"members": list(range(300_000))}, "its ranks must lie in 0..0"),  # huge, sorted
    ({"iteration": 5}, "the coordinator resumes at iteration 5, but this node delivered 0"),
    ({"iteration": -1}, "the coordinator resumes at iteration -1"),
], ids=lambda value: str(value)[:40])
async def test_a_resume_that_does_not_fit_fails_the_job_with_a_typed_error(
        daemon: Daemon, tolerant_job: tuple[RawClient, str], connect: Any,
        fields: dict[str, Any], words: str) -> None:
    client, job = tolerant_job
    send_to_node(daemon, resume(**fields))
    told = await client.receive()
    assert told["type"] == "error" and told["code"] == "invalid" and told["fatal"], told
    assert told["message"].startswith(f"commd: job {job!r}: "), told
    assert words in told["message"], told
    assert daemon.jobs[job].state is JobState.FAILED
    await still_serving(connect())


async def test_a_resume_that_fits_runs_the_job_in_the_new_epoch(
        daemon: Daemon, tolerant_job: tuple[RawClient, str]) -> None:
    """The control: the same frames, well formed, resume the job (so the failures above are
    the checks' doing)."""
    _, job = tolerant_job
    send_to_node(daemon, resume(change="x" * (10 * MAX_CHANGE_CHARS)))
    await until(lambda: daemon.jobs[job].state is JobState.RUNNING, "the job resumed", WAIT_S)
    status = next(j for j in daemon.status().jobs if j.job == job)
    assert (status.epoch, status.members) == (1, [0])
    assert status.membership_changes == [f"epoch 1: {'x' * MAX_CHANGE_CHARS}"]  # cut to size


async def test_a_plan_decided_while_the_change_runs_is_kept_for_after_the_resume(
        daemon: Daemon, tolerant_job: tuple[RawClient, str]) -> None:
    """A node reported a round and awaits its decision; the coordinator decides it while a
    change stops the node (a replacement joins as the round closes). It sends that decision
    once: dropped while reforming, the iteration after the resume waited for it forever."""
    _, job = tolerant_job
    pipeline = daemon.jobs[job].pipeline
    assert pipeline is not None
    pipeline.expect_decision(2)  # the node reported round 0 of iterations 0..
    assert pipeline.upcoming_plan(2) is None  # undecided: iteration 2 would wait
    send_to_node(daemon, PeerPlan(job=job, round=1, effective_iteration=2, version=7,
                                  groups=[[0]], alpha_s=1e-4, beta_s_per_byte=1e-9,
                                  predicted_comm_s=1e-3, reason="decided during the change"))
    send_to_node(daemon, resume())
    await until(lambda: daemon.jobs[job].state is JobState.RUNNING, "the job resumed", WAIT_S)
    plan = pipeline.upcoming_plan(2)
    assert plan is not None and plan.version == 7
    assert daemon.jobs[job].last_plan is not None
    assert daemon.jobs[job].last_plan.reason == "decided during the change"


async def test_a_change_folded_into_a_later_one_at_once_resumes_in_the_later_epoch(
        daemon: Daemon, tolerant_job: tuple[RawClient, str], connect: Any) -> None:
    """The coordinator resumes epoch 1 and at once starts epoch 2 (the next node left as the
    first change ended): resume 1, reform 2 and resume 2 arrive back to back. Resume 1 was
    checked only once its task ran, after reform 2 was handled, and failed the job as out
    of turn; checked in wire order it fits, and the job runs in epoch 2."""
    client, job = tolerant_job
    send_to_node(daemon, resume())
    send_to_node(daemon, PeerReform(job=job, epoch=2, change="node y (ranks [8]) lost"))
    send_to_node(daemon, resume(epoch=2, change="node y (ranks [8]) lost"))
    await until(lambda: daemon.jobs[job].epochs.epoch == 2
                or daemon.jobs[job].state is JobState.FAILED, "epoch 2 or a failed job", WAIT_S)
    await still_serving(connect())
    assert daemon.jobs[job].state is JobState.RUNNING, daemon.jobs[job].error
    assert await client.socket.poll(0) == 0  # no error reached the rank


async def test_a_resume_or_reform_out_of_turn_is_ignored(
        daemon: Daemon, tolerant_job: tuple[RawClient, str], connect: Any) -> None:
    """Once resumed, a repeated resume, an old reform and a resume for a running job change
    nothing: no error reaches the rank, the job runs in epoch 1."""
    client, job = tolerant_job
    send_to_node(daemon, resume())
    await until(lambda: daemon.jobs[job].state is JobState.RUNNING, "the job resumed", WAIT_S)
    send_to_node(daemon, resume())
    send_to_node(daemon, PeerReform(job=job, epoch=1, change="again"))
    send_to_node(daemon, PeerReform(job=job, epoch=0, change="old"))
    send_to_node(daemon, resume(epoch=5))
    await still_serving(connect())  # the frames above went through the loop before this
    assert daemon.jobs[job].state is JobState.RUNNING and daemon.jobs[job].epochs.epoch == 1
    assert await client.socket.poll(0) == 0  # nothing was sent to the rank


async def test_a_stale_drop_does_not_end_a_later_job_of_the_same_id(
        daemon: Daemon, connect: Any) -> None:
    """A node cut off from a running tolerant job is told it was dropped, but that word may
    arrive only once the link is back, after a replacement has started a job of the same id
    there: a drop that finds a job still joining is stale and ignored; any other abort
    still fails it, naming why."""
    client = connect()
    buffer = HostBuffer("commd-test-stale-drop", 16)
    try:
        await join_one_of_two(daemon, client, buffer)
        send_to_node(daemon, PeerAbort(job=JOB, code=ErrorCode.RANK_LOST, dropped=True,
                                       message="commd: job 'tol': this node was dropped"))
        await still_serving(connect())  # the drop went through the loop before this
        assert daemon.jobs[JOB].state is JobState.JOINING
        send_to_node(daemon, PeerAbort(job=JOB, code=ErrorCode.MISMATCH,
                                       message="commd: job 'tol': refused: layers differ"))
        told = await client.receive()
        assert told["type"] == "error" and told["code"] == "mismatch", told
        assert "refused: layers differ" in told["message"]
        assert daemon.jobs[JOB].state is JobState.FAILED
    finally:
        buffer.close()


# --- the codec ----------------------------------------------------------------------------------


def frame(tag: str, **fields: Any) -> bytes:
    packed: bytes = msgpack.packb({"type": tag, **fields})
    return packed


GOOD: dict[str, dict[str, Any]] = {
    "peer_reform": {"job": JOB, "epoch": 1, "change": "c"},
    "peer_reform_state": {"job": JOB, "epoch": 1, "delivered": 0, "committing": False},
    "peer_resume": {"job": JOB, "epoch": 1, "node_index": 0, "nodes": 1, "store_port": 0,
                    "store_prefix": "p", "members": [0], "iteration": 0},
    "peer_fault": {"job": JOB, "epoch": 1, "message": "m", "lost_ranks": [0]},
    "peer_abort": {"job": JOB, "code": "rank_lost", "message": "m", "dropped": True},
}
BAD: list[tuple[str, dict[str, Any], str]] = [
    ("peer_reform", {"epoch": "1"}, "$.epoch"),
    ("peer_reform", {"change": None}, "$.change"),
    ("peer_reform", {"job": 7}, "$.job"),
    ("peer_reform_state", {"delivered": 1.5}, "$.delivered"),
    ("peer_reform_state", {"committing": "yes"}, "$.committing"),
    ("peer_reform_state", {"epoch": [1]}, "$.epoch"),
    ("peer_resume", {"members": "0,1"}, "$.members"),
    ("peer_resume", {"members": [0, "1"]}, "$.members[1]"),
    ("peer_resume", {"members": [[0]]}, "$.members[0]"),
    ("peer_resume", {"node_index": None}, "$.node_index"),
    ("peer_resume", {"store_port": "29999"}, "$.store_port"),
    ("peer_resume", {"iteration": {"a": 1}}, "$.iteration"),
    ("peer_fault", {"lost_ranks": list(range(MAX_LOCAL_RANKS + 1))}, "$.lost_ranks"),
    ("peer_fault", {"lost_ranks": ["0"]}, "$.lost_ranks[0]"),
    ("peer_fault", {"message": b"bytes"}, "$.message"),
    ("peer_abort", {"dropped": "yes"}, "$.dropped"),
    ("peer_abort", {"dropped": [True]}, "$.dropped"),
]


@pytest.mark.parametrize(("tag", "fields", "where"), BAD,
                         ids=[f"{tag}-{where}" for tag, _, where in BAD])
def test_a_reform_message_of_the_wrong_shape_is_refused_naming_the_field(
        tag: str, fields: dict[str, Any], where: str) -> None:
    assert peer_codec.decode(frame(tag, **GOOD[tag])) is not None  # the control decodes
    with pytest.raises(ProtocolViolation) as refused:
        peer_codec.decode(frame(tag, **{**GOOD[tag], **fields}))
    assert refused.value.code == ErrorCode.MALFORMED
    assert f"bad {tag!r} message" in str(refused.value) and where in str(refused.value)


@pytest.mark.parametrize("tag", sorted(GOOD))
def test_a_reform_message_missing_a_field_is_refused(tag: str) -> None:
    for name in GOOD[tag]:
        if name in ("committing", "lost_ranks", "dropped"):
            continue  # defaulted
        fields = {k: v for k, v in GOOD[tag].items() if k != name}
        with pytest.raises(ProtocolViolation) as refused:
            peer_codec.decode(frame(tag, **fields))
        assert refused.value.code == ErrorCode.MALFORMED and name in str(refused.value)


@pytest.mark.parametrize("tag", ["peer_reforms", "peer_resume ", "PEER_FAULT", "", "peer_join2"])
def test_an_unknown_tag_is_refused(tag: str) -> None:
    with pytest.raises(ProtocolViolation) as refused:
        peer_codec.decode(frame(tag, **GOOD["peer_reform"]))
    assert refused.value.code == ErrorCode.UNKNOWN_TYPE


def test_a_huge_member_list_is_refused_by_size() -> None:
    members = list(range(MAX_MESSAGE_BYTES // 4))  # 5-byte integers: over the limit
    with pytest.raises(ProtocolViolation) as refused:
        peer_codec.decode(frame("peer_resume", **{**GOOD["peer_resume"], "members": members}))
    assert refused.value.code == ErrorCode.TOO_LARGE


async def test_malformed_reform_frames_on_the_peer_port_are_dropped_and_counted(
        daemon: Daemon) -> None:
    """The same frames sent to a real daemon's peer port: dropped, counted by its guard, the
    loop goes on (no job, no change, no reply)."""
    context = zmq.asyncio.Context()
    sock = peer_dealer(context, daemon)
    try:
        for tag, fields, _ in BAD:
            await sock.send(frame(tag, **{**GOOD[tag], **fields}))
        await sock.send(frame("peer_reforms", **GOOD["peer_reform"]))
        await until(lambda: sum(daemon._peer_guard.counts.values()) >= len(BAD) + 1,
                    f"{len(BAD) + 1} frames dropped by the peer guard", WAIT_S)
        counts = daemon._peer_guard.counts
        # A coordinator's own messages are refused by their tag on the coordinator's port.
        downward = sum(tag in ("peer_reform", "peer_resume") for tag, _, _ in BAD)
        assert counts["bad peer message (not for a coordinator)"] == downward, counts
        assert counts["bad peer message (malformed)"] == len(BAD) - downward, counts
        assert counts["bad peer message (unknown_type)"] == 1, counts
        assert daemon._loops_alive() and daemon.status().coordinating == []
    finally:
        sock.close(linger=0)
        context.term()


# --- a redirect: the job was taken over elsewhere before this node joined ---------------------


async def test_a_joining_node_sent_on_by_its_coordinator_joins_at_the_successor(
        daemon: Daemon, connect: Any) -> None:
    """A node joins at a daemon that started where a lost coordinator was (its ranks ran the
    old command); that daemon sends it on (``PeerRedirect``). Redirects to nowhere, to port
    0, or to the same address change nothing; the real one makes the node join there — a
    ROUTER holding the cluster key stands for the successor. Were a bad one taken, the good
    one would come from a coordinator the job no longer has, and nothing would arrive."""
    context = zmq.asyncio.Context()
    successor, port = bind_peers(context, "127.0.0.1", 0, daemon._links.key)
    client = connect()
    buffer = HostBuffer("commd-test-redirect", 16)
    try:
        await join_one_of_two(daemon, client, buffer)
        for bad in ("nowhere", "127.0.0.1:0", "x" * 400 + ":1", coordinator_of(daemon)):
            send_to_node(daemon, PeerRedirect(job=JOB, coordinator=bad))
        there = f"127.0.0.1:{port}"
        send_to_node(daemon, PeerRedirect(job=JOB, coordinator=there))
        _, frame = await asyncio.wait_for(successor.recv_multipart(), WAIT_S)
        join = peer_codec.decode(frame)
        assert isinstance(join, PeerJoin) and (join.job, join.ranks) == (JOB, [0]), join
        assert daemon.jobs[JOB].coordinator == there
        assert daemon.jobs[JOB].state is JobState.JOINING
    finally:
        buffer.close()
        successor.close(linger=0)
        context.term()


async def test_a_running_job_is_not_sent_anywhere(
        daemon: Daemon, tolerant_job: tuple[RawClient, str]) -> None:
    """Only a node still joining follows a redirect: the stopped job stays with its
    coordinator and resumes from it."""
    _, job = tolerant_job
    send_to_node(daemon, PeerRedirect(job=job, coordinator="127.0.0.1:9"))
    send_to_node(daemon, resume())
    await until(lambda: daemon.jobs[job].state is JobState.RUNNING, "the job resumed", WAIT_S)
    assert daemon.jobs[job].coordinator == coordinator_of(daemon)
