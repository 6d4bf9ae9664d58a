"""A job's state on this node and the edges it may take: the one place that changes it.

forming → joining → starting → running ⇄ reforming, and from any of them to failed or
closed, which are final. A joining node of a tolerant job goes from joining to starting
when the coordinator lets it into a running job; a reform never happens before the job
ran. Anything else is a bug in the daemon, raised as ``IllegalTransition`` naming both
states, never carried out: a JobError (out of order), so whoever asked for the move is
answered with it and the job stays as it was.
"""

from __future__ import annotations

from collections.abc import Mapping

from commd.job.state import JobError
from commd_protocol import ErrorCode
from commd_protocol.status import JobState

__all__ = ["EDGES", "IllegalTransition", "Lifecycle"]

_ENDS = frozenset({JobState.FAILED, JobState.CLOSED})

EDGES: Mapping[JobState, frozenset[JobState]] = {
    JobState.FORMING: frozenset({JobState.JOINING}) | _ENDS,
    JobState.JOINING: frozenset({JobState.STARTING}) | _ENDS,
    JobState.STARTING: frozenset({JobState.RUNNING}) | _ENDS,
    JobState.RUNNING: frozenset({JobState.REFORMING}) | _ENDS,
    JobState.REFORMING: frozenset({JobState.RUNNING}) | _ENDS,
    JobState.FAILED: frozenset(),
    JobState.CLOSED: frozenset(),
}


class IllegalTransition(JobError):
    """A move the table does not allow, naming both states."""

    def __init__(self, job: str, state: JobState, to: JobState) -> None:
        super().__init__(f"job {job!r} cannot go from {state} to {to}",
                         ErrorCode.OUT_OF_ORDER)
        self.state, self.to = state, to


class Lifecycle:
    """The state of one job on this node; ``move`` is its only writer."""

    def __init__(self, job: str) -> None:
        self._job = job
        self._state = JobState.FORMING

    @property
    def state(self) -> JobState:
        return self._state

    def move(self, to: JobState) -> JobState:
        """Go to ``to``; returns the state left. IllegalTransition for an edge the table
        does not hold (the state is then unchanged)."""
        if to not in EDGES[self._state]:
            raise IllegalTransition(self._job, self._state, to)
        left, self._state = self._state, to
        return left
