"""The pipeline's stream-ordered (device) path on CPU, with numpy standing in for the device:
clients hear ``done`` once everything is issued, the profiler's record follows when the device
has finished, a failure on the device reaches the job, and ready-to-launch is measured."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from commd.engines.base import EngineError
from commd.engines.buffer_ops import HostOps
from commd.job.measurements import IterationRecord
from commd.job.pipeline import Pipeline, Plan, make_plan

from polling import until


class StreamOps(HostOps):
    """Host arithmetic, but stream-ordered: the fence completes when the test says so."""

    kind = "cuda"
    stream_ordered = True

    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.fences: list[asyncio.Future[float | None]] = []

    def acquire(self) -> None:
        self.log.append("acquire")

    def release(self) -> None:
        self.log.append("release")

    def sum_into(self, target: Any, sources: Sequence[Any], dtype: str) -> None:
        self.log.append("sum")
        super().sum_into(target, sources, dtype)

    def finish(self, source: Any, targets: Sequence[Any], factor: float, dtype: str) -> None:
        self.log.append(f"finish x{factor:g}")
        super().finish(source, targets, factor, dtype)

    def fence(self) -> asyncio.Future[float | None]:
        self.log.append("fence")
        future: asyncio.Future[float | None] = asyncio.get_running_loop().create_future()
        self.fences.append(future)
        return future


class WireEngine:
    """Collectives that stay 'on the stream' until the test completes them."""

    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.pending: list[asyncio.Future[float | None]] = []

    def allreduce(self, buffer: Any, dtype: str) -> asyncio.Future[float | None]:
        self.log.append("allreduce")
        buffer *= 3  # as if two other nodes held the same sum
        future: asyncio.Future[float | None] = asyncio.get_running_loop().create_future()
        self.pending.append(future)
        return future


def make(log: list[str], executor: ThreadPoolExecutor, engine: Any = None, op: str = "avg",
         world: int = 2) -> tuple[Pipeline, list[np.ndarray], dict[str, list[Any]]]:
    sizes = [3, 2, 4]  # forward order; the flat buffer is backward: layer 2 first
    buffers = [np.zeros(9, np.float32), np.zeros(9, np.float32)]
    seen: dict[str, list[Any]] = {"complete": [], "record": [], "failure": []}

    def on_complete(iteration: int, plan: Plan) -> None:
        log.append(f"done {iteration}")
        seen["complete"].append(iteration)

    def on_record(record: IterationRecord) -> None:
        log.append(f"record {record.iteration}")
        seen["record"].append(record)

    pipeline = Pipeline(
        sizes=sizes, buffers=buffers, dtype="float32", op=op, world_size=world, engine=engine,
        executor=executor, on_complete=on_complete, on_record=on_record,
        on_failure=lambda exc: seen["failure"].append(exc), ops=StreamOps(log),
    )
    pipeline.schedule(0, make_plan(1, [[2], [0, 1]], sizes))
    return pipeline, buffers, seen


async def test_done_before_the_device_finishes_then_the_record(executor: ThreadPoolExecutor
                                                               ) -> None:
    log: list[str] = []
    pipeline, buffers, seen = make(log, executor)
    buffers[0][:], buffers[1][:] = np.arange(9), 10 * np.arange(9)
    pipeline.start()
    now = time.monotonic()
    for rank in (0, 1):
        pipeline.mark(rank, [2], sent_at=now)
    for rank in (0, 1):
        pipeline.mark(rank, [0, 1], sent_at=now)
    await until(lambda: seen["complete"], "iteration 0 answered")
    assert log == ["acquire", "sum", "finish x0.5", "acquire", "sum", "finish x0.5",
                   "release", "done 0", "fence"]
    assert seen["record"] == []  # the device has not finished yet
    expected = 11 * np.arange(9) / 2
    np.testing.assert_array_equal(buffers[0], expected)
    np.testing.assert_array_equal(buffers[1], expected)
    ops = pipeline.ops
    assert isinstance(ops, StreamOps)
    ops.fences[0].set_result(None)
    await until(lambda: seen["record"], "iteration 0 recorded")
    assert log[-1] == "record 0" and seen["record"][0].iteration == 0
    assert pipeline.iteration == 1
    summary = pipeline.ready_to_launch.summary()
    assert summary is not None and summary.samples == 2.0 and summary.p50_us >= 0
    pipeline.stop()


async def test_records_stay_in_order_and_collectives_are_not_awaited(
        executor: ThreadPoolExecutor) -> None:
    log: list[str] = []
    engine = WireEngine(log)
    pipeline, buffers, seen = make(log, executor, engine=engine, op="sum", world=6)
    pipeline.start()
    for iteration in range(2):
        for layers in ([2], [0, 1]):
            for rank in (0, 1):
                buffers[rank][:] = rank + 1
                pipeline.mark(rank, layers)
        await until(lambda n=iteration: len(seen["complete"]) == n + 1,
                    f"iteration {iteration} answered")
    # Both iterations were issued and answered while every collective is still "running".
    assert seen["complete"] == [0, 1] and seen["record"] == []
    np.testing.assert_array_equal(buffers[1], np.full(9, 9.0))  # (1 + 2) × 3 nodes
    ops = pipeline.ops
    assert isinstance(ops, StreamOps)
    ops.fences[1].set_result(None)  # the second iteration's fence first
    for future in engine.pending:
        future.set_result(0.25)  # the device's own measurement
    await asyncio.sleep(0.02)
    assert seen["record"] == []  # iteration 1's record waits for iteration 0's
    ops.fences[0].set_result(None)
    await until(lambda: len(seen["record"]) == 2, "both iterations recorded")
    assert [r.iteration for r in seen["record"]] == [0, 1]
    assert all(s.seconds == 0.25 for r in seen["record"] for s in r.comm)
    pipeline.stop()


async def test_a_device_failure_reaches_the_job(executor: ThreadPoolExecutor) -> None:
    log: list[str] = []
    engine = WireEngine(log)
    pipeline, _, seen = make(log, executor, engine=engine, op="sum")
    pipeline.start()
    for layers in ([2], [0, 1]):
        for rank in (0, 1):
            pipeline.mark(rank, layers)
    await until(lambda: seen["complete"], "the iteration answered")
    engine.pending[0].set_exception(EngineError("commd: ncclAllReduce did not complete"))
    engine.pending[1].set_result(None)
    await until(lambda: seen["failure"], "the device's failure")
    assert "ncclAllReduce" in str(seen["failure"][0]) and seen["record"] == []
    pipeline.stop()


async def test_host_ops_finish_scales_and_copies() -> None:
    ops = HostOps()
    source, target = np.array([2.0, 4.0], np.float32), np.zeros(2, np.float32)
    ops.finish(source, [target], 0.5, "float32")
    np.testing.assert_array_equal(target, [1.0, 2.0])
    ops.finish(source, [target], 1.0, "float32")
    np.testing.assert_array_equal(source, [1.0, 2.0])
    assert ops.zeros(3, "bfloat16").dtype == np.uint16
    assert await ops.fence() is None
    with pytest.raises(NotImplementedError):
        ops.launch("x", print, timeout_s=1)
