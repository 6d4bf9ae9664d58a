"""The daemon: its sockets and loops, and its lifecycle (setup → serve → drain → cleanup).

Training processes talk to a ZeroMQ ROUTER on an ipc socket (``sessions``); peer daemons to
a ROUTER on TCP. Messages from coordinators of our jobs come back on the links this daemon
opened to them (``peer_links``); the jobs it coordinates itself are the ``Coordinator``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import msgspec
import zmq
import zmq.asyncio
from threadpoolctl import threadpool_limits

import commd
from commd.compression import native
from commd.coordinator.coordinator import Coordinator
from commd.coordinator.formation import Deadlines
from commd.coordinator.validation import NOT_FOR_A_COORDINATOR, JoinLimits
from commd.daemon import sdnotify
from commd.daemon.guard import Guard, planning_aside, serve
from commd.daemon.handover import BufferSocket
from commd.daemon.job_factory import JobFactory
from commd.daemon.peer_links import PeerLinks
from commd.daemon.peer_security import ClusterKey, KeyFileError, PeerSecurity
from commd.daemon.rendezvous import Rendezvous
from commd.daemon.sessions import ClientSessions
from commd.daemon.settings import Settings
from commd.daemon.sockets import StartupError, bind_clients, bind_peers
from commd.daemon.ticker import tick_forever
from commd.engines import choose_backend, gloo
from commd.job import liveness
from commd.job.job import Job
from commd_protocol import (
    PROTOCOL_VERSION,
    Error,
    ErrorCode,
    PeerAbort,
    PeerMessage,
    PeerPlan,
    PeerReform,
    PeerResume,
    PeerSetup,
    PeerStatus,
    ProtocolViolation,
    Welcome,
    encode,
)
from commd_protocol.codec import frame_tag, peer_codec
from commd_protocol.handover import buffer_socket_path
from commd_protocol.status import DaemonStatus

if TYPE_CHECKING:
    from commd.daemon.metrics import Counts, Metrics

__all__ = ["Daemon", "StartupError"]

log = logging.getLogger("commd.server")

_DRAIN_BATCH = 1024  # messages handled per wake-up before yielding to the loop
_LINGER_MS = 1000  # bounds how long stopping waits for the last replies to go out


class Daemon:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.backend = ""
        self.started = time.time()
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._loops: list[asyncio.Task[None]] = []
        self._context = zmq.asyncio.Context()
        self._clients: zmq.asyncio.Socket | None = None
        self._peers: zmq.asyncio.Socket | None = None
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="commd-memory")
        self.peer_port = 0
        self._links = PeerLinks(self._context, self._on_coordinator_message)
        self._rendezvous = Rendezvous(settings)
        self._coordinator = Coordinator(self._send_peer_reply, self._rendezvous.port, Deadlines(
            form_s=settings.timeout_s, peer_s=settings.peer_timeout_s,
            stall_warn_s=settings.stall_warn_s, stall_s=settings.stall_timeout_s),
            JoinLimits(max_layers=settings.max_layers, max_job_bytes=settings.max_job_bytes),
            plan_in_thread=True, while_planning=planning_aside)
        self._security = PeerSecurity()  # the cluster key and who may connect
        self._security.handshakes.on_disconnect = self._peer_closed
        self._peer_connections: dict[int, bytes] = {}  # descriptor -> the node sending on it
        self._metrics: Metrics | None = None  # --metrics-listen (docs/metrics.md)
        self._client_guard = Guard("client")
        self._peer_guard = Guard("peer")
        self._buffers = BufferSocket(buffer_socket_path(settings.socket))
        self._new_job = JobFactory(settings, self._executor, self._send_client, self._links.send)
        self._sessions = ClientSessions(self._new_job, self._send_client,
                                        self._welcome, self.status, self._buffers,
                                        self._client_guard)
        self.jobs: Mapping[str, Job] = self._sessions.jobs  # read-only: the sessions own it

    # --- lifecycle -------------------------------------------------------------------------------

    async def setup(self) -> None:
        # One BLAS thread: the daemon shares the node's cores with the training processes,
        # and OpenBLAS's spinning worker threads (PowerSGD's products) stalled both: a
        # low-rank step measured 230 ms with them, 44 ms without (two daemons, 2 cores).
        threadpool_limits(limits=1, user_api="blas")
        try:
            self.backend, why = choose_backend(self.settings.backend)
        except Exception as exc:
            raise StartupError(str(exc)) from None
        log.info("backend %s (%s); compression loops: %s", self.backend, why,
                 native.describe())
        self._new_job.backend = self.backend
        key = self._secure_peers()
        self._clients = bind_clients(self._context, self.settings.socket)
        self._buffers.start()
        self._peers, self.peer_port = bind_peers(self._context, self.settings.listen_host,
                                                 self.settings.listen_port, key,
                                                 watch=self._security.watch)
        self._new_job.peer_port = self.peer_port
        served = await self._serve_metrics()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self.stop)
        self._loops = [
            loop.create_task(self._serve_clients(), name="commd-clients"),
            loop.create_task(self._serve_peers(), name="commd-peers"),
        ]
        self._tasks = [*self._loops, loop.create_task(
            sdnotify.watchdog_loop(alive=self._loops_alive), name="commd-watchdog"),
            loop.create_task(tick_forever(
                min(1.0, self.settings.timeout_s / 4), self.jobs, self._sessions,
                self._coordinator, self._links), name="commd-ticker")]
        peers = f"{self.settings.listen_host}:{self.peer_port}"
        sdnotify.ready(f"serving {self.settings.socket}, peers on {peers}{served}")
        log.info("serving clients on %s, peers on port %d", self.settings.socket, self.peer_port)

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

        self._metrics = Metrics(self.status, self._metric_counts, self.jobs)
        self._new_job.observe = self._metrics.observe_iteration
        self._new_job.on_membership_change = self._metrics.membership_changed
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
        await self._links.close()
        self._coordinator.close()
        await self._security.stop()  # its socket monitor first, while the socket is open
        # The error replies of the drain still leave: closing lingers up to LINGER_MS for them.
        for sock in (self._clients, self._peers):
            if sock is not None:
                sock.close(linger=_LINGER_MS)
        self._context.term()
        if self._clients is not None:  # ours to remove only if we bound it
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.settings.socket)
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

    # --- client side -----------------------------------------------------------------------------

    async def _serve_clients(self) -> None:
        clients = self._clients
        assert clients is not None
        # A blocking view of the same socket: after each awaited receive, what is already
        # queued (161 ready notifications of a backward pass) is handled without an await
        # per message (~60 µs each).
        queued: zmq.Socket[bytes] = zmq.Socket.shadow(clients.underlying)

        # Frames, not bytes (copy=False): a frame's Peer-Address is the kernel's word on the
        # sender's uid, for its user's fair share (sessions, shares).
        def handle(frames: list[zmq.Frame]) -> None:
            self._client_guard.call("a client frame", self._sessions.on_frames, frames)
            for _ in range(_DRAIN_BATCH):
                try:
                    more = queued.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self._client_guard.call("a client frame", self._sessions.on_frames, more)

        await serve(self._client_guard, lambda: clients.recv_multipart(copy=False), handle)

    def _send_client(self, identity: bytes, message: msgspec.Struct) -> None:
        if self._clients is None:
            return
        future = self._clients.send_multipart([identity, encode(message)])
        future.add_done_callback(_ignore_result)  # type: ignore[attr-defined]
        if self._metrics is not None and isinstance(message, Error):
            self._metrics.error_sent(message.code)

    def _welcome(self) -> Welcome:
        return Welcome(protocol=PROTOCOL_VERSION, version=commd.__version__,
                       backend=self.backend, buffer_socket=self._buffers.path)

    # --- peer side -------------------------------------------------------------------------------

    async def _serve_peers(self) -> None:
        peers = self._peers
        assert peers is not None
        await serve(self._peer_guard, lambda: peers.recv_multipart(copy=False),
                    self._on_peer_frames)

    def _on_peer_frames(self, frames: list[zmq.Frame]) -> None:
        if len(frames) != 2:
            self._peer_guard.refused("peer message of several frames", f"{len(frames)} frames")
            return
        node, frame = frames[0].bytes, frames[1].bytes
        self._note_connection(node, frames[1])
        if frame_tag(frame) in NOT_FOR_A_COORDINATOR:  # before the body is decoded
            self._peer_guard.refused("bad peer message (not for a coordinator)",
                                     f"{len(frame)} bytes")
            return
        try:
            message = peer_codec.decode(frame)
        except ProtocolViolation as exc:
            self._peer_guard.refused(f"bad peer message ({exc.code})", exc)
            return
        self._coordinator.on_message(node, message)

    def _note_connection(self, node: bytes, frame: zmq.Frame) -> None:
        """Which TCP connection ``node`` sends on: its close (the peer daemon died) is then
        known for whom (``_peer_closed``)."""
        try:
            descriptor = int(frame.get(zmq.SRCFD))
        except (zmq.ZMQError, AttributeError, TypeError, ValueError):
            return
        if self._peer_connections.get(descriptor) != node:
            self._peer_connections[descriptor] = node

    def _peer_closed(self, descriptor: int) -> None:
        """A peer daemon's connection closed: a process that exits closes its connections,
        so the coordinator may take that node as crashed (a network split closes nothing)."""
        node = self._peer_connections.pop(descriptor, None)
        if node is not None and node not in self._peer_connections.values():
            self._coordinator.node_closed(node)

    def _send_peer_reply(self, node: bytes, message: msgspec.Struct) -> None:
        if self._peers is not None:
            future = self._peers.send_multipart([node, encode(message)])
            future.add_done_callback(_ignore_result)  # type: ignore[attr-defined]

    def _on_coordinator_message(self, address: str, message: PeerMessage) -> None:
        job = self.jobs.get(getattr(message, "job", ""))
        if job is None or job.coordinator != address:
            return
        if isinstance(message, PeerSetup):
            task = asyncio.get_running_loop().create_task(job.on_setup(message))
            self._tasks.append(task)
            task.add_done_callback(self._forget_task)
        elif isinstance(message, PeerPlan):
            job.on_plan(message)
        elif isinstance(message, PeerReform):
            job.on_reform(message)
        elif isinstance(message, PeerResume):
            entering = job.on_resume(message)  # checked here, in wire order
            if entering is not None:
                task = asyncio.get_running_loop().create_task(entering)
                self._tasks.append(task)
                task.add_done_callback(self._forget_task)
        elif isinstance(message, PeerStatus):
            liveness.on_status(job, message, time.monotonic())
        elif isinstance(message, PeerAbort):
            job.on_abort(message)

    def _forget_task(self, task: asyncio.Task[None]) -> None:
        with contextlib.suppress(ValueError):
            self._tasks.remove(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("task failed: %r", task.exception())

    # --- status ----------------------------------------------------------------------------------

    def status(self) -> DaemonStatus:
        return DaemonStatus(
            version=commd.__version__,
            protocol=PROTOCOL_VERSION,
            backend=self.backend,
            uptime_s=round(time.time() - self.started, 3),
            pid=os.getpid(),
            socket=self.settings.socket,
            listen=f"{self.settings.listen_host}:{self.peer_port}",
            jobs=[job.status() for job in self.jobs.values()],
            coordinating=self._coordinator.status(),
            peer_handshakes_refused=self._security.refused,
            peer_handshakes_refused_by=self._security.refused_by_reason,
            compression_loops=native.describe(),
            shares=[share.status() for share in (
                self._sessions.sessions_share, self._sessions.jobs_share,
                self._sessions.traces_share, self._buffers.pending_share,
                self._buffers.connections_share)],
            ended=self._sessions.ended.status(),
        )

    def _metric_counts(self) -> Counts:
        """What metrics show beside status; read when metrics are rendered (reads only)."""
        from commd.daemon.metrics import Counts

        guards = (self._client_guard, self._peer_guard, self._links.guard)
        return Counts(
            clients=self._sessions.count,
            peer_links=self._links.count,
            refused={(g.loop, kind): n for g in guards for kind, n in dict(g.counts).items()},
            handovers_refused=self._buffers.refused,
        )


def _ignore_result(future: asyncio.Future[object]) -> None:
    if not future.cancelled():
        future.exception()
