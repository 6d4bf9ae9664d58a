"""Membership messages that do not fit, on the coordinator's side (issue 36's hostile cases): a
fault_tolerance="continue" job's coordinator ignores what is not its job's to say and fails the
job, naming why, where the answers cannot be reconciled. The real ``Coordinator`` with a
recording ``send`` and a fake clock passed to ``tick`` (tests/membership_cases.py); the node's
side and the peer port are in tests/daemon/test_membership_hostile.py."""

from __future__ import annotations

import time

import msgspec
import pytest
from membership_cases import JOB, STRANGER, A, B, C, formed, lose_c, state

from commd.coordinator.membership import (
    MAX_FRUITLESS_REFORMS,
    MAX_HISTORY,
    REFORM_ANSWER_S,
    Membership,
    resume_iteration,
)
from commd_protocol import (
    ErrorCode,
    PeerAbort,
    PeerFault,
    PeerReform,
    PeerReformState,
    PeerResume,
)

# --- pure functions ---------------------------------------------------------------------------


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
