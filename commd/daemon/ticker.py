"""The daemon's clock: every second, the deadlines and liveness of every job, on this node and
on the coordinator. Whatever a tick raises is logged and counted; the clock goes on."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping

from commd.coordinator import Coordinator
from commd.daemon.guard import Guard
from commd.daemon.peer_links import PeerLinks
from commd.daemon.sessions import ClientSessions
from commd.job import liveness
from commd.job.job import Job


async def tick_forever(period_s: float, jobs: Mapping[str, Job], sessions: ClientSessions,
                       coordinator: Coordinator, links: PeerLinks) -> None:
    guard = Guard("ticker")
    while True:
        await asyncio.sleep(period_s)
        now = time.monotonic()
        guard.call("deadlines", sessions.reap, now)
        for job in list(jobs.values()):
            link = links.state(job.coordinator)
            guard.call(f"the liveness of job {job.id}", liveness.tick, job, now, link)
            if link != "up" and liveness.awaits_successor(job):
                links.probe(job.coordinator)  # a dead successor is told from a silent one
        guard.call("the coordinator", coordinator.tick, now)
