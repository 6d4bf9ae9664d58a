"""Attaching to the device gradient buffers that training processes share through CUDA IPC.

A rank sends, once at registration, the IPC handle of the allocation that holds its flat
buffer, the buffer's byte offset inside that allocation (``cudaIpcGetMemHandle`` names the
whole allocation: ``ipcOpenMemHandle`` maps its base), and the handle of its interprocess
event. The daemon maps both here and releases them at the job's cleanup, after its stream has
drained. Every call goes through ``engines.cuda_calls``.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
from dataclasses import dataclass
from typing import Any

from commd.engines.cuda.calls import call
from commd.engines.dtypes import numpy_dtype
from commd_protocol import IPC_HANDLE_BYTES

log = logging.getLogger("commd.memory")


class DeviceMemoryError(ValueError):
    """A device buffer that cannot be attached; the message says why."""


@dataclass
class RankMemory:
    """One rank's device buffer as the daemon mapped it: the allocation's base (unmapped at the
    job's cleanup), the flat buffer as a cupy array, and the rank's interprocess event."""

    base: int  # what ipcOpenMemHandle returned: the mapped allocation's base
    array: Any  # cupy array: the flat buffer
    event: int  # the rank's interprocess event, opened here


def check_handles(ipc_handle: bytes, event_handle: bytes, offset: int) -> str:
    """'' when the registration's handles are well-formed, else what is wrong."""
    if len(ipc_handle) != IPC_HANDLE_BYTES:
        return f"ipc_handle must be {IPC_HANDLE_BYTES} bytes (cudaIpcMemHandle_t), got " \
               f"{len(ipc_handle)}"
    if len(event_handle) != IPC_HANDLE_BYTES:
        return f"event_handle must be {IPC_HANDLE_BYTES} bytes (cudaIpcEventHandle_t), got " \
               f"{len(event_handle)}"
    if offset < 0:
        return f"ipc_offset must be >= 0, got {offset}"
    return ""


def open_rank_memory(cupy: Any, device_index: int, ipc_handle: bytes, offset: int, count: int,
                     dtype: str, event_handle: bytes) -> RankMemory:
    """Map a rank's buffer and event on ``device_index`` (the caller made it current)."""
    runtime = cupy.cuda.runtime
    element = numpy_dtype(dtype)
    nbytes = count * element.itemsize
    base = call("cudaIpcOpenMemHandle", runtime.ipcOpenMemHandle, ipc_handle)
    try:
        size = allocation_size(base)
        if size is not None and offset + nbytes > size:
            raise DeviceMemoryError(
                f"commd: the layers need {nbytes} bytes at offset {offset} but the shared "
                f"allocation holds {size}"
            )
        event = call("cudaIpcOpenEventHandle", runtime.ipcOpenEventHandle, event_handle)
    except BaseException:
        with contextlib.suppress(Exception):
            runtime.ipcCloseMemHandle(base)
        raise
    memory = cupy.cuda.UnownedMemory(base + offset, max(nbytes, 1), _OWNER, device_index)
    array = cupy.ndarray((count,), element, cupy.cuda.MemoryPointer(memory, 0))
    return RankMemory(base, array, event)


def close_rank_memory(cupy: Any, memory: RankMemory) -> None:
    """Unmap the buffer and destroy the opened event; the caller drained the stream first."""
    runtime = cupy.cuda.runtime
    memory.array = None
    for what, function, argument in (("cudaIpcCloseMemHandle", runtime.ipcCloseMemHandle,
                                      memory.base),
                                     ("cudaEventDestroy", runtime.eventDestroy, memory.event)):
        try:
            call(what, function, argument)
        except Exception as exc:
            log.warning("%s", exc)


class _Owner:
    """UnownedMemory wants an owner object; the mapping is released by close_rank_memory."""


_OWNER = _Owner()


def allocation_size(pointer: int) -> int | None:
    """Bytes of the allocation that ``pointer`` starts, by ``cuMemGetAddressRange``; None
    when the driver cannot say (then the size is taken on trust)."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
        function = driver.cuMemGetAddressRange_v2
    except (OSError, AttributeError):
        return None
    base, size = ctypes.c_uint64(0), ctypes.c_size_t(0)
    status = function(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(pointer))
    if status != 0:
        log.debug("cuMemGetAddressRange failed with CUresult %d", status)
        return None
    if base.value != pointer:
        log.debug("the mapping starts at %#x, not at %#x", base.value, pointer)
        return None
    return int(size.value)
