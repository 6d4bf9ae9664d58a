"""The client's device buffer with a fake cupy: what it allocates, which events it records on
which streams, and how it cleans up. No GPU and no cupy needed."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from commd_client import CommdError
from commd_client.cuda import DeviceBuffer, parse_device, stream_pointer


class FakeRuntime:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.device = 0

    def __getattr__(self, name: str) -> Any:
        results = {"malloc": 0x1000, "ipcGetMemHandle": b"m" * 64, "eventCreateWithFlags": 77,
                   "ipcGetEventHandle": b"e" * 64, "ipcOpenEventHandle": 88, "getDevice": 0}

        def record(*args: Any) -> Any:
            self.calls.append((name, *args))
            return results.get(name)

        return record


class FakeDevice:
    def __init__(self, index: int) -> None:
        self.index = index
        self.pci_bus_id = f"0000:0{index}:00.0"

    def __enter__(self) -> FakeDevice:
        return self

    def __exit__(self, *args: Any) -> None:
        pass


def fake_cupy() -> Any:
    runtime = FakeRuntime()
    stream = SimpleNamespace(ptr=5)
    cuda = SimpleNamespace(
        runtime=runtime, Device=FakeDevice, get_current_stream=lambda: stream,
        UnownedMemory=lambda ptr, size, owner, device: ("memory", ptr, size, device),
        MemoryPointer=lambda memory, offset: ("pointer", memory, offset),
    )
    return SimpleNamespace(cuda=cuda, ndarray=lambda shape, dtype, pointer: np.zeros(shape,
                                                                                      dtype))


def names(runtime: FakeRuntime) -> list[str]:
    return [call[0] for call in runtime.calls]


def test_allocation_handles_and_events() -> None:
    cupy = fake_cupy()
    buffer = DeviceBuffer(10, "bfloat16", 3, cupy=cupy)
    runtime = cupy.cuda.runtime
    assert ("malloc", 20) in runtime.calls and ("memset", 0x1000, 0, 20) in runtime.calls
    assert ("eventCreateWithFlags", 6) in runtime.calls  # interprocess | disable timing
    assert buffer.ipc_handle == b"m" * 64 and buffer.event_handle == b"e" * 64
    assert buffer.ipc_offset == 0 and buffer.bus_id == "0000:03:00.0"
    assert buffer.flat.dtype == np.uint16 and buffer.flat.size == 10
    runtime.calls.clear()
    buffer.record(None)  # cupy's current stream (5)
    buffer.record(5)
    buffer.record(SimpleNamespace(cuda_stream=9))  # a torch stream: first waits on the event
    assert runtime.calls == [("eventRecord", 77, 5), ("eventRecord", 77, 5),
                             ("streamWaitEvent", 9, 77, 0), ("eventRecord", 77, 9)]
    with pytest.raises(CommdError, match="no done event"):
        buffer.wait_done(None)
    buffer.open_done(b"d" * 64)
    runtime.calls.clear()
    buffer.wait_done(SimpleNamespace(ptr=11))
    assert runtime.calls == [("streamWaitEvent", 11, 88, 0)]
    runtime.calls.clear()
    buffer.close()
    assert names(runtime) == ["deviceSynchronize", "free", "eventDestroy", "eventDestroy"]
    buffer.close()  # idempotent
    assert names(runtime).count("free") == 1


def test_a_failed_set_up_releases_what_it_took() -> None:
    cupy = fake_cupy()

    def refuse(pointer: int) -> bytes:
        raise RuntimeError("cudaErrorMapBufferObjectFailed: mapping of buffer object failed")

    runtime = cupy.cuda.runtime
    runtime.__dict__["ipcGetMemHandle"] = refuse
    with pytest.raises(CommdError, match="cannot set up the device buffer on GPU 0: "
                                         "cudaErrorMapBufferObjectFailed"):
        DeviceBuffer(4, "float32", None, cupy=cupy)
    assert "free" in names(runtime)


def test_device_names_and_streams() -> None:
    assert parse_device("cuda") is None and parse_device("cuda:3") == 3
    for bad in ("gpu", "cuda:", "cuda:x", "cuda:-1"):
        with pytest.raises(CommdError, match="device must be 'cpu', 'cuda' or 'cuda:N'"):
            parse_device(bad)
    cupy = fake_cupy()
    assert stream_pointer(cupy, None) == 5 and stream_pointer(cupy, 42) == 42
    assert stream_pointer(cupy, SimpleNamespace(ptr=7)) == 7
    with pytest.raises(CommdError, match="stream must be a cupy or torch CUDA stream"):
        stream_pointer(cupy, "default")
