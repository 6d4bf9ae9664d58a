"""The rank's flat gradient buffer in POSIX shared memory, created and unlinked here."""

from __future__ import annotations

import contextlib
import re
import secrets
from multiprocessing import resource_tracker, shared_memory

_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def segment_name(job: str, rank: int) -> str:
    """A unique, recognisable name: ``commd-<job>-r<rank>-<random>``."""
    return f"commd-{_UNSAFE.sub('_', job)[:40]}-r{rank}-{secrets.token_hex(4)}"


class _SharedMemory(shared_memory.SharedMemory):
    # Group read/write so a daemon running under a shared group can attach.
    _mode = 0o660

    def __del__(self) -> None:
        # Arrays may outlive the client; the mapping then stays until they are gone.
        with contextlib.suppress(BufferError):
            super().__del__()


class GradientSegment:
    """Owns one shared-memory segment; the daemon only attaches to it."""

    def __init__(self, name: str, nbytes: int) -> None:
        # The resource tracker unlinks it if this process dies without closing: no leak.
        self._shm = _SharedMemory(name=name, create=True, size=max(nbytes, 1))
        self.name = name
        self.nbytes = nbytes

    @property
    def buf(self) -> memoryview:
        buf = self._shm.buf
        assert buf is not None
        return buf

    def close(self) -> None:
        try:
            self._shm.unlink()
        except FileNotFoundError:
            # The daemon unlinked it first (it cleans up after its jobs): only forget it here,
            # or the resource tracker reports a leak at exit.
            resource_tracker.unregister(self._shm._name, "shared_memory")  # type: ignore[attr-defined]
        # Arrays handed to the user may still view the memory; then the mapping lives on
        # until they are gone.
        with contextlib.suppress(BufferError):
            self._shm.close()
