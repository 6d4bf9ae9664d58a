"""The buffer socket: where ranks hand over their host buffers as file descriptors.

Beside the ipc socket, an AF_UNIX SOCK_SEQPACKET socket (commd_protocol.handover). Each
connection carries one message, a token with one descriptor; the sender's pid and uid come
from the kernel (SO_PEERCRED), not from what the rank says. A descriptor that is not a sealed
memfd is refused at once. Accepted ones wait, by token, for the ``register`` that names them;
unclaimed ones are closed after CLAIM_S.

Connections and waiting buffers are capped per user (the uid from SO_PEERCRED) as well as per
daemon (``shares.BUFFER_CONNECTIONS``, ``shares.PENDING_HANDOVERS``), and a connection gets
CONNECTION_S to send its one message: one user's silent connections or unregistered buffers
cannot keep another user's ranks from handing over. Every refusal is answered with its reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import socket
import stat
import struct
import time
from dataclasses import dataclass

from commd.daemon.shares import BUFFER_CONNECTIONS, PENDING_HANDOVERS, Shares
from commd_protocol.handover import MAX_MESSAGE, OK, TOKEN_CHARS

log = logging.getLogger("commd.handover")

NEEDED_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW  # no SIGBUS, no surprise growth
CLAIM_S = 60.0  # a handed buffer not registered within this is closed
# A rank sends its one message right after connecting (microseconds): a connection that has
# sent nothing after this is closed. Short, so that held connections turn over quickly.
CONNECTION_S = 1.0
_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid


@dataclass
class _Connection:
    link: socket.socket
    timer: asyncio.TimerHandle
    uid: int  # from the kernel, at accept


@dataclass
class Handed:
    """A host buffer handed over and not yet claimed: its descriptor, the sender's pid and uid
    (from the kernel) and when it came."""

    fd: int
    pid: int  # of the process that sent it, from the kernel
    uid: int
    at: float  # monotonic time it arrived


class HandoverError(Exception):
    """A refused hand-over; the message goes back to the rank."""


def check_descriptor(fd: int) -> None:
    """A regular file (memfd) sealed against shrinking and growing; else HandoverError."""
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise HandoverError("the descriptor is not a memory file (memfd_create)")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        seals = 0
    if seals & NEEDED_SEALS != NEEDED_SEALS:
        raise HandoverError("the buffer must be a memfd sealed with F_SEAL_SHRINK and "
                            "F_SEAL_GROW (a buffer that can shrink could crash the daemon)")


class BufferSocket:
    """The buffer socket (the module's docstring): takes each connection's one descriptor, checks
    it, keeps it by token until a ``register`` claims it, and closes what is not claimed within
    CLAIM_S."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._listener: socket.socket | None = None
        self._pending: dict[str, Handed] = {}
        self._connections: dict[int, _Connection] = {}
        self.pending_share = Shares(PENDING_HANDOVERS)
        self.connections_share = Shares(BUFFER_CONNECTIONS)
        self.refused = 0

    def start(self) -> None:
        """Bind (0660, like the ipc socket) and serve on the running loop."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # the ipc socket's bind already found no live daemon
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.setblocking(False)
        listener.bind(self.path)
        os.chmod(self.path, 0o660)
        listener.listen(BUFFER_CONNECTIONS.per_daemon)
        self._listener = listener
        asyncio.get_running_loop().add_reader(listener.fileno(), self._accept)

    def claim(self, token: str) -> Handed | None:
        """The buffer handed over under ``token``, now the caller's to close or to give back
        (None: none)."""
        self._expire()
        handed = self._pending.pop(token, None)
        if handed is not None:
            self.pending_share.give(handed.uid)
        return handed

    def give_back(self, token: str, handed: Handed) -> None:
        """A register that named ``token`` was refused: the rank may correct it and retry."""
        self._pending[token] = handed
        self.pending_share.take(handed.uid)

    def _accept(self) -> None:
        assert self._listener is not None
        try:
            connection, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        connection.setblocking(False)
        uid = _credentials(connection)[1]
        refusal = self.connections_share.refusal(uid)
        if refusal:
            self.refused += 1
            _refuse(connection, refusal)
            return
        loop = asyncio.get_running_loop()
        fileno = connection.fileno()
        timer = loop.call_later(CONNECTION_S, self._drop, fileno)
        self._connections[fileno] = _Connection(connection, timer, uid)
        self.connections_share.take(uid)
        loop.add_reader(fileno, self._receive, fileno)

    def _receive(self, fileno: int) -> None:
        connection = self._connections[fileno].link
        fds: list[int] = []
        try:
            message, fds, _flags, _address = socket.recv_fds(connection, MAX_MESSAGE, 2)
            pid, uid, _gid = _credentials(connection)
            token = self._accept_buffer(message, fds, pid, uid)
            fds = []  # the pending table owns it now
            reply = OK
            log.debug("buffer %s… from pid %d (uid %d)", token[:8], pid, uid)
        except HandoverError as exc:
            self.refused += 1
            reply = str(exc).encode()[:MAX_MESSAGE]
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            reply = b""
        except Exception:  # a reader callback must never leave its connection readable
            log.exception("hand-over from a client failed")
            reply = b"internal error; see the daemon's log"
        finally:
            for fd in fds:
                os.close(fd)
        with contextlib.suppress(OSError):
            connection.send(reply)
        self._drop(fileno)

    def _accept_buffer(self, message: bytes, fds: list[int], pid: int, uid: int) -> str:
        if len(fds) != 1:
            raise HandoverError(f"send exactly one descriptor with the token, not {len(fds)}")
        token = message.decode(errors="replace")
        if len(token) != TOKEN_CHARS or not all(c in "0123456789abcdef" for c in token):
            raise HandoverError(f"the token must be {TOKEN_CHARS} lowercase hex characters")
        check_descriptor(fds[0])
        self._expire()
        if token in self._pending:
            raise HandoverError("that token is taken; send a new one")
        refusal = self.pending_share.refusal(uid)
        if refusal:
            raise HandoverError(refusal)
        self._pending[token] = Handed(fds[0], pid, uid, time.monotonic())
        self.pending_share.take(uid)
        return token

    def _expire(self) -> None:
        stale = time.monotonic() - CLAIM_S
        for token in [t for t, h in self._pending.items() if h.at < stale]:
            handed = self._pending.pop(token)
            self.pending_share.give(handed.uid)
            log.info("closing a buffer of pid %d that was never registered", handed.pid)
            os.close(handed.fd)

    def _drop(self, fileno: int) -> None:
        entry = self._connections.pop(fileno, None)
        if entry is None:
            return
        entry.timer.cancel()
        self.connections_share.give(entry.uid)
        with contextlib.suppress(Exception):
            asyncio.get_running_loop().remove_reader(fileno)
        entry.link.close()

    def close(self) -> None:
        for fileno in list(self._connections):
            self._drop(fileno)
        for token in list(self._pending):
            handed = self._pending.pop(token)
            self.pending_share.give(handed.uid)
            os.close(handed.fd)
        if self._listener is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self._listener.fileno())
            self._listener.close()
            self._listener = None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


def _credentials(connection: socket.socket) -> tuple[int, int, int]:
    """pid, uid, gid of the process at the other end, from the kernel (SO_PEERCRED)."""
    pid, uid, gid = _CREDENTIALS.unpack(connection.getsockopt(
        socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size))
    return pid, uid, gid


def _refuse(connection: socket.socket, reason: str) -> None:
    """Answer a connection refused at accept with ``reason`` and close it. What it sent already
    is read first (its descriptors closed): closing a unix socket with unread data resets it,
    and the rank would see "Connection reset by peer" instead of the reason."""
    with contextlib.suppress(OSError):
        _message, fds, _flags, _address = socket.recv_fds(connection, MAX_MESSAGE, 2)
        for fd in fds:
            os.close(fd)
    with contextlib.suppress(OSError):
        connection.send(reason.encode()[:MAX_MESSAGE])
    connection.close()
