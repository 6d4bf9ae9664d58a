"""A rank's host buffer as the daemon sees it: the rank's sealed memfd, mapped shared.

The descriptor came over the buffer socket (``commd.daemon.handover``), never a name: the
daemon maps exactly the memory the rank gave it. The memfd is sealed against shrinking, so no
page can vanish under the mapping (no SIGBUS); the memory is freed once the rank and the daemon
have both unmapped it.

Memory follows use. A memfd may be sparse and of any size, so its size is checked against the
layout: at most one page more than the layers need (the real client makes it exactly their
size), and only the bytes the layers need are mapped. When the job is over the mapping is
dropped at once, even while views of it are still referenced (see ``SharedSegment.close``).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os

import numpy as np

log = logging.getLogger("commd.jobs")

PAGE = mmap.PAGESIZE
SLACK = PAGE  # a memfd may exceed the layout by this much (a page-rounded allocation)

_MAP_FIXED = 0x10  # <sys/mman.h> (not in Python's mmap module); the same on x86 and arm64
_MAP_NORESERVE = 0x4000  # likewise: the stand-in reserves no memory it does not use
_MAP_FAILED = ctypes.c_void_p(-1).value
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]


class SegmentError(ValueError):
    """A buffer that cannot be mapped; the message says why."""


def size_problem(size: int, needed: int) -> str:
    """'' when a memfd of ``size`` bytes may hold layers of ``needed`` bytes, else why not."""
    if needed <= size <= needed + SLACK:
        return ""
    return (f"commd: the buffer holds {size} bytes but the layers need {needed} bytes; hand "
            f"over a memfd of exactly {needed} bytes (at most {SLACK} more)")


class SharedSegment:
    """One rank's host buffer, mapped from the memfd it handed over: the mapping, checked against
    the layout, and ``close``, which drops it once the job is over or the rank left."""

    def __init__(self, fd: int, needed: int) -> None:
        """Map the first ``needed`` bytes of ``fd`` (not closed here); SegmentError unless
        the memfd holds between ``needed`` and ``needed`` + one page."""
        problem = size_problem(os.fstat(fd).st_size, needed)
        if problem:
            raise SegmentError(problem)
        length = max(needed, 1)  # mmap refuses 0 bytes; the client's memfd has at least 1
        try:
            self._map: mmap.mmap | None = mmap.mmap(fd, length)
        except (OSError, ValueError) as exc:  # e.g. sealed against writing
            raise SegmentError(f"commd: cannot map the buffer for reading and writing: {exc}") \
                from None
        # The mapping's address, for close: a ctypes view taken and released at once.
        self._address = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self.nbytes = length

    @property
    def mapped(self) -> bool:
        """Whether the rank's memfd is still mapped here."""
        return self._map is not None

    def array(self, dtype: np.dtype, count: int) -> np.ndarray:
        assert self._map is not None, "the segment is closed"
        return np.frombuffer(self._map, dtype=dtype, count=count)

    def close(self) -> None:
        """Drop the rank's memory now (idempotent): the job is over or the rank left.

        With no view of the mapping left, it is simply unmapped. Views may live on, though:
        arrays in reference cycles until the garbage collector's next pass, or a collective
        stuck on a dead peer, whose thread may still write. Unmapping under them could crash
        the daemon. So the range is replaced in place with fresh anonymous memory: one
        mmap(MAP_FIXED) swaps the pages atomically (the kernel holds the address space's lock,
        so no thread can fault in between and find nothing mapped). The memfd's pages are
        released at once; stray views read zeros and their writes land in private memory that
        reaches no rank. The Python mapping still owns the range and unmaps it when the last
        view goes."""
        if self._map is None:
            return
        mapping, self._map = self._map, None
        try:
            mapping.close()
            return
        except BufferError:  # views still use it
            pass
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        flags = _MAP_FIXED | mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
        address = _libc.mmap(self._address, self.nbytes, prot, flags, -1, 0)
        # One whole mapping replaced by one that reserves nothing: it adds no mapping and
        # commits no memory, so only a node out of commit under vm.overcommit_memory=2 can
        # refuse it, which is logged.
        if address in (None, _MAP_FAILED):
            log.warning("cannot release a buffer of %d bytes while views of it remain: %s",
                        self.nbytes, os.strerror(ctypes.get_errno()))
