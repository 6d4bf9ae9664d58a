"""Membership rules the end of a job and a crashed peer daemon rely on, on the real
``Coordinator`` with a recording ``send`` (as built by tests/membership_cases.py)."""

from __future__ import annotations

from membership_cases import JOB, STRANGER, A, B, C, formed, state

from commd.coordinator.membership import resume_iteration
from commd_protocol import PeerLeave, PeerReform, PeerResume


def test_a_node_that_left_having_delivered_makes_the_others_deliver() -> None:
    """A and B finish the last iteration and close; C still waits in its commit. It must
    deliver that iteration (A and B got its whole result), not run it again alone."""
    assert resume_iteration([state(23, committing=True)], known=24) == 24
    assert resume_iteration([state(23, committing=True)]) == 23  # nobody said otherwise
    coordinator, recorder = formed()
    coordinator.on_message(A, PeerLeave(job=JOB, delivered=24))
    coordinator.on_message(B, PeerLeave(job=JOB, delivered=24))
    reforms = [m for _, m in recorder.take() if isinstance(m, PeerReform)]
    epoch = reforms[-1].epoch
    coordinator.on_message(C, state(23, committing=True, epoch=epoch))
    (node, resume), = [(n, m) for n, m in recorder.take() if isinstance(m, PeerResume)]
    assert node == C and resume.iteration == 24 and resume.members == [2]


def test_a_leave_that_says_nothing_changes_nothing() -> None:
    assert resume_iteration([state(5), state(5)], known=-1) == 5


def test_a_closed_connection_drops_the_node_at_once() -> None:
    """Its daemon died (a process exit closes its connections; a split closes none): the
    others reform without it, no wait for silence."""
    coordinator, recorder = formed()
    coordinator.node_closed(STRANGER)  # not in any job: nothing
    assert recorder.take() == []
    coordinator.node_closed(C)
    sent = recorder.take()
    assert [(node, type(m)) for node, m in sent] == [(A, PeerReform), (B, PeerReform)]
    assert "closed its connection" in sent[0][1].change  # type: ignore[attr-defined]
    coordinator.node_closed(C)  # told twice: once is enough
    assert recorder.take() == []
