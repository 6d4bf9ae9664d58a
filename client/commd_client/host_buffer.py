"""The rank's flat gradient buffer in host memory: a sealed memfd, handed to the daemon as a
file descriptor (commd_protocol.handover says how, and why).

Nothing appears in /dev/shm: the memory has no name, and it is freed when the last mapping
and descriptor are gone, so a rank that dies leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import re
import secrets
import socket

from commd_protocol import CommdError
from commd_protocol.handover import MAX_MESSAGE, OK, TOKEN_CHARS

_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def buffer_name(job: str, rank: int) -> str:
    """A recognisable name for /proc/PID/fd: ``commd-<job>-r<rank>``."""
    return f"commd-{_UNSAFE.sub('_', job)[:40]}-r{rank}"


class HostBuffer:
    """Owns one memfd and its mapping; the daemon maps the same pages."""

    def __init__(self, name: str, nbytes: int) -> None:
        self.nbytes = nbytes
        self._fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self._fd, max(nbytes, 1))
            fcntl.fcntl(self._fd, fcntl.F_ADD_SEALS, SEALS)  # it can no longer shrink or grow
            self._map: mmap.mmap | None = mmap.mmap(self._fd, max(nbytes, 1))
        except BaseException:
            os.close(self._fd)
            raise

    @property
    def buf(self) -> memoryview:
        assert self._map is not None
        return memoryview(self._map)

    def hand_over(self, path: str, timeout: float) -> str:
        """Send the descriptor to the daemon's buffer socket; the token to register with."""
        token = secrets.token_hex(TOKEN_CHARS // 2)
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as link:
            link.settimeout(timeout)
            try:
                link.connect(path)
                with contextlib.suppress(BrokenPipeError):  # refused at once: read why below
                    socket.send_fds(link, [token.encode()], [self._fd])
                reply = link.recv(MAX_MESSAGE)
            except OSError as exc:
                raise CommdError(f"commd: cannot hand the gradient buffer to the daemon at "
                                 f"{path}: {exc}") from None
        if reply != OK:
            reason = reply.decode(errors="replace") or "it closed the connection"
            raise CommdError(f"commd: the daemon refused the gradient buffer: {reason}")
        return token

    def close(self) -> None:
        """Drop the mapping and the descriptor (idempotent). Arrays handed to the user may
        still view the memory; the mapping then lives on until they are gone."""
        if self._map is not None:
            with contextlib.suppress(BufferError):
                self._map.close()
            self._map = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
