"""What the daemon says of itself: ``commd status`` (``DaemonStatus``) and the counts the
metrics show beside it. Reads only; every part it reads is one the daemon wired."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import commd
from commd.compression import native
from commd.coordinator.coordinator import Coordinator
from commd.daemon.guard import Guard
from commd.daemon.handover import BufferSocket
from commd.daemon.peer_links import PeerLinks
from commd.daemon.peer_security import PeerSecurity
from commd.daemon.sessions import ClientSessions
from commd.daemon.settings import Settings
from commd.job.job import Job
from commd_protocol import PROTOCOL_VERSION
from commd_protocol.status import DaemonStatus

if TYPE_CHECKING:
    from commd.daemon.metrics import Counts

__all__ = ["Identity", "StatusReport"]


@dataclass
class Identity:
    """Who this daemon is, as set-up finds out: its backend and the peer port it bound."""

    backend: str = ""
    peer_port: int = 0
    started: float = field(default_factory=time.time)


@dataclass(frozen=True)
class StatusReport:
    """The daemon's parts, read for its status and its metrics' counts."""

    settings: Settings
    identity: Identity
    jobs: Mapping[str, Job]
    sessions: ClientSessions
    buffers: BufferSocket
    security: PeerSecurity
    coordinator: Coordinator
    links: PeerLinks
    guards: tuple[Guard, ...]  # every loop's: what each refused, by kind

    def status(self) -> DaemonStatus:
        sessions = self.sessions
        return DaemonStatus(
            version=commd.__version__,
            protocol=PROTOCOL_VERSION,
            backend=self.identity.backend,
            uptime_s=round(time.time() - self.identity.started, 3),
            pid=os.getpid(),
            socket=self.settings.socket,
            listen=f"{self.settings.listen_host}:{self.identity.peer_port}",
            jobs=[job.status() for job in self.jobs.values()],
            coordinating=self.coordinator.status(),
            peer_handshakes_refused=self.security.refused,
            peer_handshakes_refused_by=self.security.refused_by_reason,
            compression_loops=native.describe(),
            shares=[share.status() for share in (
                sessions.sessions_share, sessions.jobs_share, sessions.traces_share,
                self.buffers.pending_share, self.buffers.connections_share)],
            ended=sessions.ended.status(),
        )

    def counts(self) -> Counts:
        """What metrics show beside status; read when metrics are rendered."""
        from commd.daemon.metrics import Counts

        return Counts(
            clients=self.sessions.count,
            peer_links=self.links.count,
            refused={(g.loop, kind): n for g in self.guards for kind, n in dict(g.counts).items()},
            handovers_refused=self.buffers.refused,
        )
