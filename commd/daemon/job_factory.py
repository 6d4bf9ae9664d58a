"""Every new job's view of its daemon: the ``JobContext`` a ``hello`` for a new job id gets
(engine choice, the address peers reach this node at, limits, and where messages go)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

from commd.daemon.settings import Settings
from commd.daemon.sockets import route_source
from commd.engines import engine_for_buffers
from commd.job.job import Job
from commd.job.state import JobContext, SendClient, SendPeer
from commd.job.successions import Successions
from commd.plan import get_planner
from commd_protocol import Hello


class JobFactory:
    """Makes the ``Job`` of a hello that names a new job id: its ``JobContext``, from the daemon's
    settings and from the backend and peer port that start-up fills in."""

    def __init__(self, settings: Settings, executor: Executor, send_client: SendClient,
                 send_peer: SendPeer) -> None:
        self.settings = settings
        self.backend = ""  # the daemon's engine, once chosen at start
        self.peer_port = 0  # the daemon's peer port, once bound
        self.observe: Callable[[str, Any], None] | None = None  # metrics, when served
        self.on_membership_change: Callable[[str, str], None] | None = None  # metrics, too
        # a tolerant job's new epoch here: the sessions fail its earlier epochs' helpers
        self.membership_changing: Callable[[str, int], None] = lambda job, epoch: None
        self._executor = executor
        self._send_client = send_client
        self._send_peer = send_peer
        self.successions = Successions()  # one for the daemon: it outlives every job

    def __call__(self, hello: Hello) -> Job:
        settings = self.settings
        return Job(hello, JobContext(
            engine_for=self.engine_for,
            timeout_s=settings.timeout_s,
            advertise=self.advertise,
            executor=self._executor,
            send_client=self._send_client,
            send_peer=self._send_peer,
            validate_planner=get_planner,
            default_planner=settings.planner,
            peer_timeout_s=settings.peer_timeout_s,
            watchdog=(settings.watchdog_factor, settings.watchdog_floor_s),
            max_layers=settings.max_layers,
            max_job_bytes=settings.max_job_bytes,
            observe=self.observe,
            on_membership_change=self.on_membership_change,
            peer_address=self.peer_address,
            successions=self.successions,
            membership_changing=lambda job, epoch: self.membership_changing(job, epoch),
        ))

    def engine_for(self, kind: str) -> str:
        """The engine that takes ``kind`` buffers across nodes; ValueError says why none."""
        return engine_for_buffers(kind, self.settings.backend, self.backend)

    def advertise(self, coordinator_host: str) -> str:
        """The address other nodes reach this node's engine at."""
        if self.settings.advertise:
            return self.settings.advertise
        host = self.settings.listen_host
        if host not in ("0.0.0.0", "::", "*"):
            return host
        return route_source(coordinator_host)

    def peer_address(self, coordinator_host: str) -> str:
        """Where other daemons reach this one's peer endpoint ("host:port")."""
        host = self.advertise(coordinator_host)
        return f"[{host}]:{self.peer_port}" if ":" in host else f"{host}:{self.peer_port}"
