"""Compressed groups are pipelined: group g+1's CPU work (E = S + R, the selection) runs while
group g is on the wire, and yet every node issues the collectives in plan order. A compressed
job that runs dense sends its residual along. The engine is a stand-in whose collectives stay
'on the wire' until the test lets them finish (the exact results over real daemons are in
test_compression.py)."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from commd.compression import exchange
from commd.compression.topk import CompressionSpec
from commd.job import replies
from commd.job.compressed import RELEASE_SHARE
from commd.job.measurements import IterationRecord
from commd.job.pipeline import Pipeline, make_plan
from commd.job.state import LocalRank

from polling import until

SIZES = [400, 300, 200]  # forward order; one group per layer


class HeldEngine:
    """Broadcasts finish at once; all-reduces stay on the wire until ``release``; the
    all-reduce doubles the values, as if the other node sent the same."""

    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.held: list[asyncio.Future[float | None]] = []

    def _future(self) -> asyncio.Future[float | None]:
        return asyncio.get_running_loop().create_future()

    def broadcast(self, buffer: Any, root: int, dtype: str) -> asyncio.Future[float | None]:
        self.log.append(f"broadcast {buffer.size}")
        future = self._future()
        future.set_result(None)
        return future

    def allreduce(self, buffer: Any, dtype: str) -> asyncio.Future[float | None]:
        self.log.append(f"allreduce {buffer.size}")
        buffer *= 2
        future = self._future()
        self.held.append(future)
        return future

    def release(self) -> None:
        for future in self.held:
            if not future.done():
                future.set_result(None)


class GatherEngine(HeldEngine):
    """All-gathers as if the other node sent what this one did, held like all-reduces."""

    def allgather(self, out: Any, buffer: Any, dtype: str) -> asyncio.Future[float | None]:
        self.log.append(f"allgather {buffer.size}")
        out[:buffer.size] = buffer
        out[buffer.size:] = buffer
        future = self._future()
        self.held.append(future)
        return future


FIXED = CompressionSpec(0.1, "auto")


def make(executor: ThreadPoolExecutor, engine: Any, exchanges: list[str],
         spec: CompressionSpec = FIXED, ratio: float = 0.1,
         ) -> tuple[Pipeline, list[np.ndarray], list[IterationRecord], list[BaseException]]:
    buffers = [np.zeros(sum(SIZES), np.float32)]
    records: list[IterationRecord] = []
    failures: list[BaseException] = []
    pipeline = Pipeline(
        sizes=SIZES, buffers=buffers, dtype="float32", op="sum", world_size=2, engine=engine,
        executor=executor, on_complete=lambda i, v: None, on_record=records.append,
        on_failure=failures.append, node_index=0, nodes=2,
        compression=spec,
    )
    pipeline.schedule(0, make_plan(1, [[2], [1], [0]], SIZES, exchanges, ratio=ratio))
    return pipeline, buffers, records, failures


async def test_the_next_group_is_selected_while_the_previous_is_on_the_wire(
        executor: ThreadPoolExecutor, monkeypatch: pytest.MonkeyPatch) -> None:
    log: list[str] = []
    selected = exchange.add_and_select

    def logged(error: np.ndarray, update: np.ndarray, k: int, scratch: Any = None,
               **options: Any) -> tuple[float, np.ndarray, float]:
        log.append(f"select {error.size}")
        return selected(error, update, k, scratch, **options)

    monkeypatch.setattr(exchange, "add_and_select", logged)
    engine = HeldEngine(log)
    pipeline, buffers, records, failures = make(executor, engine, ["allreduce"] * 3)
    buffers[0][:] = np.random.default_rng(0).standard_normal(buffers[0].size)
    pipeline.start()
    pipeline.mark(0, [0, 1, 2])
    # Group 0 (layer 2, 200 elements) goes on the wire and is held there, while groups 1
    # and 2 are selected and their collectives queue behind, in plan order.
    await until(lambda: "allreduce 40" in log, "group 2's collective issued")
    assert not any(future.done() for future in engine.held)
    assert {"select 300", "select 400"} <= set(log)
    issued = [line for line in log if not line.startswith("select")]
    assert issued == ["broadcast 20", "allreduce 20", "broadcast 30", "allreduce 30",
                      "broadcast 40", "allreduce 40"]
    engine.release()
    await until(lambda: records, "the first record")
    assert failures == []
    # Measured CPU work, per group: (elements, selection s, update s).
    assert [row[0] for row in records[0].cpu] == [200, 300, 400]
    assert all(select > 0 and update > 0 and overhead >= 0
               for _, select, update, overhead in records[0].cpu)
    pipeline.stop()


async def test_a_compressed_job_that_runs_dense_sends_its_residual_a_share_at_a_time(
        executor: ThreadPoolExecutor) -> None:
    """What top-k held back goes out with the dense iterations that follow, RELEASE_SHARE of
    what is left in each, not in one lump (under the DDP wrapper's momentum correction a
    lump is applied at the full learning rate: the loss jumped at late switches to dense);
    while it does, the ``done`` reply does not say "dense"."""
    log: list[str] = []
    engine = HeldEngine(log)
    pipeline, buffers, records, failures = make(executor, engine, ["allreduce"] * 3)
    pipeline.schedule(1, make_plan(2, [[0, 1, 2]], SIZES, ["dense"], ratio=0.1))
    gradient = np.random.default_rng(1).standard_normal(buffers[0].size).astype(np.float32)
    buffers[0][:] = gradient
    pipeline.start()
    pipeline.mark(0, [0, 1, 2])
    await until(lambda: len(engine.held) == 3, "3 collectives on the wire")
    engine.release()
    await until(lambda: records, "the first record")
    sent = buffers[0].copy() / 2  # the all-reduce doubled what this node sent
    compression = pipeline.compression
    assert compression is not None
    np.testing.assert_allclose(sent + compression.residual, gradient, rtol=1e-6)
    assert np.count_nonzero(compression.residual) > 0  # top-k held most of it back
    held = gradient - sent
    buffers[0][:] = 0  # iteration 1, dense: nothing new, a share of the residual goes out
    pipeline.mark(0, [0, 1, 2])
    await until(lambda: len(engine.held) == 4, "4 collectives on the wire")
    engine.release()
    await until(lambda: len(records) == 2, "2 records")
    np.testing.assert_allclose(buffers[0], 2 * RELEASE_SHARE * held, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(compression.residual, (1 - RELEASE_SHARE) * held, rtol=1e-5,
                               atol=1e-6)
    assert compression.pending and compression.carried
    assert not replies.done(pipeline, LocalRank(b"rank", 0, 0, 1), 1, pipeline.done_plan).dense
    released = buffers[0] / 2
    for iteration in range(2, 2 + compression.release_iterations - 1):  # the rest, in turn
        buffers[0][:] = 0
        pipeline.mark(0, [0, 1, 2])
        await until(lambda i=iteration: len(engine.held) == 3 + i,
                    f"{3 + iteration} collectives on the wire")
        engine.release()
        await until(lambda i=iteration: len(records) == i + 1, f"{iteration + 1} records")
        released += buffers[0] / 2
    np.testing.assert_allclose(released, held, rtol=1e-4, atol=1e-6)
    assert not compression.residual.any() and not compression.pending
    buffers[0][:] = 0  # nothing held back any more: a plain dense iteration
    pipeline.mark(0, [0, 1, 2])
    await until(lambda: len(engine.held) == 3 + compression.release_iterations + 1,
                "the plain dense iteration's collective")
    engine.release()
    await until(lambda: len(records) == compression.release_iterations + 2,
                "the plain dense iteration's record")
    assert not compression.carried
    assert replies.done(pipeline, LocalRank(b"rank", 0, 0, 1), 1, pipeline.done_plan).dense
    assert failures == []
    pipeline.stop()


async def test_at_ratio_1_nothing_is_held_back_so_dense_follows_at_once(
        executor: ThreadPoolExecutor) -> None:
    """At ratio 1 top-k sends every value and holds nothing back: the dense iteration after
    it has nothing to release, and its ``done`` says dense at once (a release would keep the
    DDP wrapper's momentum correction going for dozens of iterations)."""
    log: list[str] = []
    engine = HeldEngine(log)
    pipeline, buffers, records, failures = make(executor, engine, ["allreduce"] * 3,
                                                ratio=1.0)
    pipeline.schedule(1, make_plan(2, [[0, 1, 2]], SIZES, ["dense"], ratio=1.0))
    buffers[0][:] = np.random.default_rng(2).standard_normal(buffers[0].size)
    pipeline.start()
    pipeline.mark(0, [0, 1, 2])
    await until(lambda: len(engine.held) == 3, "3 collectives on the wire")
    engine.release()
    await until(lambda: records, "the first record")
    compression = pipeline.compression
    assert compression is not None
    assert not compression.residual.any() and not compression.pending
    pipeline.mark(0, [0, 1, 2])
    await until(lambda: len(engine.held) == 4, "4 collectives on the wire")
    engine.release()
    await until(lambda: len(records) == 2, "2 records")
    assert not compression.carried
    assert replies.done(pipeline, LocalRank(b"rank", 0, 0, 1), 1, pipeline.done_plan).dense
    assert failures == []
    pipeline.stop()


@pytest.mark.parametrize("kind", ["allreduce", "allgather"])
async def test_topk_auto_nodes_work_out_the_gains_of_smaller_ratios(
        executor: ThreadPoolExecutor, kind: str) -> None:
    """Running ratio 0.1, a `topk:auto` node reports the gains 0.01 and 0.001 would have had:
    the energy of the largest 1 % and 0.1 % of E (among the 10 % it selected) over ‖E‖²."""
    log: list[str] = []
    engine = GatherEngine(log) if kind == "allgather" else HeldEngine(log)
    pipeline, buffers, records, failures = make(executor, engine, [kind] * 3,
                                                CompressionSpec(None, "auto"))
    gradient = np.random.default_rng(2).standard_normal(buffers[0].size).astype(np.float32)
    buffers[0][:] = gradient
    pipeline.start()
    pipeline.mark(0, [0, 1, 2])
    await until(lambda: engine.release() or bool(records),  # whatever is on the wire
                "the first record")
    assert failures == []
    expected = {}
    for ratio in (0.001, 0.01):
        gains = []
        for start, stop in make_plan(1, [[2], [1], [0]], SIZES, [kind] * 3, ratio=0.1).spans:
            squares = np.sort(gradient[start:stop].astype(np.float64) ** 2)[::-1]
            gains.append(squares[:max(1, int(ratio * (stop - start)))].sum() / squares.sum())
        expected[ratio] = float(np.mean(gains))
    lower = dict(records[0].lower_gains)
    assert lower == pytest.approx(expected, rel=1e-5)
    assert records[0].gain > lower[0.01] > lower[0.001] > 0
    pipeline.stop()


async def test_a_fixed_ratio_reports_no_lower_gains(executor: ThreadPoolExecutor) -> None:
    engine = HeldEngine([])
    pipeline, buffers, records, failures = make(executor, engine, ["allreduce"] * 3)
    buffers[0][:] = 1.0
    pipeline.start()
    pipeline.mark(0, [0, 1, 2])
    await until(lambda: len(engine.held) == 3, "3 collectives on the wire")
    engine.release()
    await until(lambda: records, "the first record")
    assert records[0].lower_gains == [] and failures == []
    pipeline.stop()


def test_lower_gains_are_worked_out_often_while_exploring_then_rarely() -> None:
    from commd.job.compressed import lower_gains_due

    early = [i for i in range(50) if lower_gains_due(i)]
    settling = [i for i in range(50, 100) if lower_gains_due(i)]  # one per report round
    late = [i for i in range(100, 300) if lower_gains_due(i)]
    assert early == list(range(0, 50, 5)) and settling == list(range(50, 100, 10))
    assert late == [100, 150, 200, 250]
