"""The daemon: the parts it wires and their lifecycle (setup → serve → drain → cleanup).

Training processes talk to a ZeroMQ ROUTER on an ipc socket (``client_side``, into the
``sessions``); peer daemons to a ROUTER on TCP (``peer_side``, into the ``Coordinator`` of
the jobs formed here). Messages from the coordinators of our jobs come back on the links
this daemon opened to them (``peer_links``) and go to their jobs (``job_messages``). The
clock (``ticker``) runs deadlines and liveness; ``status_report`` says what the daemon holds.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import zmq
import zmq.asyncio
from threadpoolctl import threadpool_limits

import commd
from commd.compression import native
from commd.coordinator.coordinator import Coordinator
from commd.coordinator.formation import Deadlines
from commd.coordinator.validation import JoinLimits
from commd.daemon import sdnotify
from commd.daemon.client_side import ClientSide
from commd.daemon.guard import Guard, planning_aside
from commd.daemon.handover import BufferSocket
from commd.daemon.job_factory import JobFactory
from commd.daemon.job_messages import JobMessages
from commd.daemon.peer_links import PeerLinks
from commd.daemon.peer_security import ClusterKey, KeyFileError, PeerSecurity
from commd.daemon.peer_side import PeerSide
from commd.daemon.rendezvous import Rendezvous
from commd.daemon.sessions import ClientSessions
from commd.daemon.settings import Settings
from commd.daemon.sockets import StartupError, bind_peers
from commd.daemon.status_report import Identity, StatusReport
from commd.daemon.ticker import tick_forever
from commd.engines import choose_backend, gloo
from commd.job.job import Job
from commd_protocol import PROTOCOL_VERSION, ErrorCode, Welcome
from commd_protocol.handover import buffer_socket_path
from commd_protocol.status import DaemonStatus

if TYPE_CHECKING:
    from commd.daemon.metrics import Metrics

__all__ = ["Daemon", "StartupError"]

log = logging.getLogger("commd.server")

_LINGER_MS = 1000  # bounds how long stopping waits for the last replies to go out


class Daemon:
    """One node's daemon: it wires its parts (the clients' side and its sessions, the peer
    side and the coordinator, the links to our jobs' coordinators, the clock, the status
    and metrics) and owns their lifecycle: setup → serve → drain → cleanup."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._identity = Identity()
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._loops: list[asyncio.Task[None]] = []
        self._context = zmq.asyncio.Context()
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="commd-memory")
        self._client_guard = Guard("client")
        self._peer_guard = Guard("peer")
        self._clients = ClientSide(self._client_guard)
        self._links = PeerLinks(
            self._context, lambda address, message: self._job_messages.deliver(address, message),
            lambda address: self._job_messages.coordinator_closed(address),
            lambda address: self._job_messages.coordinator_up(address),
            lambda address: self._job_messages.nothing_listens(address))
        self._rendezvous = Rendezvous(settings)
        self._peers = PeerSide(self._peer_guard, lambda send: Coordinator(
            send, self._rendezvous.port, Deadlines(
                form_s=settings.timeout_s, peer_s=settings.peer_timeout_s,
                stall_warn_s=settings.stall_warn_s, stall_s=settings.stall_timeout_s),
            JoinLimits(max_layers=settings.max_layers, max_job_bytes=settings.max_job_bytes),
            plan_in_thread=True, while_planning=planning_aside))
        self._coordinator = self._peers.coordinator
        self._security = PeerSecurity()  # the cluster key and who may connect
        self._security.handshakes.on_disconnect = self._peers.connection_closed
        self._metrics: Metrics | None = None  # --metrics-listen (docs/metrics.md)
        self._buffers = BufferSocket(buffer_socket_path(settings.socket))
        self._new_job = JobFactory(settings, self._executor, self._clients.send,
                                   self._links.send)
        self._sessions = ClientSessions(self._new_job, self._clients.send,
                                        self._welcome, self.status, self._buffers,
                                        self._client_guard)
        self.jobs: Mapping[str, Job] = self._sessions.jobs  # read-only: the sessions own it
        self._new_job.membership_changing = self._sessions.fail_helpers
        self._job_messages = JobMessages(self.jobs, self._new_job.successions, self._links.send)
        self._report = StatusReport(
            settings, self._identity, self.jobs, self._sessions, self._buffers, self._security,
            self._coordinator, self._links,
            (self._client_guard, self._peer_guard, self._links.guard))

    @property
    def backend(self) -> str:
        return self._identity.backend

    @property
    def peer_port(self) -> int:
        return self._identity.peer_port

    @property
    def started(self) -> float:
        return self._identity.started

    # --- lifecycle -------------------------------------------------------------------------------

    async def setup(self) -> None:
        # One BLAS thread: the daemon shares the node's cores with the training processes,
        # and OpenBLAS's spinning worker threads (PowerSGD's products) stalled both: a
        # low-rank step measured 230 ms with them, 44 ms without (two daemons, 2 cores).
        threadpool_limits(limits=1, user_api="blas")
        try:
            backend, why = choose_backend(self.settings.backend)
        except Exception as exc:
            raise StartupError(str(exc)) from None
        self._identity.backend = self._new_job.backend = backend
        log.info("backend %s (%s); compression loops: %s", backend, why, native.describe())
        key = self._secure_peers()
        self._clients.bind(self._context, self.settings.socket)
        self._buffers.start()
        self._peers.socket, peer_port = bind_peers(
            self._context, self.settings.listen_host, self.settings.listen_port, key,
            watch=self._security.watch)
        self._identity.peer_port = self._new_job.peer_port = peer_port
        served = await self._serve_metrics()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self.stop)
        self._loops = [
            loop.create_task(self._clients.serve(self._sessions), name="commd-clients"),
            loop.create_task(self._peers.serve(), name="commd-peers"),
        ]
        self._tasks = [*self._loops, loop.create_task(
            sdnotify.watchdog_loop(alive=self._loops_alive), name="commd-watchdog"),
            loop.create_task(tick_forever(
                min(1.0, self.settings.timeout_s / 4), self.jobs, self._sessions,
                self._coordinator, self._links), name="commd-ticker")]
        peers = f"{self.settings.listen_host}:{peer_port}"
        sdnotify.ready(f"serving {self.settings.socket}, peers on {peers}{served}")
        log.info("serving clients on %s, peers on port %d", self.settings.socket, peer_port)

    def _secure_peers(self) -> ClusterKey | None:
        """The cluster key (--cluster-key, else the local key beside the socket), with a ZAP
        handler that admits only its holders; None only with --insecure (no protection)."""
        problem = self.settings.exposure_problem()
        if problem:
            raise StartupError(problem)
        try:
            self._links.key = self._security.start(
                self._context, self.settings.cluster_key, self.settings.socket,
                self.settings.insecure)
        except KeyFileError as exc:
            raise StartupError(str(exc)) from None
        return self._links.key

    async def _serve_metrics(self) -> str:
        """Serve /metrics on this loop when --metrics-listen is set (imported only then); what
        the READY status line adds: ", metrics on HOST:PORT" (the port bound, also port 0)."""
        if not self.settings.metrics_listen:
            return ""
        from commd.daemon.metrics import Metrics

        self._metrics = Metrics(self.status, self._report.counts, self.jobs)
        self._new_job.observe = self._metrics.observe_iteration
        self._new_job.on_membership_change = self._metrics.membership_changed
        self._clients.on_error = self._metrics.error_sent
        return f", metrics on {await self._metrics.serve(self.settings.metrics_listen)}"

    def stop(self) -> None:
        self._stop.set()

    def stuck_collectives(self) -> int:
        """Gloo groups kept for a collective stuck on a stopped peer (see GlooEngine.close)."""
        return gloo.lingering()

    def _loops_alive(self) -> bool:
        """Both message loops still run (a loop that ended means no more watchdog pings)."""
        return all(not task.done() for task in self._loops)

    async def serve(self) -> None:
        await self._stop.wait()

    async def drain(self) -> None:
        sdnotify.stopping()
        log.info("draining %d job(s)", len(self.jobs))
        for job in list(self.jobs.values()):
            job.fail(ErrorCode.SHUTDOWN, "the daemon is shutting down; restart `commd run`")

    async def cleanup(self) -> None:
        if self._metrics is not None:  # a scrape reads what the rest of cleanup undoes
            await self._metrics.close()
        self._sessions.close_jobs()
        self._sessions.close()
        self._buffers.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._job_messages.close()
        await self._links.close()
        await self._security.stop()  # its socket monitor first, while the socket is open
        # The error replies of the drain still leave: closing lingers up to LINGER_MS for them.
        self._clients.close(_LINGER_MS)
        self._peers.close(_LINGER_MS)
        self._context.term()
        self._rendezvous.close()
        self._executor.shutdown(wait=False, cancel_futures=True)
        log.info("stopped")

    async def run(self) -> None:
        try:
            await self.setup()
            await self.serve()
            await self.drain()
        finally:  # also after a failed start: what setup made so far is undone
            await self.cleanup()

    def _welcome(self) -> Welcome:
        return Welcome(protocol=PROTOCOL_VERSION, version=commd.__version__,
                       backend=self.backend, buffer_socket=self._buffers.path)

    def status(self) -> DaemonStatus:
        return self._report.status()
