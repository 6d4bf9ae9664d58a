"""The buffer socket: where ranks hand over their host buffers as file descriptors.

Beside the ipc socket, an AF_UNIX SOCK_SEQPACKET socket (commd_protocol.handover). Each
connection carries one message, a token with one descriptor; the sender's pid and uid come
from the kernel (SO_PEERCRED), not from what the rank says. A descriptor that is not a sealed
memfd is refused at once. Accepted ones wait, by token, for the ``register`` that names them;
unclaimed ones are closed after CLAIM_S, and at most MAX_PENDING wait at a time.
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

from commd_protocol.handover import MAX_MESSAGE, OK, TOKEN_CHARS

log = logging.getLogger("commd.handover")

NEEDED_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW  # no SIGBUS, no surprise growth
CLAIM_S = 60.0  # a handed buffer not registered within this is closed
MAX_PENDING = 256  # handed, not yet registered
MAX_CONNECTIONS = 64  # open hand-over connections at a time
CONNECTION_S = 5.0  # a connection that sends nothing is closed after this
_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid


@dataclass
class Handed:
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
    def __init__(self, path: str) -> None:
        self.path = path
        self._listener: socket.socket | None = None
        self._pending: dict[str, Handed] = {}
        self._connections: dict[int, tuple[socket.socket, asyncio.TimerHandle]] = {}
        self.refused = 0

    def start(self) -> None:
        """Bind (0660, like the ipc socket) and serve on the running loop."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # the ipc socket's bind already found no live daemon
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.setblocking(False)
        listener.bind(self.path)
        os.chmod(self.path, 0o660)
        listener.listen(MAX_CONNECTIONS)
        self._listener = listener
        asyncio.get_running_loop().add_reader(listener.fileno(), self._accept)

    def claim(self, token: str) -> Handed | None:
        """The buffer handed over under ``token``, now the caller's to close or to give back
        (None: none)."""
        self._expire()
        return self._pending.pop(token, None)

    def give_back(self, token: str, handed: Handed) -> None:
        """A register that named ``token`` was refused: the rank may correct it and retry."""
        self._pending[token] = handed

    def _accept(self) -> None:
        assert self._listener is not None
        try:
            connection, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        if len(self._connections) >= MAX_CONNECTIONS:
            connection.close()
            return
        connection.setblocking(False)
        loop = asyncio.get_running_loop()
        fileno = connection.fileno()
        timer = loop.call_later(CONNECTION_S, self._drop, fileno)
        self._connections[fileno] = (connection, timer)
        loop.add_reader(fileno, self._receive, fileno)

    def _receive(self, fileno: int) -> None:
        connection, _ = self._connections[fileno]
        fds: list[int] = []
        try:
            message, fds, _flags, _address = socket.recv_fds(connection, MAX_MESSAGE, 2)
            pid, uid, _gid = _CREDENTIALS.unpack(connection.getsockopt(
                socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size))
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
        if len(self._pending) >= MAX_PENDING:
            raise HandoverError(f"{MAX_PENDING} buffers wait for their register already; "
                                "register before handing over more")
        self._pending[token] = Handed(fds[0], pid, uid, time.monotonic())
        return token

    def _expire(self) -> None:
        stale = time.monotonic() - CLAIM_S
        for token in [t for t, h in self._pending.items() if h.at < stale]:
            handed = self._pending.pop(token)
            log.info("closing a buffer of pid %d that was never registered", handed.pid)
            os.close(handed.fd)

    def _drop(self, fileno: int) -> None:
        entry = self._connections.pop(fileno, None)
        if entry is None:
            return
        connection, timer = entry
        timer.cancel()
        with contextlib.suppress(Exception):
            asyncio.get_running_loop().remove_reader(fileno)
        connection.close()

    def close(self) -> None:
        for fileno in list(self._connections):
            self._drop(fileno)
        for handed in self._pending.values():
            os.close(handed.fd)
        self._pending.clear()
        if self._listener is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self._listener.fileno())
            self._listener.close()
            self._listener = None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
