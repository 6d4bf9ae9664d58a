"""cupy.cuda of the fake cupy: devices, streams and events that do nothing (work is
synchronous), and memory in shared-memory segments."""

from __future__ import annotations

from typing import Any

from . import nccl, runtime
from .memory import MemoryPointer, UnownedMemory


class Device:
    def __init__(self, index: int | None = None) -> None:
        self.id = 0 if index is None else index
        self.pci_bus_id = f"0000:{self.id:02x}:00.0"

    def __enter__(self) -> Device:
        return self

    def __exit__(self, *args: Any) -> None:
        pass

    def use(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


class Event:
    def __init__(self, block: bool = False, disable_timing: bool = False,
                 interprocess: bool = False) -> None:
        self.ptr = runtime.eventCreateWithFlags(0)

    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    @property
    def done(self) -> bool:
        return True


class Stream:
    def __init__(self, null: bool = False, non_blocking: bool = False) -> None:
        self.ptr = 0 if null else runtime.streamCreate()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *args: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record(self, event: Event | None = None) -> Event:
        return event or Event()

    def wait_event(self, event: Event) -> None:
        pass


_NULL = Stream(null=True)


def get_current_stream() -> Stream:
    return _NULL


__all__ = ["Device", "Event", "MemoryPointer", "Stream", "UnownedMemory", "get_current_stream",
           "nccl", "runtime"]
