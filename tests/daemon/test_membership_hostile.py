"""Membership messages that do not fit (issue 36's hostile cases): a fault_tolerance="continue"
job's coordinator ignores what is not its job's to say and fails the job, naming why, where
the answers cannot be reconciled; a node fails its job with a typed INVALID error on a resume
that does not fit; the codec refuses malformed frames of the four reform messages.

The coordinator is the real ``Coordinator`` with a recording ``send`` and a fake clock passed
to ``tick``; the node side is a real in-process daemon whose own coordinator sends the frames
over its real peer sockets."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgpack
import msgspec
import pytest
import zmq.asyncio

from commd.coordinator.coordinator import Coordinator
from commd.coordinator.membership import (
    MAX_FRUITLESS_REFORMS,
    MAX_HISTORY,
    REFORM_ANSWER_S,
    Membership,
    resume_iteration,
)
from commd.daemon.server import Daemon
from commd.job.epochs import MAX_CHANGE_CHARS
from commd_client.host_buffer import HostBuffer
from commd_protocol import (
    PROTOCOL_VERSION,
    ErrorCode,
    Layer,
    PeerAbort,
    PeerFault,
    PeerJoin,
    PeerReform,
    PeerReformState,
    PeerResume,
    PeerStatus,
    ProtocolViolation,
)
from commd_protocol.codec import MAX_MESSAGE_BYTES, peer_codec
from commd_protocol.limits import MAX_LOCAL_RANKS
from commd_protocol.status import JobState

from inprocess import RawClient, coordinator_of, hand_over, hello, peer_dealer, still_serving

JOB = "tol"
A, B, C, STRANGER = b"node-a", b"node-b", b"node-c", b"stranger"


# --- pure functions ---------------------------------------------------------------------------


def state(delivered: int, committing: bool = False, epoch: int = 1) -> PeerReformState:
    return PeerReformState(job=JOB, epoch=epoch, delivered=delivered, committing=committing)


@pytest.mark.parametrize(("answers", "expected"), [
    ([state(4), state(4)], 4),
    ([state(4), state(3, committing=True)], 4),  # one delivers its committed iteration
    ([state(0)], 0),
])
def test_resume_iteration_of_answers_that_fit(answers: list[PeerReformState],
                                              expected: int) -> None:
    assert resume_iteration(answers) == expected


@pytest.mark.parametrize(("answers", "words"), [
    ([], "answered"),
    ([state(4), state(3)], "a node delivered 3 iterations (committing: False) while another "
                           "delivered 4"),
    ([state(9), state(2, committing=True)], "a node delivered 2 iterations (committing: True)"),
    ([state(2**62), state(0)], "while another delivered 4611686018427387904"),
])
def test_resume_iteration_names_answers_that_contradict(answers: list[PeerReformState],
                                                        words: str) -> None:
    reason = resume_iteration(answers)
    assert isinstance(reason, str) and words in reason


def test_membership_folds_a_change_into_the_one_in_progress_and_ignores_other_epochs() -> None:
    membership = Membership(min_world_size=1)
    membership.begin("node a lost", now=100.0)
    reform = membership.begin("node b lost", now=101.0)
    assert (reform.epoch, reform.change) == (2, "node a lost; node b lost")
    assert not membership.answer(A, state(3, epoch=1))  # the folded epoch's answer
    assert not membership.answer(A, state(3, epoch=3))  # one that never began
    assert membership.answer(A, state(3, epoch=2))
    assert not membership.complete([A, B])
    assert membership.unanswered([A, B], now=101.0 + REFORM_ANSWER_S) == []
    assert membership.unanswered([A, B], now=101.0 + REFORM_ANSWER_S + 0.01) == [B]
    assert membership.answer(B, state(3, epoch=2)) and membership.complete([A, B])
    done, resume = membership.finish()
    assert done is reform and resume == 3 and membership.reform is None
    assert membership.history == ["epoch 2: node a lost; node b lost"]


def test_membership_history_is_bounded_and_fruitless_reforms_exhaust_it() -> None:
    membership = Membership(min_world_size=1)
    for number in range(MAX_HISTORY + 10):
        membership.begin(f"change {number}", now=0.0)
        membership.answer(A, state(7, epoch=membership.epoch))
        membership.finish()
    assert len(membership.history) == MAX_HISTORY
    assert membership.history[-1] == f"epoch {MAX_HISTORY + 10}: change {MAX_HISTORY + 9}"
    assert membership.exhausted  # iteration 7 over and over: nothing was delivered


# --- the coordinator ----------------------------------------------------------------------------


class Recorder:
    """The coordinator's ``send``: every message but the periodic PeerStatus, in order."""

    def __init__(self) -> None:
        self.sent: list[tuple[bytes, msgspec.Struct]] = []

    def __call__(self, node: bytes, message: msgspec.Struct) -> None:
        if not isinstance(message, PeerStatus):
            self.sent.append((node, message))

    def take(self) -> list[tuple[bytes, msgspec.Struct]]:
        sent, self.sent = self.sent, []
        return sent


def join(rank: int, world_size: int = 3, min_world_size: int = 1) -> PeerJoin:
    return PeerJoin(protocol=PROTOCOL_VERSION, job=JOB, ranks=[rank], world_size=world_size,
                    layers=[Layer(name="w", size=4)], dtype="float32", op="sum",
                    planner="wfbp", host=f"127.0.0.{rank + 1}", fault_tolerance="continue",
                    min_world_size=min_world_size)


def formed(min_world_size: int = 1) -> tuple[Coordinator, Recorder]:
    """A tolerant job of three one-rank nodes A, B, C (ranks 0, 1, 2), formed."""
    recorder = Recorder()
    coordinator = Coordinator(recorder, store_port=lambda host: 29999)
    for rank, node in enumerate((A, B, C)):
        coordinator.on_message(node, join(rank, min_world_size=min_world_size))
    assert len(recorder.take()) == 3  # a PeerSetup each
    return coordinator, recorder


def lose_c(coordinator: Coordinator, recorder: Recorder) -> None:
    coordinator.on_message(C, PeerAbort(job=JOB, code=ErrorCode.RANK_LOST,
                                        message="rank 2 exited"))
    sent = recorder.take()
    assert [(node, type(m)) for node, m in sent] == [(A, PeerReform), (B, PeerReform)], sent
    for _, reform in sent:
        assert isinstance(reform, PeerReform) and reform.epoch == 1
        assert "(ranks [2]) lost: rank 2 exited" in reform.change


def aborts(sent: list[tuple[bytes, msgspec.Struct]]) -> list[PeerAbort]:
    found = [m for _, m in sent if isinstance(m, PeerAbort)]
    assert len(found) == len(sent), sent
    return found


def test_reform_messages_from_outside_the_job_are_ignored() -> None:
    coordinator, recorder = formed()
    lose_c(coordinator, recorder)
    for node in (STRANGER, C):  # never in the job, and the node just lost
        coordinator.on_message(node, state(0))
        coordinator.on_message(node, PeerFault(job=JOB, epoch=1, message="hostile"))
        coordinator.on_message(node, PeerFault(job=JOB, epoch=1, message="hostile",
                                               lost_ranks=[0, 1]))
    coordinator.on_message(A, PeerReformState(job="another-job", epoch=1, delivered=0))
    assert recorder.take() == []
    (job,) = coordinator.status()
    assert job.epoch == 1 and job.nodes == 2
    coordinator.on_message(A, state(0))
    coordinator.on_message(B, state(0))
    resumes = [m for _, m in recorder.take()]
    assert [type(m) for m in resumes] == [PeerResume, PeerResume]


@pytest.mark.parametrize("epoch", [0, 2, -1, 2**62])
def test_an_answer_for_another_epoch_is_ignored(epoch: int) -> None:
    coordinator, recorder = formed()
    lose_c(coordinator, recorder)
    coordinator.on_message(A, state(0, epoch=epoch))
    coordinator.on_message(B, state(0, epoch=epoch))
    assert recorder.take() == []  # nobody resumes on answers to a change that is not running
    coordinator.on_message(A, state(0))
    coordinator.on_message(B, state(0))
    sent = recorder.take()
    assert [(node, type(m)) for node, m in sent] == [(A, PeerResume), (B, PeerResume)]
    for index, (_, resume) in enumerate(sent):
        assert isinstance(resume, PeerResume)
        assert (resume.epoch, resume.node_index, resume.nodes, resume.members,
                resume.iteration) == (1, index, 2, [0, 1], 0)


def test_answers_that_contradict_abort_the_job_naming_them() -> None:
    coordinator, recorder = formed()
    lose_c(coordinator, recorder)
    coordinator.on_message(A, state(5))
    coordinator.on_message(B, state(3))
    found = aborts(recorder.take())
    assert len(found) == 2 and all(a.code == ErrorCode.INVALID for a in found)
    assert "the reform failed: a node delivered 3 iterations (committing: False) while " \
           "another delivered 5" in found[0].message
    assert coordinator.status() == []


def test_a_fault_while_a_change_runs_starts_no_second_change() -> None:
    coordinator, recorder = formed()
    lose_c(coordinator, recorder)
    for epoch in (0, 1, 2):
        coordinator.on_message(A, PeerFault(job=JOB, epoch=epoch, message="gloo: closed"))
    assert recorder.take() == []
    assert coordinator.status()[0].epoch == 1
    coordinator.on_message(A, state(2))
    coordinator.on_message(B, state(2))
    recorder.take()
    # After the change, a fault of an old epoch is covered by it; one of the new epoch is not.
    coordinator.on_message(A, PeerFault(job=JOB, epoch=0, message="late"))
    assert recorder.take() == []
    coordinator.on_message(A, PeerFault(job=JOB, epoch=1, message="gloo: closed"))
    assert [type(m) for _, m in recorder.take()] == [PeerReform, PeerReform]
    assert coordinator.status()[0].epoch == 2


def test_reforms_that_never_deliver_an_iteration_abort_the_job() -> None:
    coordinator, recorder = formed()
    lose_c(coordinator, recorder)
    reforms, sent = 0, []  # since the first resume, which delivered iteration 6
    for _ in range(MAX_FRUITLESS_REFORMS + 5):
        epoch = coordinator.status()[0].epoch
        coordinator.on_message(A, state(6, epoch=epoch))
        coordinator.on_message(B, state(6, epoch=epoch))
        assert [type(m) for _, m in recorder.take()] == [PeerResume, PeerResume]
        coordinator.on_message(B, PeerFault(job=JOB, epoch=epoch, message="link cut"))
        sent = recorder.take()
        if any(isinstance(m, PeerAbort) for _, m in sent):
            break
        reforms += 1
    assert reforms == MAX_FRUITLESS_REFORMS + 1
    found = aborts(sent)
    assert len(found) == 2 and found[0].code == ErrorCode.ENGINE
    assert f"reformed {MAX_FRUITLESS_REFORMS + 1} times without finishing an iteration" \
        in found[0].message
    assert coordinator.status() == []


def test_reforms_that_deliver_go_on_for_as_long_as_faults_come() -> None:
    coordinator, recorder = formed()
    lose_c(coordinator, recorder)
    for delivered in range(1, 3 * MAX_FRUITLESS_REFORMS):
        epoch = coordinator.status()[0].epoch
        coordinator.on_message(A, state(delivered, epoch=epoch))
        coordinator.on_message(B, state(delivered, epoch=epoch))
        coordinator.on_message(B, PeerFault(job=JOB, epoch=epoch, message="flaky"))
        assert not any(isinstance(m, PeerAbort) for _, m in recorder.take())
    assert coordinator.status()[0].epoch == 3 * MAX_FRUITLESS_REFORMS


def test_a_node_that_never_answers_is_dropped_after_the_answer_deadline() -> None:
    """A change that began with a crash (a peer closed its connections): a node that does not
    answer within the deadline is dead, and the others go on without it."""
    coordinator, recorder = formed()
    began = time.monotonic()
    lose_c(coordinator, recorder)
    coordinator.on_message(A, PeerFault(job=JOB, epoch=0, closed=True,
                                        message="Read error: Connection reset by peer"))
    coordinator.on_message(A, state(4))
    coordinator.tick(began + REFORM_ANSWER_S / 2)  # before the deadline: B may still answer
    assert recorder.take() == []
    coordinator.tick(time.monotonic() + REFORM_ANSWER_S + 0.5)
    sent = recorder.take()
    assert [(node, type(m)) for node, m in sent] == [(A, PeerReform)], sent
    reform = sent[0][1]
    assert isinstance(reform, PeerReform) and reform.epoch == 2
    assert "(ranks [1]) lost: its daemon did not answer the reform" in reform.change
    coordinator.on_message(B, state(4, epoch=2))  # too late: B is no longer in the job
    assert recorder.take() == []
    coordinator.on_message(A, state(4, epoch=2))
    (node, resume), = recorder.take()
    assert node == A and isinstance(resume, PeerResume)
    assert (resume.nodes, resume.members, resume.iteration, resume.store_port) == (1, [0], 4, 0)
    # B's loss was folded into the change that waited for it: one epoch says both.
    (change,) = coordinator.status()[0].membership_changes
    assert change.startswith("epoch 2: node 127.0.0.3 (ranks [2]) lost: rank 2 exited; node "
                             "127.0.0.2 (ranks [1]) lost"), change


def test_silence_that_leaves_a_half_goes_on_on_the_coordinators_side() -> None:
    """Without a crash seen, a node that does not answer may only be cut off, and on its side
    of a split it may go on, but never as a half against a half: its side has no
    coordinator and cannot take over with a half. With 1 of the epoch's 2 nodes left the
    job goes on here, telling the silent node it was dropped (it hears it when it is back)."""
    coordinator, recorder = formed()
    lose_c(coordinator, recorder)
    coordinator.on_message(A, state(4))
    coordinator.tick(time.monotonic() + REFORM_ANSWER_S + 0.5)
    told = dict(recorder.take())
    assert set(told) == {A, B}, told
    dropped, reform = told[B], told[A]
    assert isinstance(dropped, PeerAbort) and dropped.code == ErrorCode.RANK_LOST
    assert "this node was dropped from the job" in dropped.message
    assert isinstance(reform, PeerReform) and reform.epoch == 2
    coordinator.on_message(A, state(4, epoch=2))
    (node, resume), = recorder.take()
    assert node == A and isinstance(resume, PeerResume) and resume.members == [0]


def test_silence_that_leaves_a_minority_stops_this_side() -> None:
    """Two of three nodes do not answer a change: the one left is no majority nor a half, so
    the job stops here, naming the rule, and tells the silent nodes they were dropped."""
    coordinator, recorder = formed()
    coordinator.on_message(A, PeerFault(job=JOB, epoch=0, message="gloo: timed out"))
    assert [node for node, _ in recorder.take()] == [A, B, C]  # a PeerReform each
    coordinator.on_message(A, state(4))
    coordinator.tick(time.monotonic() + REFORM_ANSWER_S + 0.5)
    sent = recorder.take()
    assert sorted(node for node, _ in sent) == [A, B, C]
    for _, message in sent:
        assert isinstance(message, PeerAbort) and message.code == ErrorCode.RANK_LOST
    told = dict(sent)
    for silent in (B, C):
        assert "this node was dropped from the job" in told[silent].message
    assert "1 of the epoch's 3 nodes remain reachable, not a majority nor a half" \
        in told[A].message
    assert coordinator.status() == []


@pytest.mark.parametrize("min_world_size", [2, 3])
def test_below_min_world_size_the_job_aborts_naming_it(min_world_size: int) -> None:
    coordinator, recorder = formed(min_world_size)
    if min_world_size == 2:  # the first loss leaves 2: the job goes on
        lose_c(coordinator, recorder)
        coordinator.on_message(A, state(1))
        coordinator.on_message(B, state(1))
        recorder.take()
        coordinator.on_message(B, PeerAbort(job=JOB, code=ErrorCode.SHUTDOWN, message="stop"))
    else:
        coordinator.on_message(C, PeerAbort(job=JOB, code=ErrorCode.RANK_LOST, message="gone"))
    found = aborts(recorder.take())
    assert found and all(a.code == ErrorCode.RANK_LOST for a in found)
    remaining = 3 - (4 - min_world_size)
    assert f"{remaining} rank(s) remain, fewer than min_world_size {min_world_size}" \
        in found[0].message
    assert coordinator.status() == []


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
        await until(lambda: daemon.jobs[JOB].state is JobState.RUNNING)
        send_to_node(daemon, PeerReform(job=JOB, epoch=1, change="node x (ranks [7]) lost"))
        await until(lambda: daemon.jobs[JOB].state is JobState.REFORMING)
        yield client, JOB
    finally:
        buffer.close()


def send_to_node(daemon: Daemon, message: msgspec.Struct) -> None:
    """``message`` from the job's coordinator to its one node, over the real peer sockets."""
    node = next(iter(daemon._coordinator._jobs[JOB].joins))
    daemon._coordinator._send(node, message)


async def until(check: Callable[[], bool]) -> None:
    while not check():
        await asyncio.sleep(0.01)  # polling a condition, bounded by the test's timeout


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
    await until(lambda: daemon.jobs[job].state is JobState.RUNNING)
    status = next(j for j in daemon.status().jobs if j.job == job)
    assert (status.epoch, status.members) == (1, [0])
    assert status.membership_changes == [f"epoch 1: {'x' * MAX_CHANGE_CHARS}"]  # cut to size


async def test_a_resume_or_reform_out_of_turn_is_ignored(
        daemon: Daemon, tolerant_job: tuple[RawClient, str], connect: Any) -> None:
    """Once resumed, a repeated resume, an old reform and a resume for a running job change
    nothing: no error reaches the rank, the job runs in epoch 1."""
    client, job = tolerant_job
    send_to_node(daemon, resume())
    await until(lambda: daemon.jobs[job].state is JobState.RUNNING)
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
        welcome = await client.ask(hello(job=JOB, world=2, coordinator=coordinator_of(daemon)))
        assert welcome["type"] == "welcome", welcome
        token = await hand_over(daemon, buffer)
        await client.send({"type": "register", "dtype": "float32", "op": "sum",
                           "planner": "wfbp", "buffer_token": token,
                           "layers": [{"name": "w", "size": 4}],
                           "fault_tolerance": "continue"})
        await until(lambda: JOB in daemon._coordinator._jobs)  # its join reached it: joining
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
        await until(lambda: sum(daemon._peer_guard.counts.values()) >= len(BAD) + 1)
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
