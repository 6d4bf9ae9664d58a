"""The last jobs that ended on this node, for ``commd status``: what the daemons decided for
each (its last status snapshot) and how it ended, once it has left the job table.

A cap, not a log: the most recent ``KEPT`` records, each with its peer-given texts (a failure
or stall message a coordinator sent) and the user's compression text cut to ``MAX_TEXT``
characters; the rest of a snapshot is bounded where it is made (a plan's reason and search by
``validation.MAX_PLAN_TEXT``, its groups by the daemon's ``--max-layers``, the histories by
their own caps). So whatever a user runs, these records hold at most ``KEPT`` jobs' worth of
memory.
"""

from __future__ import annotations

from collections import deque

import msgspec

from commd_protocol.status import EndedJob, JobState, JobStatus

KEPT = 8  # ended jobs kept, newest first; an older one makes room for each new one
MAX_TEXT = 2000  # characters kept of a failure or stall message (a coordinator's words)


def outcome(before: JobState, failure: str | None) -> str:
    """How a job ended, from its state before it was closed and its latched failure:
    "finished" (it ran and every rank left), "failed: <message>", or "closed while <state>"
    (its ranks left before it ran)."""
    if failure is not None:
        return f"failed: {clip(failure)}"
    if before in (JobState.RUNNING, JobState.REFORMING, JobState.CLOSED):
        return "finished"
    return f"closed while {before.value}"


def clip(text: str, limit: int = MAX_TEXT) -> str:
    """``text`` cut to ``limit`` characters (the cut marked)."""
    return text if len(text) <= limit else text[:limit - 3] + "..."


class EndedJobs:
    """The most recent ``keep`` ended jobs of this daemon (one writer: the client sessions)."""

    def __init__(self, keep: int = KEPT) -> None:
        self._records: deque[EndedJob] = deque(maxlen=keep)

    def add(self, status: JobStatus, how: str, ended_at: float) -> None:
        """Keep ``status`` (a job's last snapshot, taken once it closed) and ``how`` it ended at
        ``ended_at`` (unix seconds); the oldest record goes when the cap is reached."""
        kept = msgspec.structs.replace(
            status,
            error=clip(status.error) if status.error is not None else None,
            stall=clip(status.stall) if status.stall is not None else None,
            compression=clip(status.compression) if status.compression is not None else None,
            membership_changes=[clip(change) for change in status.membership_changes],
        )
        self._records.appendleft(EndedJob(status=kept, outcome=clip(how), ended_at=ended_at))

    def __len__(self) -> int:
        return len(self._records)

    def status(self) -> list[EndedJob]:
        """The records, newest first."""
        return list(self._records)
