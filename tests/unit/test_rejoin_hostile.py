"""Joins that do not fit a running ``fault_tolerance="continue"`` job: each is refused alone,
named, and the job runs on untouched (issue 36's hostile rejoin cases). The real
``Coordinator`` with a recording ``send``, as built by tests/membership_cases.py."""

from __future__ import annotations

import msgspec
import pytest
from membership_cases import JOB, A, B, C, Recorder, formed, join, lose_c, state

from commd.coordinator.coordinator import Coordinator
from commd_protocol import (
    ErrorCode,
    Layer,
    PeerAbort,
    PeerFault,
    PeerJoin,
    PeerPlan,
    PeerProfile,
    PeerReform,
    PeerReformState,
    PeerResume,
)

D, E = b"node-d", b"node-e"


def resumed_without_c() -> tuple[object, Recorder]:
    coordinator, recorder = formed()
    lose_c(coordinator, recorder)
    coordinator.on_message(A, state(5))
    coordinator.on_message(B, state(5))
    assert [type(m) for _, m in recorder.take()] == [PeerResume, PeerResume]
    return coordinator, recorder


def refusal(sent: list[tuple[bytes, msgspec.Struct]], node: bytes) -> str:
    assert len(sent) == 1, sent
    target, message = sent[0]
    assert target == node and isinstance(message, PeerAbort)
    assert message.code == ErrorCode.MISMATCH
    return message.message


@pytest.mark.parametrize(("changes", "words"), [
    ({"layers": [Layer(name="w", size=5)]}, "differ from the running job: first differing "
                                             "layer is 0"),
    ({"dtype": "float64"}, "differ from the running job: dtype float32 vs float64"),
    ({"compression": "topk:0.1"}, "differ from the running job: compression"),
    ({"min_world_size": 2}, "differ from the running job: min_world_size 1 vs 2"),
    ({"world_size": 4}, "say world size 4, the running job has 3"),
    ({"ranks": [0]}, "rank(s) [0] are in the running job already"),
])
def test_a_joiner_that_does_not_fit_is_refused_alone(changes: dict[str, object],
                                                     words: str) -> None:
    coordinator, recorder = resumed_without_c()
    coordinator.on_message(D, msgspec.structs.replace(join(2), **changes))
    assert words in refusal(recorder.take(), D)
    (job,) = coordinator.status()
    assert (job.epoch, job.nodes) == (1, 2)  # no change began; the others heard nothing


def ranks_join(ranks: list[int], **changes: object) -> PeerJoin:
    return msgspec.structs.replace(join(ranks[0]), ranks=ranks, **changes)


@pytest.mark.parametrize("claim", [
    ranks_join([2]),  # drops its own rank
    ranks_join([1]),  # adds nothing
    ranks_join([0, 1]),  # rank 0 lives on A
    ranks_join([1, 2], dtype="float64"),  # another job's shape
    ranks_join([1, 2], world_size=4),
])
def test_a_node_of_the_job_claiming_ranks_it_cannot_add_is_ignored(claim: PeerJoin) -> None:
    """A node of the running job asks to add ranks (a replacement for a rank it lost): what
    it cannot add is ignored, with nothing sent (a refusal would fail its live ranks too)
    and no change begun."""
    coordinator, recorder = resumed_without_c()
    coordinator.on_message(B, claim)
    assert recorder.take() == []
    (job,) = coordinator.status()
    assert (job.epoch, job.nodes, len(job.membership_changes)) == (1, 2, 1)


def test_a_node_takes_a_replacement_in_at_the_next_change() -> None:
    """Nodes A (ranks 0, 1) and B (2, 3); A loses rank 0, then asks to take a replacement for
    it in: a change, and the state comes from rank 1, the lowest rank that was in (never
    from the replacement itself)."""
    recorder = Recorder()
    coordinator = Coordinator(recorder, store_port=lambda host: 29999)
    coordinator.on_message(A, msgspec.structs.replace(join(0, 4), ranks=[0, 1]))
    coordinator.on_message(B, msgspec.structs.replace(join(2, 4), ranks=[2, 3]))
    recorder.take()
    coordinator.on_message(A, PeerFault(job=JOB, epoch=0, message="rank 0 exited",
                                        lost_ranks=[0]))
    assert [type(m) for _, m in recorder.take()] == [PeerReform, PeerReform]
    coordinator.on_message(A, state(5))
    coordinator.on_message(B, state(5))
    resumes = [m for _, m in recorder.take()]
    assert all(isinstance(m, PeerResume) and m.members == [1, 2, 3] for m in resumes)
    coordinator.on_message(A, msgspec.structs.replace(join(0, 4), ranks=[0, 1]))
    reforms = recorder.take()
    assert [(node, type(m)) for node, m in reforms] == [(A, PeerReform), (B, PeerReform)]
    assert "rank(s) [0] on node 127.0.0.1 joined" in reforms[0][1].change  # type: ignore[attr-defined]
    coordinator.on_message(A, state(7, epoch=2))
    coordinator.on_message(B, state(7, epoch=2))
    resumes = [m for _, m in recorder.take()]
    assert len(resumes) == 2
    for resume in resumes:
        assert isinstance(resume, PeerResume)
        assert (resume.members, resume.source, resume.iteration) == ([0, 1, 2, 3], 1, 7)


def test_two_joiners_for_one_rank_the_second_is_refused() -> None:
    coordinator, recorder = resumed_without_c()
    coordinator.on_message(D, join(2))
    first = recorder.take()
    assert [(node, type(m)) for node, m in first] == [(A, PeerReform), (B, PeerReform),
                                                      (D, PeerReform)]
    coordinator.on_message(E, join(2))
    assert "rank(s) [2] are in the running job already" in refusal(recorder.take(), E)


def test_a_joiner_during_a_change_is_folded_into_it() -> None:
    """C is lost and, before the survivors answer, a replacement for rank 2 asks in: one
    epoch takes both; the joiner's answer does not count for where the job stands."""
    coordinator, recorder = formed()
    lose_c(coordinator, recorder)
    coordinator.on_message(D, join(2))
    sent = recorder.take()
    assert {node for node, _ in sent} == {A, B, D}
    for _, reform in sent:
        assert isinstance(reform, PeerReform) and reform.epoch == 2
        assert "lost" in reform.change and "joined" in reform.change
    coordinator.on_message(A, state(7, epoch=2))
    coordinator.on_message(D, PeerReformState(job=JOB, epoch=2, delivered=0, joining=True))
    assert recorder.take() == []  # B has not answered
    coordinator.on_message(B, state(6, committing=True, epoch=2))
    resumes = dict(recorder.take())
    assert set(resumes) == {A, B, D}
    for resume in resumes.values():
        assert isinstance(resume, PeerResume)
        assert (resume.iteration, resume.members, resume.source) == (7, [0, 1, 2], 0)
        assert resume.nodes == 3
    (job,) = coordinator.status()
    assert job.epoch == 2 and job.nodes == 3


def test_a_replacement_for_rank_0_takes_state_from_the_lowest_old_rank() -> None:
    """Ranks 0 and 1 are lost; a replacement for rank 0 joins: the job's lowest rank is now
    the joiner, but the state comes from the lowest rank that was there before (2)."""
    coordinator, recorder = formed(min_world_size=1)
    for node in (A, B):
        coordinator.on_message(node, PeerAbort(job=JOB, code=ErrorCode.RANK_LOST, message="x"))
    recorder.take()
    coordinator.on_message(D, join(0))
    coordinator.on_message(C, state(3, epoch=coordinator.status()[0].epoch))
    coordinator.on_message(D, PeerReformState(job=JOB, epoch=coordinator.status()[0].epoch,
                                              delivered=0, joining=True))
    resumes = [m for _, m in recorder.take() if isinstance(m, PeerResume)]
    assert [r.members for r in resumes] == [[0, 2], [0, 2]]
    assert all(r.iteration == 3 and r.source == 2 for r in resumes)


def test_the_joiner_gets_the_plans_in_force_and_the_decisions_awaited() -> None:
    """Plans decided before the join reach the joiner with its resume; rounds the others
    reported but that are not decided yet are named in ``expect``."""
    coordinator, recorder = resumed_without_c()
    plan = PeerPlan(job=JOB, round=0, effective_iteration=0, version=1, groups=[[0]],
                    alpha_s=0.0, beta_s_per_byte=0.0, predicted_comm_s=0.0)
    formation = coordinator._jobs[JOB]  # the decisions are the planner's; here, given
    formation.plans = [plan]
    formation.deciding = {1}  # round 1 (iterations 0..9) is being decided: for iteration 12
    coordinator.on_message(D, join(2))
    recorder.take()
    for node in (A, B):
        coordinator.on_message(node, state(11, epoch=2))
    coordinator.on_message(D, PeerReformState(job=JOB, epoch=2, delivered=0, joining=True))
    sent = recorder.take()
    to_d = [m for node, m in sent if node == D]
    assert isinstance(to_d[0], PeerResume) and to_d[0].expect == [12]
    assert to_d[1:] == [plan]
    assert all(not m.expect for node, m in sent if node != D and isinstance(m, PeerResume))


def test_a_round_closing_while_a_node_joins_is_decided_without_it() -> None:
    """A reported round 1, D asked to join, then B's report of round 1 came in during the
    change. D runs nothing until its resume and reports from round 2 on: counting it held
    round 1 open for ever, and every node waited at iteration 12 for its decision."""
    coordinator, recorder = resumed_without_c()
    coordinator.on_message(A, PeerProfile(job=JOB, round=1, iteration=9))
    coordinator.on_message(D, join(2))
    assert [type(m) for _, m in recorder.take()] == [PeerReform] * 3
    coordinator.on_message(B, PeerProfile(job=JOB, round=1, iteration=9))
    decided = recorder.take()
    assert [(node, type(m)) for node, m in decided] == [(A, PeerPlan), (B, PeerPlan)]
    plan = decided[0][1]
    assert isinstance(plan, PeerPlan) and plan.effective_iteration == 12
    for node in (A, B):
        coordinator.on_message(node, state(10, epoch=2))
    coordinator.on_message(D, PeerReformState(job=JOB, epoch=2, delivered=0, joining=True))
    to_d = [m for node, m in recorder.take() if node == D]
    assert isinstance(to_d[0], PeerResume) and to_d[0].iteration == 10
    assert to_d[0].expect == [] and to_d[1:] == [plan]  # the decision itself, nothing awaited
    assert coordinator._jobs[JOB].reports == {}


def test_a_job_without_fault_tolerance_refuses_every_join_once_formed() -> None:
    from commd.coordinator.coordinator import Coordinator

    recorder = Recorder()
    coordinator = Coordinator(recorder, store_port=lambda host: 29999)
    for rank, node in enumerate((A, B)):
        coordinator.on_message(node, msgspec.structs.replace(join(rank, world_size=2),
                                                             fault_tolerance="fail"))
    recorder.take()
    coordinator.on_message(D, msgspec.structs.replace(join(1, world_size=2),
                                                      fault_tolerance="fail"))
    sent = recorder.take()
    assert len(sent) == 1 and isinstance(sent[0][1], PeerAbort)
    assert "already running" in sent[0][1].message

