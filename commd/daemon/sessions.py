"""The ipc side of the daemon: which job and rank each client connection is, and where its
messages go.

Every frame is decoded here, at the boundary; a bad one gets a typed error reply naming what
was wrong, and nothing else changes. A client that dies without goodbye is noticed through a
pidfd, which becomes readable when the process exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from commd.daemon.guard import Guard
from commd.daemon.handover import BufferSocket
from commd.job.deadlines import failed_long_ago, formation_overdue
from commd.job.job import Job
from commd.job.state import JobError, JobState, LocalRank, SendClient
from commd.job.trace import TraceRecorder
from commd.job.validation import check_hello
from commd_protocol import (
    ClientMessage,
    Error,
    ErrorCode,
    Goodbye,
    Hello,
    ProtocolViolation,
    Ready,
    Register,
    StatusReply,
    StatusRequest,
    TraceRequest,
    Wait,
    Welcome,
)
from commd_protocol.codec import client_codec
from commd_protocol.errors import prefixed
from commd_protocol.status import DaemonStatus, status_map

log = logging.getLogger("commd.server")

MAX_SESSIONS = 4096  # connections that said hello
MAX_JOBS = 1024  # jobs on this node, in any state


@dataclass
class Session:
    job: Job
    member: LocalRank


class ClientSessions:
    def __init__(self, jobs: dict[str, Job], new_job: Callable[[Hello], Job],
                 send: SendClient, welcome: Callable[[], Welcome],
                 status: Callable[[], DaemonStatus], buffers: BufferSocket,
                 guard: Guard) -> None:
        self._jobs = jobs  # the daemon's job table, shared with the peer side
        self._buffers = buffers  # host buffers handed over, by token
        self._guard = guard  # the client loop's: counts what went wrong
        self._new_job = new_job
        self._send = send
        self._welcome = welcome
        self._status = status
        self._sessions: dict[bytes, Session] = {}
        self._pidfds: dict[bytes, int] = {}

    @property
    def count(self) -> int:
        """Connections that said hello."""
        return len(self._sessions)

    def on_frames(self, frames: list[bytes]) -> None:
        """One multipart message from the client ROUTER: [identity, frame]."""
        if len(frames) != 2:
            if frames:
                self._send(frames[0], error(ErrorCode.MALFORMED,
                                            "expected exactly one frame per message"))
            return
        identity, frame = frames
        try:
            message = client_codec.decode(frame)
        except ProtocolViolation as exc:
            self._send(identity, error(exc.code, str(exc), exc.ref))
            return
        try:
            self._dispatch(identity, message)
        except JobError as exc:
            self._send(identity, Error(code=exc.code, message=str(exc), ref=tag(message)))
        except Exception as exc:  # a bug: logged (a traceback once per kind), then answered
            self._guard.failed(exc, f"handling {tag(message)}")
            self._send(identity, error(ErrorCode.INVALID, "internal error; see the daemon's log",
                                       tag(message)))

    def _dispatch(self, identity: bytes, message: ClientMessage) -> None:
        if isinstance(message, StatusRequest):
            self._send(identity, StatusReply(status=status_map(self._status())))
            return
        if isinstance(message, TraceRequest):  # like status: no hello; answered when recorded
            recorder = TraceRecorder(message, lambda reply: self._send(identity, reply))
            job = self._jobs.get(message.job)
            if job is None:
                raise JobError(f"no job {message.job!r} on this daemon; `commd status` lists them")
            job.trace(recorder)
            return
        if isinstance(message, Hello):
            self._hello(identity, message)
            return
        session = self._sessions.get(identity)
        if session is None:
            raise JobError(f"{tag(message)} before hello", ErrorCode.OUT_OF_ORDER)
        job, member = session.job, session.member
        if isinstance(message, Register):
            self._register(identity, session, message)
        elif isinstance(message, Ready):
            if member.registration is None:
                raise JobError("ready before register", ErrorCode.OUT_OF_ORDER)
            job.ready(member, message.layers, message.sent_at, message.stamps)
        elif isinstance(message, Wait):
            if member.registration is None:
                raise JobError("wait before register", ErrorCode.OUT_OF_ORDER)
            if job.failure is not None:
                self._send(identity, job.failure)
                return
            job.wait(member, message.iteration)
        elif isinstance(message, Goodbye):
            self.depart(identity, lost=False)

    def _register(self, identity: bytes, session: Session, message: Register) -> None:
        handed = self._buffers.claim(message.buffer_token) if message.buffer_token else None
        try:
            session.job.register(session.member, message, handed.fd if handed else None)
        except BaseException:
            if handed is not None:  # refused: the rank may correct its register and retry
                self._buffers.give_back(message.buffer_token, handed)
            raise
        if handed is not None:
            os.close(handed.fd)  # mapped: the mapping keeps the memory
        if handed is not None and handed.pid != session.member.pid:
            # The kernel's word, not the hello's: watch the process that holds the buffer.
            session.member.pid = handed.pid
            self._unwatch(identity)
            self._watch_pid(identity, handed.pid)

    def _hello(self, identity: bytes, hello: Hello) -> None:
        if identity in self._sessions:
            raise JobError("hello sent twice on one connection", ErrorCode.OUT_OF_ORDER)
        check_hello(hello)
        if len(self._sessions) >= MAX_SESSIONS:
            raise JobError(f"this daemon serves {MAX_SESSIONS} ranks already; close some",
                           ErrorCode.LIMIT)
        if hello.job not in self._jobs and len(self._jobs) >= MAX_JOBS:
            raise JobError(f"this daemon holds {MAX_JOBS} jobs already; finish some first",
                           ErrorCode.LIMIT)
        job = self._jobs.get(hello.job)
        if job is None:
            job = self._jobs[hello.job] = self._new_job(hello)
        try:
            member = job.add_rank(identity, hello)
        except JobError:
            if not job.members.ranks:
                del self._jobs[hello.job]
            raise
        self._sessions[identity] = Session(job, member)
        self._watch_pid(identity, hello.pid)
        self._send(identity, self._welcome())

    def depart(self, identity: bytes, *, lost: bool) -> None:
        """A client said goodbye (lost=False) or its process exited (lost=True)."""
        session = self._sessions.pop(identity, None)
        self._unwatch(identity)
        if session is None:
            return
        job = session.job
        job.leave(session.member, lost=lost)
        if job.finished:
            job.close()
            if self._jobs.get(job.id) is job:
                del self._jobs[job.id]

    def _watch_pid(self, identity: bytes, pid: int) -> None:
        """Notice a client that dies without goodbye: a pidfd becomes readable at its exit."""
        if pid <= 0:
            return
        try:
            fd = os.pidfd_open(pid)
        except (OSError, OverflowError) as exc:  # another pid namespace, or no pid at all:
            log.info("cannot watch client pid %d (%s)", pid, exc)  # deadlines still apply
            return
        self._pidfds[identity] = fd
        asyncio.get_running_loop().add_reader(fd, self._exited, identity)

    def _exited(self, identity: bytes) -> None:
        self.depart(identity, lost=True)

    def reap(self, now: float) -> None:
        """Fail the jobs that did not form in time, forget the sessions of failed jobs that
        never registered, and forget failed jobs once their ranks have had time to see it."""
        for job in list(self._jobs.values()):
            overdue = formation_overdue(job, now)
            if overdue:
                job.fail(ErrorCode.TIMEOUT, overdue)
            if job.state is not JobState.FAILED:
                continue
            forget_all = failed_long_ago(job, now)
            for identity, session in list(self._sessions.items()):
                if session.job is job and (forget_all or session.member.registration is None):
                    self.depart(identity, lost=False)
            if forget_all and self._jobs.get(job.id) is job:  # no session left to end it
                job.close()
                del self._jobs[job.id]

    def _unwatch(self, identity: bytes) -> None:
        fd = self._pidfds.pop(identity, None)
        if fd is not None:
            _unwatch_fd(fd)

    def close(self) -> None:
        """Stop watching every client process."""
        for fd in list(self._pidfds.values()):
            _unwatch_fd(fd)
        self._pidfds.clear()


def _unwatch_fd(fd: int) -> None:
    with contextlib.suppress(Exception):
        asyncio.get_running_loop().remove_reader(fd)
    with contextlib.suppress(OSError):
        os.close(fd)


def tag(message: msgspec.Struct) -> str:
    """The ``type`` of a message, as the client wrote it."""
    return str(type(message).__struct_config__.tag)


def error(code: ErrorCode, message: str, ref: str = "") -> Error:
    return Error(code=code, message=prefixed(message), ref=ref)
