"""Attaching to the shared-memory gradient buffers that training processes create."""

from __future__ import annotations

import contextlib
import mmap
import os
import re

import numpy as np

_VALID_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")
SHM_DIR = "/dev/shm"


class SegmentError(ValueError):
    """A segment that cannot be attached; the message names it and says why."""


class SharedSegment:
    """A mapping of a client's POSIX segment. The daemon unlinks it on cleanup as well, so a
    client that dies leaves nothing behind in /dev/shm."""

    def __init__(self, name: str) -> None:
        if not _VALID_NAME.match(name):
            raise SegmentError(f"commd: invalid shared-memory segment name {name!r}")
        self.name = name
        path = os.path.join(SHM_DIR, name)
        # Not multiprocessing.shared_memory: its resource tracker would unlink the segment
        # when the daemon exits, and 3.11 has no track=False.
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise SegmentError(
                f"commd: cannot open shared-memory segment {name!r}: {exc.strerror}"
            ) from None
        try:
            self.nbytes = os.fstat(fd).st_size
            if self.nbytes == 0:
                raise SegmentError(f"commd: shared-memory segment {name!r} is empty")
            self._map = mmap.mmap(fd, self.nbytes)
        finally:
            os.close(fd)

    def array(self, dtype: np.dtype, count: int) -> np.ndarray:
        return np.frombuffer(self._map, dtype=dtype, count=count)

    def detach(self) -> None:
        """Drop the mapping but leave the segment to its owner (a refused register)."""
        with contextlib.suppress(BufferError):  # views still in use keep it alive
            self._map.close()

    def close(self) -> None:
        """Unlink the name and drop the mapping: the job is over."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SHM_DIR, self.name))
        self.detach()
