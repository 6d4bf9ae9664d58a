"""cupy.cuda.runtime of the fake cupy: the calls commd makes, synchronous or no-ops."""

from __future__ import annotations

import itertools
import os
from typing import Any

from . import memory

cudaIpcMemLazyEnablePeerAccess = 1
_handles = itertools.count(1)


def getDeviceCount() -> int:
    return 1


def getDevice() -> int:
    return 0


def setDevice(index: int) -> None:
    pass


def deviceGetByPCIBusId(bus_id: str) -> int:
    return int(bus_id.split(":")[1], 16)


def deviceSynchronize() -> None:
    pass


def runtimeGetVersion() -> int:
    return 12090


def streamCreate() -> int:
    return next(_handles)


def malloc(size: int) -> int:
    return memory.allocate(size)


def free(pointer: int) -> None:
    memory.release(pointer)


def memset(pointer: int, value: int, size: int) -> None:
    mapping, offset = memory.locate(pointer)
    mapping.map[offset : offset + size] = bytes([value]) * size


def ipcGetMemHandle(pointer: int) -> bytes:
    return memory.handle_of(pointer)


def ipcOpenMemHandle(handle: bytes, flags: int = 1) -> int:
    return memory.open_handle(handle)


def ipcCloseMemHandle(pointer: int) -> None:
    memory.release(pointer)


def eventCreateWithFlags(flags: int) -> int:
    return next(_handles)


def ipcGetEventHandle(event: int) -> bytes:
    return f"event-{os.getpid()}-{event}".encode().ljust(64, b"\0")


def ipcOpenEventHandle(handle: bytes) -> int:
    return next(_handles)


def eventRecord(event: int, stream: int) -> None:
    pass


def streamWaitEvent(stream: int, event: int, flags: int = 0) -> None:
    pass


def eventSynchronize(event: int) -> None:
    pass


def eventElapsedTime(start: int, end: int) -> float:
    return 0.01


def eventDestroy(event: int) -> None:
    pass


def __getattr__(name: str) -> Any:
    raise AttributeError(f"the fake cupy has no runtime.{name}")
