"""The ipc side of the daemon: which job and rank each client connection is, and where its
messages go.

Every frame is decoded here, at the boundary; a bad one gets a typed error reply naming what
was wrong, and nothing else changes. A client that dies without goodbye is noticed through a
pidfd, which becomes readable when the process exits.

Each connection's user is the kernel's (``shares.peer_uid``): what a user may hold here (ranks
connected, jobs, traces running) is capped per user as well as per daemon (``shares``), a job
belongs to the user whose hello created it, and only that user (or root) may join or trace it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import select
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import msgspec
import zmq

from commd.daemon.ended import EndedJobs, outcome
from commd.daemon.guard import Guard
from commd.daemon.handover import BufferSocket
from commd.daemon.shares import JOBS, ROOT_UID, SESSIONS, TRACES, UNKNOWN_UID, Shares, peer_uid, who
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


@dataclass
class Session:
    """One client connection that said hello: the job and local rank it is, and its user."""

    job: Job
    member: LocalRank
    uid: int  # of the process on the connection, from the kernel


class ClientSessions:
    """The daemon's jobs as its clients make them: each connection's session, the job table (a job
    starts with a hello and ends when its last rank has gone), what each user holds of the
    caps, the client processes watched through pidfds, and the jobs that ended lately."""

    def __init__(self, new_job: Callable[[Hello], Job],
                 send: SendClient, welcome: Callable[[], Welcome],
                 status: Callable[[], DaemonStatus], buffers: BufferSocket,
                 guard: Guard) -> None:
        # The daemon's job table. A job starts with a rank's hello and ends when its last
        # rank has gone, both here: the sessions alone add and forget jobs.
        self._jobs: dict[str, Job] = {}
        # ... and everything else reads it: the peer side, the clock, the metrics
        self.jobs: Mapping[str, Job] = MappingProxyType(self._jobs)
        self._buffers = buffers  # host buffers handed over, by token
        self._guard = guard  # the client loop's: counts what went wrong
        self._new_job = new_job
        self._send = send
        self._welcome = welcome
        self._status = status
        self._sessions: dict[bytes, Session] = {}
        self._pidfds: dict[bytes, int] = {}
        self._owners: dict[str, int] = {}  # job id -> the uid whose hello created it
        self.sessions_share = Shares(SESSIONS)
        self.jobs_share = Shares(JOBS)
        self.traces_share = Shares(TRACES)
        # the last jobs that left the table, with how they ended (``commd status``)
        self.ended = EndedJobs()

    @property
    def count(self) -> int:
        """Connections that said hello."""
        return len(self._sessions)

    def on_frames(self, frames: Sequence[zmq.Frame]) -> None:
        """One multipart message from the client ROUTER: [identity, frame], received as
        frames (``copy=False``) for the kernel's word on who sent it (``_uid``)."""
        if len(frames) != 2:
            if frames:
                self._send(frames[0].bytes, error(ErrorCode.MALFORMED,
                                                  "expected exactly one frame per message"))
            return
        identity, frame = frames[0].bytes, frames[1]
        try:
            message = client_codec.decode(frame.bytes)
        except ProtocolViolation as exc:
            self._send(identity, error(exc.code, str(exc), exc.ref))
            return
        try:
            self._dispatch(identity, message, frame)
        except JobError as exc:
            self._send(identity, Error(code=exc.code, message=str(exc), ref=tag(message)))
        except Exception as exc:  # a bug: logged (a traceback once per kind), then answered
            self._guard.failed(exc, f"handling {tag(message)}")
            self._send(identity, error(ErrorCode.INVALID, "internal error; see the daemon's log",
                                       tag(message)))

    def _dispatch(self, identity: bytes, message: ClientMessage, frame: zmq.Frame) -> None:
        if isinstance(message, StatusRequest):
            self._send(identity, StatusReply(status=status_map(self._status())))
            return
        if isinstance(message, TraceRequest):  # like status: no hello; answered when recorded
            self._trace(identity, message, _uid(frame))
            return
        if isinstance(message, Hello):
            self._hello(identity, message, _uid(frame))
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

    def _trace(self, identity: bytes, request: TraceRequest, uid: int) -> None:
        """Arm a recorder on the job, if ``uid`` owns it (or is root) and has a trace to spare;
        the share is given back with the recorder's one reply."""
        recorder = TraceRecorder(request, lambda reply: self._traced(identity, uid, reply))
        job = self._jobs.get(request.job)
        if job is None:
            raise JobError(f"no job {request.job!r} on this daemon; `commd status` lists them")
        self._check_owner(job, uid, "trace")
        refusal = self.traces_share.refusal(uid)
        if refusal:
            raise JobError(f"trace of job {request.job!r}: {refusal}", ErrorCode.LIMIT)
        job.trace(recorder)
        self.traces_share.take(uid)

    def _traced(self, identity: bytes, uid: int, reply: msgspec.Struct) -> None:
        self.traces_share.give(uid)  # a recorder replies once, then lets go of the job
        self._send(identity, reply)

    def _check_owner(self, job: Job, uid: int, what: str) -> None:
        """JobError unless ``uid`` is the job's user or root."""
        owner = self._owners.get(job.id, UNKNOWN_UID)
        if uid != owner and uid != ROOT_UID:
            raise JobError(f"job {job.id!r} belongs to {who(owner)}, not to {who(uid)}: only "
                           f"its own user or root may {what} it; use a job id of your own")

    def _hello(self, identity: bytes, hello: Hello, uid: int) -> None:
        if identity in self._sessions:
            raise JobError("hello sent twice on one connection", ErrorCode.OUT_OF_ORDER)
        check_hello(hello)
        refusal = self.sessions_share.refusal(uid)
        if refusal:
            raise JobError(refusal, ErrorCode.LIMIT)
        job = self._jobs.get(hello.job)
        if job is not None:
            # Ranks of the job that have exited but whose exit the loop has not seen yet: a
            # launcher restarts a node's ranks only once they are all dead (torchrun does),
            # and the hello of a restarted one must find them gone, not live.
            self._settle_exits(job)
            job = self._jobs.get(hello.job)
        if job is None:
            refusal = self.jobs_share.refusal(uid)
            if refusal:
                raise JobError(refusal, ErrorCode.LIMIT)
            refusal = self._helper_refusal(hello)
            if refusal:
                raise JobError(refusal, ErrorCode.RANK_LOST)
            job = self._jobs[hello.job] = self._new_job(hello)
            self._owners[hello.job] = uid
            self.jobs_share.take(uid)
        else:
            self._check_owner(job, uid, "join")
        try:
            member = job.add_rank(identity, hello)
        except JobError:
            if not job.members.ranks:
                self._forget(job)
            raise
        self._sessions[identity] = Session(job, member, uid)
        self.sessions_share.take(uid)
        self._watch_pid(identity, hello.pid)
        self._send(identity, self._welcome())

    def _helper_refusal(self, hello: Hello) -> str:
        """'' unless ``hello`` starts a helper of a job whose membership here has moved past
        the helper's epoch (its peer may be the rank that was lost): then why."""
        parent = self._jobs.get(hello.parent) if hello.parent else None
        if parent is None:
            return ""
        moved = parent.epochs.latest
        if moved <= hello.parent_epoch:
            return ""
        return (f"job {hello.parent!r} changed its membership (epoch {moved}) before this "
                f"helper of its epoch {hello.parent_epoch} began")

    def fail_helpers(self, parent: str, epoch: int) -> None:
        """Job ``parent`` stops here for membership epoch ``epoch``: its helpers of earlier
        epochs fail now (a state transfer whose source or joiner may be the rank lost would
        otherwise wait for it until the timeout). A helper that ended already stays as it
        ended (``Job.fail`` latches)."""
        for job in list(self._jobs.values()):
            helper = job.helper_of
            if helper is not None and helper[0] == parent and helper[1] < epoch:
                job.fail(ErrorCode.RANK_LOST,
                         f"job {parent!r} changed its membership (epoch {epoch}) during this "
                         f"helper of its epoch {helper[1]}: its peer may be the rank lost")

    def _settle_exits(self, job: Job) -> None:
        """Depart now every session of ``job`` whose process has exited (its pidfd is
        readable) and that the loop has not handled yet."""
        for identity, session in list(self._sessions.items()):
            fd = self._pidfds.get(identity)
            if session.job is job and fd is not None and _has_exited(fd):
                self.depart(identity, lost=True)

    def _end(self, job: Job) -> None:
        """Close ``job`` and drop it from the table, keeping its last status and how it ended
        among the ended jobs (if it is still the one there)."""
        before = job.state  # close turns a job that did not fail into a closed one
        job.close()
        try:  # a record that cannot be made must not keep the job in the table
            if self._jobs.get(job.id) is job:
                failure = job.failure.message if job.failure is not None else None
                self.ended.add(job.status(), outcome(before, failure), time.time())
        finally:
            self._forget(job)

    def _forget(self, job: Job) -> None:
        """Drop ``job`` from the daemon's table (if it is still the one there)."""
        if self._jobs.get(job.id) is job:
            del self._jobs[job.id]
            self.jobs_share.give(self._owners.pop(job.id, UNKNOWN_UID))

    def depart(self, identity: bytes, *, lost: bool) -> None:
        """A client said goodbye (lost=False) or its process exited (lost=True)."""
        session = self._sessions.pop(identity, None)
        self._unwatch(identity)
        if session is None:
            return
        self.sessions_share.give(session.uid)
        job = session.job
        job.leave(session.member, lost=lost)
        if job.finished:
            self._end(job)

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
                self._end(job)

    def _unwatch(self, identity: bytes) -> None:
        fd = self._pidfds.pop(identity, None)
        if fd is not None:
            _unwatch_fd(fd)

    def close_jobs(self) -> None:
        """Close every job (the daemon's cleanup) and forget them."""
        for job in list(self._jobs.values()):
            job.close()
        self._jobs.clear()

    def close(self) -> None:
        """Stop watching every client process."""
        for fd in list(self._pidfds.values()):
            _unwatch_fd(fd)
        self._pidfds.clear()


def _has_exited(pidfd: int) -> bool:
    """A pidfd is readable once its process has exited."""
    readable, _, _ = select.select([pidfd], [], [], 0)
    return bool(readable)


def _unwatch_fd(fd: int) -> None:
    with contextlib.suppress(Exception):
        asyncio.get_running_loop().remove_reader(fd)
    with contextlib.suppress(OSError):
        os.close(fd)


def _uid(frame: zmq.Frame) -> int:
    """The uid of the process that sent ``frame``, from the kernel (SO_PEERCRED, which libzmq
    reports as the frame's ``Peer-Address`` on an ipc connection)."""
    try:
        address = frame.get("Peer-Address")
    except (zmq.ZMQError, AttributeError, UnicodeDecodeError):
        return UNKNOWN_UID
    return peer_uid(address if isinstance(address, str) else None)


def tag(message: msgspec.Struct) -> str:
    """The ``type`` of a message, as the client wrote it."""
    return str(type(message).__struct_config__.tag)


def error(code: ErrorCode, message: str, ref: str = "") -> Error:
    return Error(code=code, message=prefixed(message), ref=ref)
