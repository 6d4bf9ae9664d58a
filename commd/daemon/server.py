"""The daemon: sockets, dispatch and lifecycle (setup → serve → drain → cleanup).

Training processes talk to a ZeroMQ ROUTER on an ipc socket; peer daemons to a ROUTER on TCP.
Every frame is decoded at this boundary; a bad one gets a typed error reply naming what was
wrong, and nothing else changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import signal
import socket as pysocket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import msgspec
import zmq
import zmq.asyncio

import commd
from commd.coordinator.coordinator import Coordinator
from commd.daemon import sdnotify
from commd.daemon.peer_links import PeerLinks
from commd.daemon.rendezvous import Rendezvous
from commd.daemon.settings import Settings
from commd.engines import choose_backend, engine_for_buffers
from commd.job.job import Job, JobContext, JobError, LocalRank
from commd.plan import get_planner
from commd_protocol import (
    PROTOCOL_VERSION,
    ClientMessage,
    Error,
    ErrorCode,
    Goodbye,
    Hello,
    PeerAbort,
    PeerMessage,
    PeerPlan,
    PeerSetup,
    ProtocolViolation,
    Ready,
    Register,
    StatusReply,
    StatusRequest,
    Wait,
    Welcome,
    encode,
)
from commd_protocol.codec import client_codec, peer_codec

log = logging.getLogger("commd.server")

_DRAIN_BATCH = 1024  # messages handled per wake-up before yielding to the loop
_LINGER_MS = 1000  # bounds how long stopping waits for the last replies to go out


class StartupError(Exception):
    """The daemon cannot start; the message says why and what to do."""


@dataclass
class Session:
    job: Job
    member: LocalRank


class Daemon:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.backend = ""
        self.started = time.time()
        self.jobs: dict[str, Job] = {}
        self._sessions: dict[bytes, Session] = {}
        self._pidfds: dict[bytes, int] = {}
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._context = zmq.asyncio.Context()
        self._clients: zmq.asyncio.Socket | None = None
        self._peers: zmq.asyncio.Socket | None = None
        self._rendezvous = Rendezvous()
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="commd-memory")
        self.peer_port = 0
        self._links = PeerLinks(self._context, self._on_coordinator_message)
        self._coordinator = Coordinator(self._send_peer_reply, self._store_port)

    # --- lifecycle -------------------------------------------------------------------------------

    async def setup(self) -> None:
        try:
            self.backend, why = choose_backend(self.settings.backend)
        except Exception as exc:
            raise StartupError(str(exc)) from None
        log.info("backend %s (%s)", self.backend, why)
        self._bind_clients()
        self._bind_peers()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self.stop)
        self._tasks = [
            loop.create_task(self._serve_clients(), name="commd-clients"),
            loop.create_task(self._serve_peers(), name="commd-peers"),
            loop.create_task(sdnotify.watchdog_loop(), name="commd-watchdog"),
        ]
        peers = f"{self.settings.listen_host}:{self.peer_port}"
        sdnotify.ready(f"serving {self.settings.socket}, peers on {peers}")
        log.info("serving clients on %s, peers on port %d", self.settings.socket, self.peer_port)

    def _bind_clients(self) -> None:
        path = self.settings.socket
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        if os.path.exists(path):
            if _socket_answers(path):
                raise StartupError(
                    f"commd: another daemon is serving {path}; stop it or pass --socket"
                )
            os.unlink(path)  # left over from a daemon that died
        self._clients = self._context.socket(zmq.ROUTER)
        self._clients.setsockopt(zmq.LINGER, 0)
        self._clients.setsockopt(zmq.MAXMSGSIZE, 64 * 1024 * 1024)  # a hard cap; 4 MiB is typed
        self._clients.bind(f"ipc://{path}")
        os.chmod(path, 0o660)

    def _bind_peers(self) -> None:
        host, port = self.settings.listen_host, self.settings.listen_port
        self._peers = self._context.socket(zmq.ROUTER)
        self._peers.setsockopt(zmq.LINGER, 0)
        try:
            if port == 0:
                self.peer_port = self._peers.bind_to_random_port(f"tcp://{host}")
            else:
                self._peers.bind(f"tcp://{host}:{port}")
                self.peer_port = port
        except zmq.ZMQError as exc:
            raise StartupError(
                f"commd: cannot listen for peers on {host}:{port}: {exc}; pass --listen"
            ) from None

    def stop(self) -> None:
        self._stop.set()

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
        for fd in list(self._pidfds.values()):
            self._unwatch_fd(fd)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._links.close()
        # The error replies of the drain still leave: closing lingers up to LINGER_MS for them.
        for sock in (self._clients, self._peers):
            if sock is not None:
                sock.close(linger=_LINGER_MS)
        self._context.term()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.settings.socket)
        self._rendezvous.close()
        self._executor.shutdown(wait=False, cancel_futures=True)
        log.info("stopped")

    async def run(self) -> None:
        await self.setup()
        try:
            await self.serve()
            await self.drain()
        finally:
            await self.cleanup()

    # --- client side -----------------------------------------------------------------------------

    async def _serve_clients(self) -> None:
        assert self._clients is not None
        # A blocking view of the same socket: after each awaited receive, what is already
        # queued (161 ready notifications of a backward pass) is handled without an await
        # per message (~60 µs each).
        queued: zmq.Socket[bytes] = zmq.Socket.shadow(self._clients.underlying)
        while True:
            self._on_client_frames(await self._clients.recv_multipart(copy=True))
            for _ in range(_DRAIN_BATCH):
                try:
                    frames = queued.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._on_client_frames(frames)

    def _on_client_frames(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            if frames:
                self._send_client(
                    frames[0], _error(ErrorCode.MALFORMED, "expected exactly one frame per message")
                )
            return
        identity, frame = frames
        try:
            message = client_codec.decode(frame)
        except ProtocolViolation as exc:
            self._send_client(identity, _error(exc.code, str(exc), exc.ref))
            return
        try:
            self._dispatch(identity, message)
        except JobError as exc:
            self._send_client(identity, Error(code=exc.code, message=str(exc), ref=_tag(message)))
        except Exception:
            log.exception("internal error handling %s", _tag(message))
            self._send_client(
                identity, _error(ErrorCode.INVALID, "internal error; see the daemon's log",
                                 _tag(message))
            )

    def _dispatch(self, identity: bytes, message: ClientMessage) -> None:
        if isinstance(message, StatusRequest):
            self._send_client(identity, StatusReply(status=self.status()))
            return
        if isinstance(message, Hello):
            self._hello(identity, message)
            return
        session = self._sessions.get(identity)
        if session is None:
            raise JobError(f"{_tag(message)} before hello", ErrorCode.OUT_OF_ORDER)
        job, member = session.job, session.member
        if isinstance(message, Register):
            job.register(member, message)
        elif isinstance(message, Ready):
            if member.registration is None:
                raise JobError("ready before register", ErrorCode.OUT_OF_ORDER)
            job.ready(member, message.layers, message.sent_at, message.stamps)
        elif isinstance(message, Wait):
            if member.registration is None:
                raise JobError("wait before register", ErrorCode.OUT_OF_ORDER)
            if job.failure is not None:
                self._send_client(identity, job.failure)
                return
            job.wait(member, message.iteration)
        elif isinstance(message, Goodbye):
            self._depart(identity, lost=False)

    def _hello(self, identity: bytes, hello: Hello) -> None:
        if identity in self._sessions:
            raise JobError("hello sent twice on one connection", ErrorCode.OUT_OF_ORDER)
        Job.check_hello(hello)
        job = self.jobs.get(hello.job)
        if job is None:
            job = Job(hello, self._job_context())
            self.jobs[hello.job] = job
        try:
            member = job.add_rank(identity, hello)
        except JobError:
            if not job.ranks:
                del self.jobs[hello.job]
            raise
        self._sessions[identity] = Session(job, member)
        self._watch_pid(identity, hello.pid)
        self._send_client(
            identity,
            Welcome(protocol=PROTOCOL_VERSION, version=commd.__version__, backend=self.backend),
        )

    def _depart(self, identity: bytes, *, lost: bool) -> None:
        session = self._sessions.pop(identity, None)
        fd = self._pidfds.pop(identity, None)
        if fd is not None:
            self._unwatch_fd(fd)
        if session is None:
            return
        job = session.job
        job.leave(session.member, lost=lost)
        if job.finished:
            job.close()
            if self.jobs.get(job.id) is job:
                del self.jobs[job.id]

    def _watch_pid(self, identity: bytes, pid: int) -> None:
        """Notice a client that dies without goodbye: a pidfd becomes readable at its exit."""
        if pid <= 0:
            return
        try:
            fd = os.pidfd_open(pid)
        except OSError as exc:  # another pid namespace; the job then relies on timeouts
            log.info("cannot watch client pid %d (%s)", pid, exc.strerror)
            return
        self._pidfds[identity] = fd
        asyncio.get_running_loop().add_reader(fd, self._client_exited, identity)

    def _client_exited(self, identity: bytes) -> None:
        self._depart(identity, lost=True)

    def _unwatch_fd(self, fd: int) -> None:
        with contextlib.suppress(Exception):
            asyncio.get_running_loop().remove_reader(fd)
        with contextlib.suppress(OSError):
            os.close(fd)

    def _send_client(self, identity: bytes, message: msgspec.Struct) -> None:
        if self._clients is None:
            return
        future = self._clients.send_multipart([identity, encode(message)])
        future.add_done_callback(_ignore_result)  # type: ignore[attr-defined]

    def _job_context(self) -> JobContext:
        return JobContext(
            backend=self.backend,
            engine_for=self._engine_for,
            timeout_s=self.settings.timeout_s,
            advertise=self._advertise,
            executor=self._executor,
            send_client=self._send_client,
            send_peer=self._links.send,
            validate_planner=validate_planner,
            default_planner=self.settings.planner,
        )

    def _engine_for(self, kind: str) -> str:
        return engine_for_buffers(kind, self.settings.backend, self.backend)

    def _advertise(self, coordinator_host: str) -> str:
        if self.settings.advertise:
            return self.settings.advertise
        host = self.settings.listen_host
        if host not in ("0.0.0.0", "::", "*"):
            return host
        return _route_source(coordinator_host)

    # --- peer side -------------------------------------------------------------------------------

    async def _serve_peers(self) -> None:
        assert self._peers is not None
        while True:
            frames = await self._peers.recv_multipart(copy=True)
            if len(frames) != 2:
                continue
            node, frame = frames
            try:
                message = peer_codec.decode(frame)
            except ProtocolViolation as exc:
                log.warning("dropping a bad peer message: %s", exc)
                continue
            self._coordinator.on_message(node, message)

    def _send_peer_reply(self, node: bytes, message: msgspec.Struct) -> None:
        if self._peers is not None:
            future = self._peers.send_multipart([node, encode(message)])
            future.add_done_callback(_ignore_result)  # type: ignore[attr-defined]

    def _store_port(self) -> int:
        return self._rendezvous.port(self.settings.listen_host)

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

    def status(self) -> dict[str, object]:
        return {
            "version": commd.__version__,
            "protocol": PROTOCOL_VERSION,
            "backend": self.backend,
            "uptime_s": round(time.time() - self.started, 3),
            "pid": os.getpid(),
            "socket": self.settings.socket,
            "listen": f"{self.settings.listen_host}:{self.peer_port}",
            "jobs": [job.status() for job in self.jobs.values()],
            "coordinating": self._coordinator.status(),
        }


def validate_planner(name: str) -> None:
    """Raise ValueError naming the valid planners when ``name`` is not one."""
    get_planner(name)


def _tag(message: msgspec.Struct) -> str:
    return str(type(message).__struct_config__.tag)


def _error(code: ErrorCode, message: str, ref: str = "") -> Error:
    return Error(code=code, message=message if message.startswith("commd: ") else
                 "commd: " + message, ref=ref)


def _ignore_result(future: asyncio.Future[object]) -> None:
    if not future.cancelled():
        future.exception()


def _socket_answers(path: str) -> bool:
    probe = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError as exc:
        return exc.errno not in (errno.ECONNREFUSED, errno.ENOENT)
    finally:
        probe.close()
    return True


def _route_source(host: str) -> str:
    """The local address the kernel would use to reach ``host`` (no packet is sent)."""
    probe = pysocket.socket(pysocket.AF_INET, pysocket.SOCK_DGRAM)
    try:
        probe.connect((host, 9))
        return str(probe.getsockname()[0])
    except OSError:
        return "127.0.0.1"
    finally:
        probe.close()
