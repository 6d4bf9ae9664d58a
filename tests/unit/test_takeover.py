"""Taking over a tolerant job whose coordinator was lost, on the next node's ``Coordinator``:
it gathers the roster's nodes (``PeerTakeover``), waits for the missing ones only so long,
then resumes them in a new epoch; what does not fit is refused alone. The real ``Coordinator``
with a recording ``send`` and a fake clock, as built by tests/membership_cases.py."""

from __future__ import annotations

import time

import msgspec
import pytest
from membership_cases import JOB, B, C, Recorder, join

from commd.coordinator.coordinator import MAX_FORMING_PER_NODE, Coordinator
from commd.coordinator.membership import TAKEOVER_WAIT_S
from commd_protocol import (
    ErrorCode,
    Layer,
    PeerAbort,
    PeerPlan,
    PeerReform,
    PeerReformState,
    PeerResume,
    PeerTakeover,
    RosterEntry,
)

D, E = b"node-d", b"node-e"

LOST = "10.0.0.1:29600"
ROSTER = [RosterEntry(peer=LOST, ranks=[0]), RosterEntry(peer="10.0.0.2:29600", ranks=[1]),
          RosterEntry(peer="10.0.0.3:29600", ranks=[2])]


def takeover(rank: int, epoch: int = 2, delivered: int = 8, committing: bool = False,
             **changes: object) -> PeerTakeover:
    part = msgspec.structs.replace(join(rank), peer=f"10.0.0.{rank + 1}:29600")
    message = PeerTakeover(job=JOB, epoch=epoch, delivered=delivered, committing=committing,
                           join=part, roster=ROSTER, lost=LOST, plan=3)
    return msgspec.structs.replace(message, **changes)


def plan(version: int, effective: int = 0) -> PeerPlan:
    return PeerPlan(job=JOB, round=version, effective_iteration=effective, version=version,
                    groups=[[0]], alpha_s=1e-4, beta_s_per_byte=1e-9, predicted_comm_s=0.0)


def successor() -> tuple[Coordinator, Recorder]:
    recorder = Recorder()
    return Coordinator(recorder, store_port=lambda host: 29777), recorder


def test_the_roster_gathers_and_resumes_in_a_new_epoch() -> None:
    coordinator, recorder = successor()
    coordinator.on_message(B, takeover(1, epoch=2, delivered=8, committing=True))
    assert recorder.take() == []  # node 2 has not asked yet
    coordinator.on_message(C, takeover(2, epoch=2, delivered=9))
    resumes = dict(recorder.take())
    assert set(resumes) == {B, C}
    for index, node in enumerate((B, C)):
        resume = resumes[node]
        assert isinstance(resume, PeerResume)
        assert (resume.epoch, resume.iteration, resume.members) == (3, 9, [1, 2])
        assert (resume.node_index, resume.nodes, resume.store_port) == (index, 2, 29777)
        assert [entry.peer for entry in resume.roster] == ["10.0.0.2:29600", "10.0.0.3:29600"]
        assert "the coordinator 10.0.0.1:29600 lost" in resume.change
    (job,) = coordinator.status()
    assert (job.formed, job.nodes, job.epoch) == (True, 2, 3)


def test_a_node_that_does_not_ask_in_time_is_lost_with_the_coordinator() -> None:
    """Five nodes; three ask (a majority of five), the fifth does not within the wait."""
    roster = [*ROSTER, RosterEntry(peer="10.0.0.4:29600", ranks=[3]),
              RosterEntry(peer="10.0.0.5:29600", ranks=[4])]
    coordinator, recorder = successor()
    for node, rank in ((B, 1), (C, 2), (D, 3)):
        part = msgspec.structs.replace(join(rank, world_size=5),
                                       peer=f"10.0.0.{rank + 1}:29600")
        coordinator.on_message(node, takeover(rank, join=part, roster=roster))
    coordinator.tick(10**6)  # long past TAKEOVER_WAIT_S
    resumes = [m for _, m in recorder.take() if isinstance(m, PeerResume)]
    assert [r.members for r in resumes] == [[1, 2, 3]] * 3
    assert "10.0.0.5:29600 did not ask within the wait" in resumes[0].change
    assert TAKEOVER_WAIT_S < 10**6
    late = msgspec.structs.replace(join(4, world_size=5), peer="10.0.0.5:29600")
    coordinator.on_message(E, takeover(4, join=late, roster=roster))  # refused, too late
    (sent,) = recorder.take()
    assert sent[0] == E and isinstance(sent[1], PeerAbort)
    assert "taken over without this node" in sent[1].message


def test_a_minority_cannot_take_over() -> None:
    """One node of three asks: it may be the one cut off, with the coordinator alive and the
    majority training on the other side, so it stops instead of training alone."""
    coordinator, recorder = successor()
    coordinator.on_message(B, takeover(1))
    coordinator.tick(10**6)
    (sent,) = recorder.take()
    assert sent[0] == B and isinstance(sent[1], PeerAbort)
    assert sent[1].code == ErrorCode.RANK_LOST and "not a majority" in sent[1].message
    assert coordinator.status() == []


@pytest.mark.parametrize(("changes", "words"), [
    ({"join": msgspec.structs.replace(join(1), fault_tolerance="fail")},
     'only a fault_tolerance="continue" job'),
    ({"join": msgspec.structs.replace(join(1), job="other")}, 'only a fault_tolerance'),
    ({"roster": ROSTER * 2}, "a roster of 6 nodes for 3"),
    ({"roster": [RosterEntry(peer="x" * 301, ranks=[1])]}, "a roster address of 301"),
    ({"roster": [RosterEntry(peer="a:1", ranks=[7])]}, "outside 0..2"),
    ({"roster": [RosterEntry(peer="a:1", ranks=[])]}, "a roster entry with ranks []"),
    ({"epoch": -1}, "epoch"),
    ({"delivered": -5}, "delivered"),
    ({"plans": [plan(v) for v in range(4)]}, "4 plans handed over, at most 3"),
    ({"plans": [msgspec.structs.replace(plan(1), job="other")]}, "of another job"),
])
def test_a_takeover_that_does_not_fit_is_refused(changes: dict[str, object],
                                                 words: str) -> None:
    coordinator, recorder = successor()
    coordinator.on_message(B, takeover(1, **changes))
    (sent,) = recorder.take()
    assert sent[0] == B and isinstance(sent[1], PeerAbort) and words in sent[1].message
    assert coordinator.status() == []


def test_a_second_node_with_another_model_is_refused_alone() -> None:
    coordinator, recorder = successor()
    coordinator.on_message(B, takeover(1))
    other = msgspec.structs.replace(join(2), layers=[Layer(name="w", size=9)])
    coordinator.on_message(C, takeover(2, join=other))
    (sent,) = recorder.take()
    assert sent[0] == C and isinstance(sent[1], PeerAbort)
    assert sent[1].code == ErrorCode.MISMATCH and "differ from the running job" in sent[1].message
    (job,) = coordinator.status()
    assert job.nodes == 1


def test_takeovers_count_against_the_forming_limit() -> None:
    coordinator, recorder = successor()
    for number in range(MAX_FORMING_PER_NODE + 1):
        part = msgspec.structs.replace(join(1), job=f"j{number}", peer="10.0.0.2:29600")
        coordinator.on_message(B, msgspec.structs.replace(takeover(1), job=f"j{number}",
                                                          join=part))
    refused = [m for _, m in recorder.take() if isinstance(m, PeerAbort)]
    assert len(refused) == 1 and refused[0].code == ErrorCode.LIMIT


def test_one_of_two_takes_over_after_a_crash_it_saw() -> None:
    """Two nodes: the survivor alone is no majority, but it saw the coordinator's connections
    close (a crash, not a split), so it may go on; without that it may not."""
    roster = ROSTER[:2]
    for crash, resumed in ((True, True), (False, False)):
        coordinator, recorder = successor()
        part = msgspec.structs.replace(join(1, world_size=2), peer="10.0.0.2:29600")
        coordinator.on_message(B, takeover(1, join=part, roster=roster, crash=crash))
        if not resumed:  # it waits for more nodes than there are, then gives up
            coordinator.tick(time.monotonic() + TAKEOVER_WAIT_S + 1)
        sent = [m for _, m in recorder.take()]
        assert [type(m) for m in sent] == [PeerResume if resumed else PeerAbort], crash


def test_a_joiner_after_a_takeover_gets_the_plan_in_force_the_nodes_handed_over() -> None:
    """The lost coordinator decided every plan in force; the nodes hand their latest
    decisions over, and a replacement that joins later is given the one in force at its
    first iteration and any later one (without it, it could never start)."""
    coordinator, recorder = successor()
    handed = [plan(2, effective=4), plan(3, effective=12)]
    coordinator.on_message(B, takeover(1, delivered=9, plans=handed))
    coordinator.on_message(C, takeover(2, delivered=9, plans=handed[:1]))
    assert [type(m) for _, m in recorder.take()] == [PeerResume, PeerResume]
    coordinator.on_message(D, msgspec.structs.replace(join(0), host="10.0.0.9"))
    assert [type(m) for _, m in recorder.take()] == [PeerReform] * 3
    for node in (B, C):
        coordinator.on_message(node, PeerReformState(job=JOB, epoch=4, delivered=10,
                                                     committing=False))
    coordinator.on_message(D, PeerReformState(job=JOB, epoch=4, delivered=0, committing=False,
                                              joining=True))
    to_joiner = [m for node, m in recorder.take() if node == D]
    assert isinstance(to_joiner[0], PeerResume) and to_joiner[0].iteration == 10
    assert [(m.version, m.effective_iteration) for m in to_joiner[1:]
            if isinstance(m, PeerPlan)] == [(2, 4), (3, 12)]


# --- nodes known dead -----------------------------------------------------------------------------


def test_a_successor_killed_with_the_coordinator_is_not_waited_for_nor_counted() -> None:
    """The coordinator and the roster's next node die together, and the last node knows
    both dead (``dead``): it asks itself, every live node asked, all saw crashes, so it goes
    on alone at once, though one of three is no majority."""
    coordinator, recorder = successor()
    second = ROSTER[1].peer
    coordinator.on_message(C, takeover(2, lost=second, dead=[LOST, second], crash=True))
    ((node, resume),) = recorder.take()
    assert node == C and isinstance(resume, PeerResume)
    assert resume.members == [2]
    assert f"the coordinator {second} lost" in resume.change
    assert f"({LOST} died too" in resume.change


def test_without_a_crash_seen_one_of_three_still_waits_and_fails() -> None:
    """The control: the same node that saw only silence (no crash) cannot tell a split from
    deaths: it waits out the takeover and, one of three, fails the job."""
    coordinator, recorder = successor()
    second = ROSTER[1].peer
    coordinator.on_message(C, takeover(2, lost=second, dead=[second], crash=False))
    assert recorder.take() == []
    coordinator.tick(10**6)
    ((_, abort),) = recorder.take()
    assert isinstance(abort, PeerAbort) and "not a majority" in abort.message


def test_a_takeover_does_not_wait_for_a_node_named_dead() -> None:
    """Node 1 names node 2 dead: it resumes alone at once, and node 2, had it lived after
    all, is refused as one the job was taken over without."""
    coordinator, recorder = successor()
    coordinator.on_message(B, takeover(1, dead=[ROSTER[2].peer], crash=True))
    ((node, resume),) = recorder.take()
    assert node == B and isinstance(resume, PeerResume) and resume.members == [1]
    coordinator.on_message(C, takeover(2, crash=True))
    ((node, abort),) = recorder.take()
    assert node == C and isinstance(abort, PeerAbort)
    assert "taken over without this node" in abort.message


@pytest.mark.parametrize("dead", [["nowhere"], ["x" * 400], ["127.0.0.1:0"]])
def test_a_takeover_naming_a_dead_node_that_is_no_address_is_refused(dead: list[str]) -> None:
    coordinator, recorder = successor()
    coordinator.on_message(B, takeover(1, dead=dead))
    ((node, abort),) = recorder.take()
    assert node == B and isinstance(abort, PeerAbort) and "a dead node must be HOST:PORT" in \
        abort.message
