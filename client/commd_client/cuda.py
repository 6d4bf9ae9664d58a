"""A rank's flat gradient buffer in device memory, shared with the daemon through CUDA IPC.

The buffer is one ``cudaMalloc`` allocation of its own (``cupy.cuda.runtime.malloc``, not
cupy's memory pool): ``cudaIpcGetMemHandle`` names a whole allocation, so the flat buffer
starts at offset 0 of what the handle maps. Gradients are cupy views of it.

One interprocess event (flags ``cudaEventInterprocess | cudaEventDisableTiming`` = 6) is
recorded before every ready notification on the stream that produced those gradients; the
daemon's stream waits on it. When ready() names a different stream than the last record,
that stream first waits on the event, so every record also covers the ones before it (the
daemon may wait on the latest record only; see ``commd.engines.cuda_ops``). ``wait()`` makes
the caller's stream wait on the daemon's done event: the CPU never blocks on the GPU.

cupy is imported here only, and only when a device buffer is registered.
"""

from __future__ import annotations

import contextlib
from typing import Any

from commd_protocol import INTERPROCESS_EVENT_FLAGS, CommdError

from .dtypes import numpy_dtype


def import_cupy() -> Any:
    try:
        import cupy
    except ImportError as exc:
        raise CommdError(
            f"commd: device buffers need cupy ({exc}); pip install cupy-cuda12x "
            "(or cupy-cuda13x for CUDA 13)"
        ) from None
    return cupy


def parse_device(device: str) -> int | None:
    """"cuda" → None (the current device), "cuda:N" → N; CommdError otherwise."""
    if device == "cuda":
        return None
    name, _, index = device.partition(":")
    if name == "cuda" and index.isdigit():
        return int(index)
    raise CommdError(f"commd: device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")


def stream_pointer(cupy: Any, stream: Any) -> int:
    """The raw cudaStream_t of ``stream``: None (cupy's current stream), an int, a cupy
    stream (``.ptr``) or a torch stream (``.cuda_stream``)."""
    if stream is None:
        return int(cupy.cuda.get_current_stream().ptr)
    if isinstance(stream, int):
        return stream
    for attribute in ("ptr", "cuda_stream"):
        value = getattr(stream, attribute, None)
        if isinstance(value, int):
            return value
    raise CommdError(
        f"commd: stream must be a cupy or torch CUDA stream or a raw pointer, not "
        f"{type(stream).__name__}"
    )


class DeviceBuffer:
    """Owns the allocation and the rank's event; the daemon maps both."""

    def __init__(self, count: int, dtype: str, device: int | None, cupy: Any = None) -> None:
        self._cupy = cupy if cupy is not None else import_cupy()
        runtime = self._cupy.cuda.runtime
        self.device_index = int(runtime.getDevice()) if device is None else device
        element = numpy_dtype(dtype)
        self.nbytes = count * element.itemsize
        self._pointer = 0
        self._event = 0
        self._done = 0
        self._last_stream: int | None = None
        try:
            with self._cupy.cuda.Device(self.device_index):
                self._pointer = int(runtime.malloc(max(self.nbytes, 1)))
                runtime.memset(self._pointer, 0, max(self.nbytes, 1))
                runtime.deviceSynchronize()
                memory = self._cupy.cuda.UnownedMemory(self._pointer, max(self.nbytes, 1),
                                                       self, self.device_index)
                self.flat = self._cupy.ndarray((count,), element,
                                               self._cupy.cuda.MemoryPointer(memory, 0))
                self.ipc_handle = bytes(runtime.ipcGetMemHandle(self._pointer))
                self._event = int(runtime.eventCreateWithFlags(INTERPROCESS_EVENT_FLAGS))
                self.event_handle = bytes(runtime.ipcGetEventHandle(self._event))
                self.bus_id = str(self._cupy.cuda.Device(self.device_index).pci_bus_id)
        except CommdError:
            self.close()
            raise
        except Exception as exc:
            self.close()
            raise CommdError(f"commd: cannot set up the device buffer on GPU "
                             f"{self.device_index}: {exc}") from exc
        self.ipc_offset = 0  # the flat buffer is the allocation's start

    def registration_fields(self) -> dict[str, Any]:
        """The fields of ``register`` that tell the daemon where this buffer is."""
        return {"device": "cuda", "device_bus_id": self.bus_id,
                "device_index": self.device_index, "ipc_handle": self.ipc_handle,
                "ipc_offset": self.ipc_offset, "event_handle": self.event_handle}

    def open_done(self, handle: bytes) -> None:
        """Open the daemon's done event (from ``registered``)."""
        self._done = int(self._cupy.cuda.runtime.ipcOpenEventHandle(handle))

    def record(self, stream: Any) -> None:
        """Before a ready notification: record the event on the producing stream."""
        runtime = self._cupy.cuda.runtime
        pointer = stream_pointer(self._cupy, stream)
        if self._last_stream is not None and pointer != self._last_stream:
            runtime.streamWaitEvent(pointer, self._event, 0)  # keep the records cumulative
        runtime.eventRecord(self._event, pointer)
        self._last_stream = pointer

    def wait_done(self, stream: Any) -> None:
        """After ``done``: the stream waits for the daemon's last writes (the CPU does not)."""
        if not self._done:
            raise CommdError("commd: the daemon sent no done event for this device buffer")
        self._cupy.cuda.runtime.streamWaitEvent(stream_pointer(self._cupy, stream), self._done, 0)

    def close(self) -> None:
        """Wait for this device's work, then free the allocation and the events (idempotent).
        Views handed out are invalid afterwards."""
        runtime = self._cupy.cuda.runtime
        with contextlib.suppress(Exception), self._cupy.cuda.Device(self.device_index):
            if self._pointer or self._event:
                runtime.deviceSynchronize()
        for release, handle in ((runtime.free, self._pointer),
                                (runtime.eventDestroy, self._event),
                                (runtime.eventDestroy, self._done)):
            if handle:
                with contextlib.suppress(Exception):
                    release(handle)
        self._pointer = self._event = self._done = 0
        self.flat = None
