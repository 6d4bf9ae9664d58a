"""How long a job may take to form on this node, and how long a failed one is kept: what an
outsider can make the daemon hold has a deadline (``timeout_s``)."""

from __future__ import annotations

from commd.job.job import Job
from commd.job.state import JobState


def formation_overdue(job: Job, now: float) -> str:
    """'' unless ``job`` is still forming or joining past its deadline; else why it fails."""
    limit = job.ctx.timeout_s
    if job.state not in (JobState.FORMING, JobState.JOINING) or now - job.started <= limit:
        return ""
    if job.state is JobState.JOINING:
        return (f"the coordinator at {job.coordinator} did not set the job up within {limit:g}s; "
                "did the ranks on every node start, with the same job id and coordinator?")
    ranks = job.members.ranks
    registered = sorted(i for i, r in ranks.items() if r.registration is not None)
    silent = sorted(i for i, r in ranks.items() if r.registration is None)
    missing = sorted(set(range(job.local_world_size)) - set(ranks))
    parts = [f"local ranks {registered} registered"]
    if silent:
        parts.append(f"local ranks {silent} said hello but did not register")
    if missing:
        parts.append(f"local ranks {missing} never connected")
    return f"the job did not form on this node within {limit:g}s: {'; '.join(parts)}"


def failed_long_ago(job: Job, now: float) -> bool:
    """A failed job whose ranks were told long enough ago: the daemon may forget it."""
    return job.state is JobState.FAILED and now - job.failed_at > job.ctx.timeout_s
