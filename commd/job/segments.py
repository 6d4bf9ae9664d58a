"""A rank's host buffer as the daemon sees it: the rank's sealed memfd, mapped shared.

The descriptor came over the buffer socket (``commd.daemon.handover``), never a name: the
daemon maps exactly the memory the rank gave it. The memfd is sealed against shrinking, so no
page can vanish under the mapping (no SIGBUS); the memory is freed once the rank and the daemon
have both unmapped it.
"""

from __future__ import annotations

import contextlib
import mmap
import os

import numpy as np


class SegmentError(ValueError):
    """A buffer that cannot be mapped; the message says why."""


class SharedSegment:
    def __init__(self, fd: int, needed: int) -> None:
        """Map ``fd`` (not closed here) if it holds at least ``needed`` bytes."""
        size = os.fstat(fd).st_size
        if size < needed:
            raise SegmentError(f"commd: layers need {needed} bytes but the buffer holds {size}")
        try:
            self._map = mmap.mmap(fd, size)
        except (OSError, ValueError) as exc:  # e.g. sealed against writing
            raise SegmentError(f"commd: cannot map the buffer for reading and writing: {exc}") \
                from None
        self.nbytes = size

    def array(self, dtype: np.dtype, count: int) -> np.ndarray:
        return np.frombuffer(self._map, dtype=dtype, count=count)

    def close(self) -> None:
        """Drop the mapping: the job is over (the rank's own mapping is not touched)."""
        with contextlib.suppress(BufferError):  # views still in use keep it alive
            self._map.close()
