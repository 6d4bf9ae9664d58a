"""Buffer operations on one GPU: the local ranks' buffers and events, the job's stream.

Everything is stream-ordered: the daemon enqueues and returns. Per group, ``acquire`` makes
the stream wait on every local rank's interprocess event (recorded by the client before its
ready notification); then the local sum, the collective and the fused scale-and-copy-back go
on the stream; after the iteration's last group, ``release`` records the done event whose
handle the clients got in ``registered``.

Why one event per rank is enough: ``cudaStreamWaitEvent`` waits for the event's most recent
record *at the time of the call*. A client records before every ready(), and makes each
record follow the previous one (a new stream first waits on the event), so the latest record
covers every layer it has marked. ``acquire`` runs after every rank's last ready of the
group arrived, so it waits at least for that layer — at most also for layers marked in the
few microseconds since, never for less. A record of the next iteration cannot come earlier:
a client marks again only after ``wait()``, i.e. after the daemon has issued every group.
The done event is likewise recorded again only after every rank has marked the next
iteration, i.e. after each one's ``wait()`` made its stream wait on the previous record.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

from commd.engines.buffer_ops import Buffer, BufferOps
from commd.engines.completion import Completion
from commd.engines.cuda import kernels as cuda_kernels
from commd.engines.cuda import memory as memory_cuda
from commd.engines.cuda.calls import call, checked, import_cupy, run_blocking
from commd.engines.cuda.watch import StreamWatcher
from commd.engines.dtypes import numpy_dtype
from commd_protocol import INTERPROCESS_EVENT_FLAGS

log = logging.getLogger("commd.engine.cuda")



class CudaOps(BufferOps):
    """The ``BufferOps`` of one GPU (the module's docstring): the local ranks' mapped buffers and
    events, the job's stream, the done event whose handle the clients get, and the thread that
    watches the stream."""

    kind = "cuda"
    stream_ordered = True

    def __init__(self, bus_id: str, timeout_s: float) -> None:
        cupy = import_cupy()
        runtime = cupy.cuda.runtime
        self._cupy = cupy
        self.timeout_s = timeout_s
        self.bus_id = bus_id
        self.device_index: int = call("cudaDeviceGetByPCIBusId", runtime.deviceGetByPCIBusId,
                                      bus_id)
        self.device = cupy.cuda.Device(self.device_index)
        self._ranks: dict[int, memory_cuda.RankMemory] = {}
        self._closed = False
        with self.device:
            self.stream = call("cudaStreamCreateWithFlags", cupy.cuda.Stream, False, True)
            self.stream_ptr: int = self.stream.ptr
            self._done: int = call("cudaEventCreateWithFlags", runtime.eventCreateWithFlags,
                                   INTERPROCESS_EVENT_FLAGS)
            self.done_event = call("cudaIpcGetEventHandle", runtime.ipcGetEventHandle,
                                   self._done)
        self._watcher = StreamWatcher(
            asyncio.get_running_loop(), synchronize=runtime.eventSynchronize,
            elapsed_ms=runtime.eventElapsedTime,
            bind_thread=lambda: runtime.setDevice(self.device_index),
            name=f"commd-cuda{self.device_index}",
        )

    # --- the ranks' buffers ----------------------------------------------------------------------

    def attach(self, local_index: int, ipc_handle: bytes, offset: int, count: int, dtype: str,
               event_handle: bytes) -> Buffer:
        """Map a local rank's flat buffer and its event; returns the buffer (a cupy array)."""
        if local_index in self._ranks:
            raise memory_cuda.DeviceMemoryError(f"commd: local rank {local_index} is attached")
        with self.device:
            memory = memory_cuda.open_rank_memory(self._cupy, self.device_index, ipc_handle,
                                                  offset, count, dtype, event_handle)
        self._ranks[local_index] = memory
        return memory.array

    def detach(self, local_index: int) -> None:
        """Unmap one rank's buffer at once (a refused registration: nothing was issued)."""
        memory = self._ranks.pop(local_index, None)
        if memory is not None:
            with self.device:
                memory_cuda.close_rank_memory(self._cupy, memory)

    # --- the data plane --------------------------------------------------------------------------

    def acquire(self) -> None:
        runtime = self._cupy.cuda.runtime
        with self.device:
            for memory in self._ranks.values():
                call("cudaStreamWaitEvent", runtime.streamWaitEvent, self.stream_ptr,
                     memory.event, 0)

    def release(self) -> None:
        with self.device:
            call("cudaEventRecord", self._cupy.cuda.runtime.eventRecord, self._done,
                 self.stream_ptr)

    def sum_into(self, target: Buffer, sources: Sequence[Buffer], dtype: str) -> None:
        with self.device, self.stream, checked("the local ranks' sum on the device"):
            cuda_kernels.sum_into(self._cupy, target, sources, dtype)

    def finish(self, source: Buffer, targets: Sequence[Buffer], factor: float,
               dtype: str) -> None:
        with self.device, self.stream, checked("the copy back to the local ranks"):
            cuda_kernels.finish(self._cupy, source, targets, factor, dtype)

    def zeros(self, count: int, dtype: str) -> Buffer:
        with self.device, self.stream, checked("a scratch buffer on the device"):
            return self._cupy.zeros(count, dtype=numpy_dtype(dtype))

    def fence(self) -> asyncio.Future[float | None]:
        with self.device:
            event = call("cudaEventCreate", self._cupy.cuda.Event, True, True)
            call("cudaEventRecord", event.record, self.stream)
        return self._watcher.watch("the job's device work", event, timeout_s=self.timeout_s)

    def launch(self, what: str, function: Callable[..., Any], *args: Any, timeout_s: float,
               on_timeout: Callable[[], None] | None = None,
               check: Callable[[], None] | None = None) -> Completion:
        """Issue ``function(*args)`` between two timing events; the future resolves to the
        device seconds between them once the second completes."""
        event = self._cupy.cuda.Event
        with self.device:
            start = call("cudaEventCreate", event, False, False)
            end = call("cudaEventCreate", event, True, False)
            call("cudaEventRecord", start.record, self.stream)
            call(what, function, *args)
            call("cudaEventRecord", end.record, self.stream)
        return self._watcher.watch(what, end, start=start, timeout_s=timeout_s,
                                   on_timeout=on_timeout, check=check)

    async def prepare(self, dtype: str) -> None:
        def compile_kernels() -> None:
            with self.device, self.stream:
                cuda_kernels.compile_all(self._cupy, dtype)
            self.stream.synchronize()

        await run_blocking("compiling the device kernels", compile_kernels, self.timeout_s)

    # --- cleanup ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Unmap everything once the stream has drained, on the watcher's thread (a stream
        that never drains holds that thread only)."""
        if self._closed:
            return
        self._closed = True
        ranks, self._ranks = list(self._ranks.values()), {}

        def release_all() -> None:
            with contextlib.suppress(Exception):
                call("draining the job's stream", self.stream.synchronize)
            for memory in ranks:
                memory_cuda.close_rank_memory(self._cupy, memory)
            try:
                call("cudaEventDestroy", self._cupy.cuda.runtime.eventDestroy, self._done)
            except Exception as exc:
                log.warning("%s", exc)

        self._watcher.after(release_all)
        self._watcher.stop()
