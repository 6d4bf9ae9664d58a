"""The NCCL engine's CPU side, everywhere (with cupy installed or not): tables, the unique id,
the checked chokepoint, fail-fast set-up, argument checks and availability messages.
What needs cupy's import skips without it; nothing here needs a GPU."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest

from commd import engines
from commd.engines import EngineConfig, EngineError, choose_backend, engine_for_buffers, nccl_tables
from commd.engines.buffer_ops import HostOps
from commd.engines.cuda import calls as cuda_calls
from commd.engines.cuda.watch import StreamWatcher
from commd.engines.nccl import NcclEngine, device_pointer, exchange_unique_id

from gpu_jobs import gpu_present

try:
    import cupy
    from cupy.cuda import nccl as cupy_nccl

    HAVE_CUPY = True
except ImportError:
    HAVE_CUPY = False

needs_cupy = pytest.mark.skipif(not HAVE_CUPY, reason="cupy is not installed")


@pytest.fixture(autouse=True)
def fresh_availability() -> Any:
    engines._availability.cache_clear()
    yield
    engines._availability.cache_clear()


# --- tables ----------------------------------------------------------------------------------


def test_dtype_and_op_tables() -> None:
    assert nccl_tables.nccl_dtype("float32") == 7
    assert nccl_tables.nccl_dtype("bfloat16") == 9
    assert nccl_tables.nccl_op("sum") == 0 and nccl_tables.nccl_op("avg") == 4
    with pytest.raises(ValueError, match="no dtype 'int8'; valid: float32, float64"):
        nccl_tables.nccl_dtype("int8")
    with pytest.raises(ValueError, match="no op 'max'; valid: sum, avg"):
        nccl_tables.nccl_op("max")


@needs_cupy
def test_tables_match_cupys_constants() -> None:
    names = {"float32": "NCCL_FLOAT32", "float64": "NCCL_FLOAT64", "float16": "NCCL_FLOAT16",
             "bfloat16": "NCCL_BFLOAT16", "int32": "NCCL_INT32"}
    for dtype, name in names.items():
        assert nccl_tables.NCCL_DTYPES[dtype] == getattr(cupy_nccl, name), dtype
    assert nccl_tables.NCCL_OPS == {"sum": cupy_nccl.NCCL_SUM, "avg": cupy_nccl.NCCL_AVG}


def test_every_gradient_dtype_has_an_nccl_type() -> None:
    from commd_protocol import DTYPES

    assert set(DTYPES) <= set(nccl_tables.NCCL_DTYPES)


# --- the unique id ---------------------------------------------------------------------------


def test_unique_id_from_signed_ints_and_back() -> None:
    signed = tuple(range(-64, 64))
    raw = nccl_tables.encode_unique_id(signed)
    assert len(raw) == 128 and raw[0] == 256 - 64 and raw[64] == 0
    assert nccl_tables.decode_unique_id(raw, as_bytes=False) == signed
    assert nccl_tables.decode_unique_id(raw, as_bytes=True) == raw
    assert nccl_tables.encode_unique_id(raw) == raw


def test_unique_id_length_and_range_checks() -> None:
    with pytest.raises(ValueError, match="128 bytes, got 3"):
        nccl_tables.encode_unique_id(b"abc")
    with pytest.raises(ValueError, match="bytes"):
        nccl_tables.encode_unique_id([300] * 128)
    with pytest.raises(ValueError, match="128 bytes, got 127"):
        nccl_tables.decode_unique_id(bytes(127), as_bytes=True)


def test_cupy_version_decides_the_id_type() -> None:
    assert nccl_tables.cupy_takes_bytes("14.2.0")
    assert not nccl_tables.cupy_takes_bytes("13.6.0")
    assert nccl_tables.unique_id_key("job/3") == "job/3/nccl_id"


@needs_cupy
def test_real_unique_id_encodes_without_a_gpu() -> None:
    if not cupy_nccl.available:
        pytest.skip("cupy has no NCCL library")
    raw = NcclEngine.new_unique_id()
    assert isinstance(raw, bytes) and len(raw) == 128
    again = nccl_tables.decode_unique_id(raw, nccl_tables.cupy_takes_bytes(cupy.__version__))
    assert nccl_tables.encode_unique_id(again) == raw


def test_unique_id_travels_through_the_rendezvous_store() -> None:
    dist = pytest.importorskip("torch.distributed")
    server = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    made = bytes(range(128))
    results: dict[int, bytes] = {}

    def node(rank: int) -> None:
        config = EngineConfig(key="job/1", rank=rank, size=2, store_host="127.0.0.1",
                              store_port=server.port, host="127.0.0.1", timeout_s=10)
        results[rank] = exchange_unique_id(config, lambda: made)

    threads = [threading.Thread(target=node, args=(rank,)) for rank in (1, 0)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert results == {0: made, 1: made}


def test_a_single_node_needs_no_store() -> None:
    config = EngineConfig(key="j/1", rank=0, size=1, store_host="", store_port=0, host="",
                          timeout_s=1)
    assert exchange_unique_id(config, lambda: b"x" * 128) == b"x" * 128


# --- availability and choice -----------------------------------------------------------------


def test_nccl_unavailable_without_cupy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)
    usable, reason = NcclEngine.availability()
    assert not usable and reason == "cupy is not installed (pip install 'commd[nccl]')"


@needs_cupy
def test_nccl_unavailable_without_a_gpu() -> None:
    if gpu_present():
        pytest.skip("a GPU is present")
    usable, reason = NcclEngine.availability()
    assert not usable
    assert reason.startswith(("no usable GPU (", "cupy has no NCCL")), reason


def test_explicit_nccl_without_a_gpu_is_one_clear_line() -> None:
    if gpu_present():
        pytest.skip("a GPU is present")
    with pytest.raises(EngineError, match=r"^commd: --backend nccl cannot run here: "):
        choose_backend("nccl")


def test_auto_says_what_it_chose(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(NcclEngine, "availability", classmethod(lambda cls: (False, "no GPU")))
    name, why = choose_backend("auto")
    assert name == "gloo" and why == "auto: nccl disabled because no GPU; chose gloo"
    engines._availability.cache_clear()
    monkeypatch.setattr(NcclEngine, "availability",
                        classmethod(lambda cls: (True, "NCCL 2.21.5, 1 GPU(s)")))
    assert choose_backend("auto") == ("nccl", "auto: chose nccl (NCCL 2.21.5, 1 GPU(s))")


def test_engine_for_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    assert engine_for_buffers("cpu", "auto", "gloo") == "gloo"
    assert engine_for_buffers("cuda", "nccl", "nccl") == "nccl"
    # a host-memory job on a GPU node goes through Gloo when the daemon runs auto
    assert engine_for_buffers("cpu", "auto", "nccl") == "gloo"
    with pytest.raises(ValueError, match="runs the nccl engine, which cannot reduce cpu "
                                         "buffers across nodes; run the daemons with "
                                         "--backend gloo"):
        engine_for_buffers("cpu", "nccl", "nccl")
    monkeypatch.setattr(NcclEngine, "availability", classmethod(lambda cls: (False, "no GPU")))
    with pytest.raises(ValueError, match=r"cannot reduce cuda buffers.*--backend nccl"):
        engine_for_buffers("cuda", "auto", "gloo")


# --- the chokepoint --------------------------------------------------------------------------


class NcclError(RuntimeError):
    """Named like cupy's: its message is the library's own."""


def test_call_turns_a_library_failure_into_engine_error() -> None:
    def fails() -> None:
        raise NcclError("NCCL_ERROR_INVALID_USAGE: invalid usage (run with NCCL_DEBUG=WARN)")

    with pytest.raises(EngineError) as caught:
        cuda_calls.call("ncclAllReduce", fails)
    assert str(caught.value) == ("commd: ncclAllReduce failed: NCCL_ERROR_INVALID_USAGE: "
                                 "invalid usage (run with NCCL_DEBUG=WARN)")
    assert isinstance(caught.value.__cause__, NcclError)
    with pytest.raises(EngineError, match=r"^commd: x failed: OSError: gone$"):
        cuda_calls.call("x", _raise, OSError("gone"))
    assert cuda_calls.call("add", lambda a, b: a + b, 2, 3) == 5


def test_programming_errors_pass_through() -> None:
    with pytest.raises(TypeError):
        cuda_calls.call("x", _raise, TypeError("bad argument"))
    with pytest.raises(EngineError, match="already typed"):
        cuda_calls.call("x", _raise, EngineError("already typed"))


def test_checked_block() -> None:
    with pytest.raises(EngineError, match=r"^commd: the local sum failed: ValueError: shape$"), \
            cuda_calls.checked("the local sum"):
        raise ValueError("shape")


@needs_cupy
def test_a_real_cuda_error_keeps_the_librarys_words() -> None:
    if gpu_present():
        pytest.skip("a GPU is present")
    with pytest.raises(EngineError, match=r"^commd: cudaGetDeviceCount failed: cudaError"):
        cuda_calls.call("cudaGetDeviceCount", cupy.cuda.runtime.getDeviceCount)


def test_import_cupy_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)
    with pytest.raises(EngineError, match=r"pip install 'commd\[nccl\]'"):
        cuda_calls.import_cupy()


async def test_run_blocking_result_failure_and_timeout() -> None:
    assert await cuda_calls.run_blocking("quick", lambda: 42, 5) == 42
    with pytest.raises(EngineError, match=r"^commd: init failed: NCCL_ERROR_SYSTEM_ERROR"):
        await cuda_calls.run_blocking("init", lambda: _raise(NcclError("NCCL_ERROR_SYSTEM_ERROR:"
                                                                       " no route")), 5)
    late: list[str] = []
    began = time.monotonic()
    with pytest.raises(EngineError, match=r"^commd: ncclCommInitRank did not finish within "
                                          r"0\.2s"):
        await cuda_calls.run_blocking("ncclCommInitRank", lambda: _sleep_then(0.6, "comm"), 0.2,
                                      on_late_result=late.append)
    assert time.monotonic() - began < 0.5
    for _ in range(100):
        if late:
            break
        await asyncio.sleep(0.02)
    assert late == ["comm"]  # the communicator that came late is handed over to be aborted


# --- the engine with fakes -------------------------------------------------------------------


class FakeArray:
    """What device_pointer reads of a cupy array."""

    def __init__(self, size: int, itemsize: int = 4, contiguous: bool = True) -> None:
        self.size, self.itemsize = size, itemsize
        self.data = type("Pointer", (), {"ptr": 0x7000})()
        self.flags = type("Flags", (), {"c_contiguous": contiguous})()


class FakeDeviceOps(HostOps):
    kind = "cuda"
    stream_ordered = True
    stream_ptr = 99
    device_index = 0

    def __init__(self) -> None:
        self.launched: list[tuple[Any, ...]] = []

    def zeros(self, count: int, dtype: str) -> Any:
        return FakeArray(count)

    def launch(self, what: str, function: Any, *args: Any, timeout_s: float,
               on_timeout: Any = None, check: Any = None) -> Any:
        self.launched.append((what, *args))
        cuda_calls.call(what, function, *args)
        future = asyncio.get_running_loop().create_future()
        future.set_result(0.001)
        return future


class FakeComm:
    def __init__(self, fail: bool = False) -> None:
        self.fail, self.aborted = fail, False

    def allReduce(self, *args: Any) -> None:
        if self.fail:
            raise NcclError("NCCL_ERROR_UNHANDLED_CUDA_ERROR: unhandled cuda error")

    def abort(self) -> None:
        self.aborted = True


def single_node() -> EngineConfig:
    return EngineConfig(key="j/1", rank=0, size=1, store_host="", store_port=0, host="",
                        timeout_s=2)


def test_bind_checks_the_buffer_kind() -> None:
    with pytest.raises(EngineError, match="reduces cuda buffers, not cpu ones"):
        NcclEngine().bind(HostOps())


async def test_start_needs_the_jobs_device_ops() -> None:
    with pytest.raises(EngineError, match="needs the job's device buffers"):
        await NcclEngine().start(single_node())


async def test_start_and_warm_up_with_a_fake_communicator(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    comm = FakeComm()
    monkeypatch.setattr(NcclEngine, "new_unique_id", staticmethod(lambda: bytes(128)))
    monkeypatch.setattr(NcclEngine, "connect", staticmethod(lambda *args: comm))
    engine, ops = NcclEngine(), FakeDeviceOps()
    engine.bind(ops)
    await engine.start(single_node())
    assert ops.launched == [("ncclAllReduce", 0x7000, 0x7000, 1, 7, 0, 99)]  # the warm-up
    assert await engine.allreduce(FakeArray(10, itemsize=2), "bfloat16") == 0.001
    assert ops.launched[-1] == ("ncclAllReduce", 0x7000, 0x7000, 10, 9, 0, 99)
    engine.close()
    assert comm.aborted
    engine.close()  # twice is fine


async def test_a_failed_warm_up_aborts_and_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    comm = FakeComm(fail=True)
    monkeypatch.setattr(NcclEngine, "new_unique_id", staticmethod(lambda: bytes(128)))
    monkeypatch.setattr(NcclEngine, "connect", staticmethod(lambda *args: comm))
    engine = NcclEngine()
    engine.bind(FakeDeviceOps())
    with pytest.raises(EngineError, match="ncclAllReduce failed: NCCL_ERROR_UNHANDLED_CUDA"):
        await engine.start(single_node())
    assert comm.aborted


async def test_a_failed_init_raises_the_librarys_words(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any) -> None:
        raise NcclError("NCCL_ERROR_INVALID_USAGE: Duplicate GPU detected")

    monkeypatch.setattr(NcclEngine, "new_unique_id", staticmethod(lambda: bytes(128)))
    monkeypatch.setattr(NcclEngine, "connect", staticmethod(refuse))
    engine = NcclEngine()
    engine.bind(FakeDeviceOps())
    with pytest.raises(EngineError, match=r"^commd: ncclCommInitRank failed: NCCL_ERROR_INVALID"
                                          r"_USAGE: Duplicate GPU detected$"):
        await engine.start(single_node())


async def test_a_hanging_init_times_out(monkeypatch: pytest.MonkeyPatch) -> None:
    late = FakeComm()
    monkeypatch.setattr(NcclEngine, "new_unique_id", staticmethod(lambda: bytes(128)))
    monkeypatch.setattr(NcclEngine, "connect", staticmethod(lambda *a: _sleep_then(0.8, late)))
    engine = NcclEngine()
    engine.bind(FakeDeviceOps())
    config = EngineConfig(key="j/1", rank=0, size=1, store_host="", store_port=0, host="",
                          timeout_s=0.2)
    with pytest.raises(EngineError, match=r"ncclCommInitRank did not finish within 0\.2s"):
        await engine.start(config)
    for _ in range(100):
        if late.aborted:
            break
        await asyncio.sleep(0.02)
    assert late.aborted  # the late communicator does not linger


async def test_collectives_fail_as_futures_not_raises() -> None:
    engine = NcclEngine()
    engine.bind(FakeDeviceOps())
    future = engine.allreduce(FakeArray(4), "float32")
    with pytest.raises(EngineError, match="not started or already closed"):
        await future


def test_device_pointer_checks_its_argument() -> None:
    assert device_pointer(FakeArray(8), "float32") == (0x7000, 8)
    with pytest.raises(EngineError, match=r"takes device buffers \(cupy arrays\), not "
                                          "numpy.ndarray"):
        device_pointer(np.zeros(4, np.float32), "float32")
    with pytest.raises(EngineError, match="a float64 collective on a buffer of 4-byte"):
        device_pointer(FakeArray(8), "float64")
    with pytest.raises(EngineError, match="contiguous"):
        device_pointer(FakeArray(8, contiguous=False), "float32")
    with pytest.raises(ValueError, match="no dtype 'int64'"):
        device_pointer(FakeArray(8, itemsize=8), "int64")


# --- the completion watcher ------------------------------------------------------------------


class Event:
    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


async def test_watcher_settles_in_order_with_device_time() -> None:
    synced: list[int] = []

    def synchronize(ptr: int) -> None:
        time.sleep(0.01)
        synced.append(ptr)

    watcher = StreamWatcher(asyncio.get_running_loop(), synchronize=synchronize,
                            elapsed_ms=lambda start, end: float(end - start))
    first = watcher.watch("a", Event(12), start=Event(10))
    second = watcher.watch("b", Event(30))
    cleaned: list[int] = []
    watcher.after(lambda: cleaned.append(len(synced)))
    assert await first == pytest.approx(0.002)
    assert await second is None
    watcher.stop()
    watcher.stop()
    for _ in range(50):
        if cleaned:
            break
        await asyncio.sleep(0.01)
    assert synced == [12, 30] and cleaned == [2]
    closed = watcher.watch("late", Event(1))
    with pytest.raises(EngineError, match="stream is closed"):
        await closed


async def test_watcher_timeout_fails_and_calls_back() -> None:
    release = threading.Event()
    aborted: list[bool] = []
    watcher = StreamWatcher(asyncio.get_running_loop(),
                            synchronize=lambda ptr: release.wait(5),
                            elapsed_ms=lambda a, b: 0.0)
    future = watcher.watch("ncclAllReduce", Event(1), timeout_s=0.1,
                           on_timeout=lambda: (aborted.append(True), release.set()))
    with pytest.raises(EngineError, match=r"ncclAllReduce did not complete within 0\.1s"):
        await future
    assert aborted == [True]
    watcher.stop()


async def test_watcher_reports_library_errors_and_async_checks() -> None:
    def synchronize(ptr: int) -> None:
        if ptr == 1:
            raise NcclError("cudaErrorLaunchFailure: unspecified launch failure")

    watcher = StreamWatcher(asyncio.get_running_loop(), synchronize=synchronize,
                            elapsed_ms=lambda a, b: 0.0)
    with pytest.raises(EngineError, match="cudaErrorLaunchFailure"):
        await watcher.watch("sum", Event(1))

    def check() -> None:
        raise NcclError("NCCL_ERROR_REMOTE_ERROR: remote process exited")

    with pytest.raises(EngineError, match=r"^commd: ncclAllReduce failed: NCCL_ERROR_REMOTE"):
        await watcher.watch("ncclAllReduce", Event(2), check=check)
    watcher.stop()


def _raise(exc: BaseException) -> None:
    raise exc


def _sleep_then(seconds: float, value: Any) -> Any:
    time.sleep(seconds)
    return value
