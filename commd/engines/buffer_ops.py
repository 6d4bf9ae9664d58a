"""How the data plane touches buffers: one small interface, for host or device memory.

``Pipeline`` only calls these; it never knows where the buffers live. Host operations run
when called (on a worker thread for large buffers). Device operations are *stream-ordered*:
they only enqueue work on the job's CUDA stream and return; ``fence`` tells when it is done.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from commd.engines import host_ops
from commd.engines.completion import Completion
from commd.engines.dtypes import numpy_dtype

Buffer = Any  # numpy.ndarray on the host, cupy.ndarray on a device

# Below this many bytes a host memory op is cheaper inline than a hop to a worker thread.
INLINE_BYTES = 256 * 1024


class BufferOps(ABC):
    """What the data plane does to buffers of one kind (``HostOps``: numpy in shared memory;
    ``CudaOps``: device memory on the job's stream): the local sum, the scale and copy back, and
    the points where device work waits for the ranks and they for it."""

    kind: str = "cpu"  # "cpu" or "cuda": which engines can take these buffers
    stream_ordered: bool = False  # True: every operation only enqueues device work
    done_event: bytes = b""  # device: the IPC handle of the event the clients wait on

    @abstractmethod
    def sum_into(self, target: Buffer, sources: Sequence[Buffer], dtype: str) -> None:
        """target += every source, elementwise (the local ranks' sum)."""

    @abstractmethod
    def finish(self, source: Buffer, targets: Sequence[Buffer], factor: float,
               dtype: str) -> None:
        """source *= factor (unless 1), then copy source into every target."""

    @abstractmethod
    def zeros(self, count: int, dtype: str) -> Buffer:
        """A scratch buffer of this kind (the network probe's)."""

    def acquire(self) -> None:
        """Before a group is read: wait for what produced the local ranks' gradients (device:
        the stream waits on every rank's interprocess event). Nothing to do on the host."""
        return None

    def release(self) -> None:
        """After an iteration's last group is issued: mark the point the clients wait for
        (device: record the done event). Nothing to do on the host."""
        return None

    def fence(self) -> asyncio.Future[float | None]:
        """Completes once all work issued so far is finished."""
        future: asyncio.Future[float | None] = asyncio.get_running_loop().create_future()
        future.set_result(None)
        return future

    def launch(self, what: str, function: Callable[..., Any], *args: Any, timeout_s: float,
               on_timeout: Callable[[], None] | None = None,
               check: Callable[[], None] | None = None) -> Completion:
        """Device engines: issue ``function(*args)`` (a collective) on the stream, timed;
        ``check`` runs once it completed (NCCL's asynchronous error check)."""
        raise NotImplementedError(f"{type(self).__name__} cannot launch device collectives")

    async def prepare(self, dtype: str) -> None:
        """Get ready for ``dtype`` off the event loop (device: compile the kernels)."""
        return None

    def close(self) -> None:
        """Release what the operations hold; safe to call twice."""
        return None


class HostOps(BufferOps):
    """numpy buffers in shared memory: the arithmetic of ``host_ops``."""

    kind = "cpu"
    stream_ordered = False

    def sum_into(self, target: Buffer, sources: Sequence[Buffer], dtype: str) -> None:
        host_ops.sum_into(target, sources, dtype)

    def finish(self, source: Buffer, targets: Sequence[Buffer], factor: float,
               dtype: str) -> None:
        if factor != 1.0:
            host_ops.scale(source, factor, dtype)
        host_ops.copy_to(targets, source)

    def zeros(self, count: int, dtype: str) -> Buffer:
        return np.zeros(count, dtype=numpy_dtype(dtype))
