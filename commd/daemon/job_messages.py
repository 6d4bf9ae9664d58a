"""Messages from the coordinators of this node's jobs, which come back on the links this
daemon opened to them (``peer_links``): each goes to the job it names, and only from the
address that coordinates that job. A set-up and a resume start work that awaits (an engine
forming), run as tasks that the daemon's cleanup cancels."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

import msgspec

from commd.daemon.peer_links import HEARTBEAT_TIMEOUT_S
from commd.job import liveness
from commd.job.job import Job
from commd.job.successions import Successions
from commd_protocol import (
    PeerAbort,
    PeerMessage,
    PeerPlan,
    PeerRedirect,
    PeerReform,
    PeerResume,
    PeerSetup,
    PeerStatus,
    PeerSuccession,
)

__all__ = ["JobMessages"]

log = logging.getLogger("commd.server")


class JobMessages:
    """Routes a coordinator's message to its job on this node."""

    def __init__(self, jobs: Mapping[str, Job], successions: Successions,
                 send: Callable[[str, msgspec.Struct], None]) -> None:
        self._jobs = jobs
        self._successions = successions
        self._send = send  # to a coordinator address, on this daemon's link there
        self._tasks: set[asyncio.Task[None]] = set()

    def deliver(self, address: str, message: PeerMessage) -> None:
        job = self._jobs.get(getattr(message, "job", ""))
        if job is None or job.coordinator != address:
            return
        if isinstance(message, PeerSetup):
            self._run(job.on_setup(message))
        elif isinstance(message, PeerPlan):
            job.on_plan(message)
        elif isinstance(message, PeerReform):
            job.on_reform(message)
        elif isinstance(message, PeerResume):
            entering = job.on_resume(message)  # checked here, in wire order
            if entering is not None:
                self._run(entering)
        elif isinstance(message, PeerStatus):
            liveness.on_status(job, message, time.monotonic())
        elif isinstance(message, PeerAbort):
            job.on_abort(message)
        elif isinstance(message, PeerRedirect):
            job.on_redirect(message)

    def coordinator_closed(self, address: str) -> None:
        """The link to the coordinator at ``address`` closed: every job it coordinates here
        hears of it (``liveness.on_coordinator_closed`` decides what the close means)."""
        now = time.monotonic()
        for job in [job for job in self._jobs.values() if job.coordinator == address]:
            liveness.on_coordinator_closed(job, now, HEARTBEAT_TIMEOUT_S)

    def nothing_listens(self, address: str) -> None:
        """No process listens at ``address`` (a connection there was refused): every job that
        asked it to take over hears of it (``liveness.on_successor_gone``)."""
        for job in [job for job in self._jobs.values() if job.coordinator == address]:
            liveness.on_successor_gone(job)

    def coordinator_up(self, address: str) -> None:
        """The link to ``address`` is up (again): where a job of ours lost its coordinator
        there, a daemon answers there now, a fresh one, which may get joins of that job from
        ranks started with the old command; it is told who coordinates the job since."""
        for job, successor in self._successions.lost_at(address):
            log.info("job %s: a daemon answers again at %s, where its coordinator was lost; "
                     "telling it the job runs at %s", job, address, successor)
            self._send(address, PeerSuccession(job=job, lost=address, coordinator=successor))

    def _run(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._forget)

    def _forget(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("task failed: %r", task.exception())

    async def close(self) -> None:
        """Cancel the set-ups and resumes under way, and wait for them to end."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
