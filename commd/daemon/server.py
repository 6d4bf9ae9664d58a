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
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
import zmq
import zmq.asyncio

import commd
from commd.coordinator import Coordinator
from commd.daemon import sdnotify
from commd.daemon.guard import Guard, serve
from commd.daemon.handover import BufferSocket
from commd.daemon.peer_links import PeerLinks
from commd.daemon.peer_security import (
    ClusterKey,
    ClusterOnly,
    KeyFileError,
    load_key,
    start_authenticator,
)
from commd.daemon.rendezvous import Rendezvous
from commd.daemon.sessions import ClientSessions
from commd.daemon.settings import Settings
from commd.daemon.sockets import StartupError, bind_clients, bind_peers, route_source
from commd.engines import choose_backend, engine_for_buffers
from commd.job.job import Job
from commd.job.state import JobContext
from commd.plan import get_planner
from commd_protocol import (
    PROTOCOL_VERSION,
    ErrorCode,
    Hello,
    PeerAbort,
    PeerMessage,
    PeerPlan,
    PeerSetup,
    ProtocolViolation,
    Welcome,
    encode,
)
from commd_protocol.codec import peer_codec
from commd_protocol.handover import buffer_socket_path
from commd_protocol.status import DaemonStatus

__all__ = ["Daemon", "StartupError"]

log = logging.getLogger("commd.server")

_DRAIN_BATCH = 1024  # messages handled per wake-up before yielding to the loop
_LINGER_MS = 1000  # bounds how long stopping waits for the last replies to go out


class Daemon:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.backend = ""
        self.started = time.time()
        self.jobs: dict[str, Job] = {}
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._loops: list[asyncio.Task[None]] = []
        self._context = zmq.asyncio.Context()
        self._clients: zmq.asyncio.Socket | None = None
        self._peers: zmq.asyncio.Socket | None = None
        self._rendezvous = Rendezvous()
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="commd-memory")
        self.peer_port = 0
        self._links = PeerLinks(self._context, self._on_coordinator_message)
        self._coordinator = Coordinator(self._send_peer_reply, self._store_port,
                                        settings.timeout_s)
        self._authenticator: Any = None  # the ZAP handler, with a cluster key
        self._admission: ClusterOnly | None = None
        self._client_guard = Guard("client")
        self._peer_guard = Guard("peer")
        self._buffers = BufferSocket(buffer_socket_path(settings.socket))
        self._sessions = ClientSessions(self.jobs, self._new_job, self._send_client,
                                        self._welcome, self.status, self._buffers,
                                        self._client_guard)

    # --- lifecycle -------------------------------------------------------------------------------

    async def setup(self) -> None:
        try:
            self.backend, why = choose_backend(self.settings.backend)
        except Exception as exc:
            raise StartupError(str(exc)) from None
        log.info("backend %s (%s)", self.backend, why)
        key = self._secure_peers()
        self._clients = bind_clients(self._context, self.settings.socket)
        self._buffers.start()
        self._peers, self.peer_port = bind_peers(self._context, self.settings.listen_host,
                                                 self.settings.listen_port, key)
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self.stop)
        self._loops = [
            loop.create_task(self._serve_clients(), name="commd-clients"),
            loop.create_task(self._serve_peers(), name="commd-peers"),
        ]
        self._tasks = [*self._loops, loop.create_task(
            sdnotify.watchdog_loop(alive=self._loops_alive), name="commd-watchdog"),
            loop.create_task(self._reap_forever(), name="commd-reaper")]
        peers = f"{self.settings.listen_host}:{self.peer_port}"
        sdnotify.ready(f"serving {self.settings.socket}, peers on {peers}")
        log.info("serving clients on %s, peers on port %d", self.settings.socket, self.peer_port)

    def _secure_peers(self) -> ClusterKey | None:
        """The cluster key and the ZAP handler that admits only its holders (None: no key,
        then peers are served on loopback only, unless --insecure)."""
        problem = self.settings.exposure_problem()
        if problem:
            raise StartupError(problem)
        if not self.settings.cluster_key:
            if self.settings.insecure:
                log.warning("serving peers on %s without a cluster key (--insecure)",
                            self.settings.peer_listen)
            return None
        try:
            key = load_key(self.settings.cluster_key)
        except KeyFileError as exc:
            raise StartupError(str(exc)) from None
        self._authenticator, self._admission = start_authenticator(self._context, key)
        self._links.key = key
        log.info("peers authenticated and encrypted with the cluster key %s",
                 self.settings.cluster_key)
        return key

    def stop(self) -> None:
        self._stop.set()

    async def _reap_forever(self) -> None:
        """Deadlines: jobs that do not form, sessions that never register, failed jobs."""
        guard = Guard("reaper")
        period = min(1.0, self.settings.timeout_s / 4)
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            guard.call("the client side", self._sessions.reap, now)
            guard.call("the coordinator", self._coordinator.expire, now)

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
        for job in list(self.jobs.values()):
            job.close()
        self.jobs.clear()
        self._sessions.close()
        self._buffers.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._links.close()
        if self._authenticator is not None:
            self._authenticator.stop()
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

        def handle(frames: list[bytes]) -> None:
            self._client_guard.call("a client frame", self._sessions.on_frames, frames)
            for _ in range(_DRAIN_BATCH):
                try:
                    more = queued.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._client_guard.call("a client frame", self._sessions.on_frames, more)

        await serve(self._client_guard, lambda: clients.recv_multipart(copy=True), handle)

    def _send_client(self, identity: bytes, message: msgspec.Struct) -> None:
        if self._clients is None:
            return
        future = self._clients.send_multipart([identity, encode(message)])
        future.add_done_callback(_ignore_result)  # type: ignore[attr-defined]

    def _welcome(self) -> Welcome:
        return Welcome(protocol=PROTOCOL_VERSION, version=commd.__version__,
                       backend=self.backend, buffer_socket=self._buffers.path)

    def _new_job(self, hello: Hello) -> Job:
        return Job(hello, JobContext(
            engine_for=self._engine_for,
            timeout_s=self.settings.timeout_s,
            advertise=self._advertise,
            executor=self._executor,
            send_client=self._send_client,
            send_peer=self._links.send,
            validate_planner=get_planner,
            default_planner=self.settings.planner,
            max_layers=self.settings.max_layers,
            max_job_bytes=self.settings.max_job_bytes,
        ))

    def _engine_for(self, kind: str) -> str:
        return engine_for_buffers(kind, self.settings.backend, self.backend)

    def _advertise(self, coordinator_host: str) -> str:
        if self.settings.advertise:
            return self.settings.advertise
        host = self.settings.listen_host
        if host not in ("0.0.0.0", "::", "*"):
            return host
        return route_source(coordinator_host)

    # --- peer side -------------------------------------------------------------------------------

    async def _serve_peers(self) -> None:
        peers = self._peers
        assert peers is not None
        await serve(self._peer_guard, lambda: peers.recv_multipart(copy=True),
                    self._on_peer_frames)

    def _on_peer_frames(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            self._peer_guard.refused("peer message of several frames", f"{len(frames)} frames")
            return
        node, frame = frames
        try:
            message = peer_codec.decode(frame)
        except ProtocolViolation as exc:
            self._peer_guard.refused(f"bad peer message ({exc.code})", exc)
            return
        self._coordinator.on_message(node, message)

    def _send_peer_reply(self, node: bytes, message: msgspec.Struct) -> None:
        if self._peers is not None:
            future = self._peers.send_multipart([node, encode(message)])
            future.add_done_callback(_ignore_result)  # type: ignore[attr-defined]

    def _store_port(self, peer_host: str) -> int:
        """The rendezvous store, bound to one address (never every interface): the one we
        listen on, the one we advertise, or the one that routes to the joining peer."""
        host = self.settings.listen_host
        if host in ("0.0.0.0", "::", "*"):
            host = self.settings.advertise or route_source(peer_host)
        return self._rendezvous.port(host)

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
        elif isinstance(message, PeerAbort):
            job.fail(ErrorCode(message.code) if message.code in ErrorCode._value2member_map_
                     else ErrorCode.ENGINE, message.message, tell_coordinator=False)

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
            peer_handshakes_refused=self._admission.rejected if self._admission else 0,
        )


def _ignore_result(future: asyncio.Future[object]) -> None:
    if not future.cancelled():
        future.exception()
