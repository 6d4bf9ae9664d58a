"""The data plane of one job on one node: groups run as their layers become ready.

Groups run in plan order on every node, so no per-iteration negotiation is needed. Each group
is summed over the local ranks, all-reduced once among the nodes, scaled for avg and written
back to every local rank; group g+1 is summed while group g is on the wire. What is ready is
``Readiness``'s business, which plan runs is ``PlanSchedule``'s.

Where the buffers live is the business of ``BufferOps``; what launching a group, finishing
it and ending an iteration mean is the pipeline's ``Mode`` (``commd.job.modes``: host
buffers, device buffers, compressed), chosen once when the pipeline is built. The pipeline
keeps the operations on one group that every mode shares (its node sum, its collective, its
write-back), which ``TolerantPipeline`` replaces.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from commd.compression.exchange import GroupExchange
from commd.compression.planning import EXPLORE_RATIOS
from commd.compression.spec import AutoSpec, HalfSpec, LowRankSpec, Spec
from commd.compression.topk import SUPPORTED_DTYPES as COMPRESSIBLE_DTYPES
from commd.engines import Engine
from commd.engines.buffer_ops import INLINE_BYTES, Buffer, BufferOps, HostOps
from commd.job.auto import NodeAuto
from commd.job.compressed import NodeCompression
from commd.job.half import NodeHalf
from commd.job.latency import LatencyWindow
from commd.job.lowrank import NodeLowRank
from commd.job.measurements import (
    CommSample,
    IterationGains,
    IterationRecord,
    StepClock,
    WireClock,
)
from commd.job.modes import Compressor, Mode, Prepare, Wired, mode_for
from commd.job.readiness import Readiness, ReadyError
from commd.job.schedule import Plan, PlanSchedule, make_plan
from commd.job.trace import TraceRecorder
from commd.job.watchdog import CollectiveWatch
from commd_protocol.status import LatencySummary, PlanChange

__all__ = ["Pipeline", "PipelineSnapshot", "Plan", "ReadyError", "make_plan"]


@dataclass(frozen=True)
class PipelineSnapshot:
    """What status shows of the data plane."""

    iteration: int = 0
    plan: Plan | None = None
    history: list[PlanChange] = field(default_factory=list)
    ready_messages: int = 0
    ready_to_launch: LatencySummary | None = None


class Pipeline:
    """Runs iterations for one job: waits for ready groups, launches them, reports completion."""

    def __init__(
        self,
        *,
        sizes: Sequence[int],
        buffers: Sequence[Buffer],
        dtype: str,
        op: str,
        world_size: int,
        engine: Engine | None,
        executor: Executor,
        on_complete: Callable[[int, Plan], None],
        on_record: Callable[[IterationRecord], None],
        on_failure: Callable[[BaseException], None],
        node_index: int = 0,
        nodes: int = 1,
        compression: Spec | None = None,
        rows: Sequence[int] = (),
        ops: BufferOps | None = None,
        watchdog: tuple[float, float] = (10.0, 15.0),
        patient: Callable[[], bool] = lambda: False,
    ) -> None:
        """``watchdog``: a collective's limit is factor × its predicted time + floor seconds
        (``CollectiveWatch``, patient while ``patient()``); ``on_failure`` hears of a
        collective past it."""
        self.sizes = list(sizes)
        self.buffers = list(buffers)  # one flat array per local rank, local-rank order
        self.ops = ops if ops is not None else HostOps()
        self.dtype = dtype
        self.op = op
        self.world_size = world_size
        self.engine = engine
        self._executor = executor
        self._on_complete = on_complete
        self._on_record = on_record
        self._on_failure = on_failure
        self._ready = Readiness(len(self.buffers), len(self.sizes))
        self._schedule = PlanSchedule()
        self.ready_to_launch = LatencyWindow()  # last ready sent → the group's reduction issued
        self._group_views = GroupViews(self.buffers)
        self.trace: TraceRecorder | None = None  # `commd trace` armed: records iterations
        self.iteration = 0
        self.done_plan: Plan | None = None  # the plan the last finished iteration ran with
        self._task: asyncio.Task[None] | None = None
        self._finishing: list[asyncio.Future[Any]] = []  # the current iteration's groups
        self._wire_clock = WireClock()
        self._records_clock = StepClock()  # iteration records, with the step time
        self._watch = CollectiveWatch(*watchdog, f"node {node_index} of {nodes}", on_failure,
                                      patient)
        self._rows = list(rows)  # each layer's matrix rows (0: a vector), for PowerSGD
        if isinstance(compression, AutoSpec) and self.ops.stream_ordered:
            compression = None  # a device job: the daemon compresses on its CPU threads
        if isinstance(compression, AutoSpec | HalfSpec) and dtype not in COMPRESSIBLE_DTYPES:
            compression = None  # half-precision gradients stay as they are
        self._compression_spec = compression
        self.compression = self._new_compression(node_index, nodes)
        self.mode: Mode = mode_for(self, compression)  # chosen once: the kind of job

    def _new_compression(self, node_index: int, nodes: int) -> Compressor | None:
        """A compressed job's state for this node's place among ``nodes`` (residuals zero)."""
        spec = self._compression_spec
        if spec is None:
            return None
        if isinstance(spec, HalfSpec):
            return NodeHalf(self.engine, self._executor, self._wire_clock, self.world_size)
        if isinstance(spec, LowRankSpec | AutoSpec):
            share = len(self.buffers) / max(1, self.world_size)
            low_rank = spec.low_rank if isinstance(spec, AutoSpec) else spec
            node = NodeLowRank(low_rank, self.buffers[0], self.sizes, self._rows, self.engine,
                               self._executor, self._wire_clock, share)
            if isinstance(spec, LowRankSpec):
                return node
            return NodeAuto(node, NodeHalf(self.engine, self._executor, self._wire_clock,
                                           self.world_size))
        exchange = GroupExchange(self.engine, self._executor, node_index, nodes, self.dtype,
                                 self._wire_clock, spec.momentum)
        lower = EXPLORE_RATIOS if spec.ratio is None else ()
        return NodeCompression(self.buffers[0], exchange, lower)

    @property
    def compression_spec(self) -> Spec | None:
        """What the job registered as its compression (None: dense)."""
        return self._compression_spec

    # --- from the control plane ------------------------------------------------------------------

    def expect_decision(self, iteration: int) -> None:
        """Iteration ``iteration`` waits until a plan decision for it has arrived."""
        self._schedule.expect_decision(iteration, self.iteration)

    def schedule(self, effective_iteration: int, plan: Plan) -> None:
        self._schedule.add(effective_iteration, plan, self.iteration)

    def upcoming_plan(self, iteration: int) -> Plan | None:
        """The plan ``iteration`` will run with, as far as known now (None: undecided)."""
        return self._schedule.upcoming(iteration, self.iteration)

    @property
    def plan(self) -> Plan | None:
        return self._schedule.plan

    def mark(self, local_index: int, layers: Sequence[int], sent_at: float = 0.0,
             stamps: Sequence[float] | None = None) -> None:
        """Layers one local rank has finished (see ``Readiness.mark``); ReadyError if bad."""
        self._ready.mark(local_index, layers, self.iteration, sent_at, stamps)

    @property
    def in_flight(self) -> bool:
        return self._ready.in_flight

    def waiting(self) -> tuple[float, list[tuple[int, int]], float]:
        """(seconds this iteration has waited for marks, [(local index, the layer it has not
        marked)], seconds the oldest collective has been on the wire): for the stall
        inspector. Marks awaited: (0, [], …)."""
        return (*self._ready.waiting(), self._watch.oldest_s())

    def snapshot(self) -> PipelineSnapshot:
        return PipelineSnapshot(self.iteration, self.plan, self._schedule.history,
                                self._ready.notifications, self.ready_to_launch.summary())

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="commd-pipeline")

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self.mode.stop()

    def release(self) -> None:
        """Drop every view of the ranks' buffers, and the compression's state (after stop: the
        job is over). The pipeline lives on in reference cycles until a full garbage
        collection; views kept here would keep the buffers' address ranges that long."""
        self.buffers.clear()  # the group views' list too
        self._group_views = GroupViews(self.buffers)
        self.compression = None

    # --- execution -------------------------------------------------------------------------------

    async def _run(self) -> None:
        try:
            while True:
                plan = await self._schedule.plan_for(self.iteration)
                await self._iterate(plan)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._on_failure(exc)

    async def _iterate(self, plan: Plan) -> None:
        run = self.mode.begin()
        self._finishing = run.finishing  # a stop abandons them too (TolerantPipeline.suspend)
        for index, group in enumerate(plan.groups):
            await self._ready.wait_for(group)
            if self.trace is not None:
                self.trace.group(self.iteration, plan, index)
            run.finishing.append(await self.mode.launch(plan, index, run))
            if self.trace is not None:
                self.trace.finishing(self.iteration, index, run.finishing[-1])
        await _all_or_cancel(run.finishing)
        await self._commit(plan)
        done, ready_at, gains = self._advance(plan)
        if self.trace is not None:
            self.trace.iteration(done, plan, ready_at)
        self.mode.end(plan, done, ready_at, gains, run)

    def _advance(self, plan: Plan) -> tuple[int, np.ndarray, IterationGains]:
        """The iteration ``plan`` ran is over on this node: (its number, when each layer was
        ready, the compression's gains); the next iteration's marks start empty."""
        gains = self.mode.gains(plan)
        done = self.iteration
        self.done_plan = plan
        self.iteration += 1
        return done, self._ready.next_iteration(), gains

    # --- the operations on one group, for the mode (``commd.job.modes.Stage``) ------------------

    async def to_wire(self, plan: Plan, index: int, samples: list[CommSample],
                      prepare: Prepare | None = None) -> Wired:
        """Sum the local ranks into the first one's buffer (then ``prepare`` it), and put the
        group on the wire."""
        views = self._group_views(plan, index)
        self.ops.acquire()
        total = await self._node_sum(plan, index, views)
        if prepare is not None:
            await self._memory(prepare, total, *plan.spans[index])
        wire: asyncio.Future[Any] | None = None
        if self.engine is not None:
            wire = self._wire_clock.timed(self.engine.allreduce(total, self.dtype),
                                          (self.iteration, index), total.nbytes, samples)
            itemsize = total.itemsize
            self._watch.watch(wire, describe(plan, index, self.iteration, itemsize),
                              predicted_s(plan, index, itemsize))
        if self.trace is not None:
            self.trace.launched(self.iteration, index, wire)
        self._note_launch(plan.groups[index])
        return Wired(total, views, wire)

    async def finish_group(self, wired: Wired) -> None:
        await self._finish(wired.wire, wired.total, wired.views)

    def enqueue_write_back(self, wired: Wired) -> None:
        views = wired.views
        self.ops.finish(views[0], views[1:], self._factor(), self.dtype)

    def record(self, plan: Plan, iteration: int, ready_at: np.ndarray,
               samples: list[CommSample], gains: IterationGains, finished: float) -> None:
        self._on_record(self._records_clock.record(plan, iteration, ready_at, samples, gains,
                                                   finished))

    def complete(self, iteration: int, plan: Plan) -> None:
        self._on_complete(iteration, plan)

    def fail(self, error: BaseException) -> None:
        self._on_failure(error)

    def _note_launch(self, group: Sequence[int]) -> None:
        sent = self._ready.last_sent(group)
        if sent > 0.0:
            self.ready_to_launch.add(max(0.0, time.monotonic() - sent))

    def _factor(self) -> float:
        return 1.0 / self.world_size if self.op == "avg" and self.world_size > 1 else 1.0

    async def exchange(self, plan: Plan, index: int, samples: list[CommSample],
                       turn: asyncio.Future[Any], issued: asyncio.Future[None]) -> None:
        """A top-k group: its collectives wait for ``turn``; ``issued`` once they are."""
        assert self.compression is not None
        iteration = self.iteration
        start, stop = plan.spans[index]
        views = [buffer[start:stop] for buffer in self.buffers]
        total = await self._node_sum(plan, index, views)
        if self.trace is not None:
            self.trace.summed(iteration, index)
        itemsize = total.itemsize
        with self._watch.span(describe(plan, index, iteration, itemsize),
                              predicted_s(plan, index, itemsize)):
            gain, sample = await self.compression.run(plan, index, iteration, total, turn,
                                                      issued)
        if self.trace is not None:
            self.trace.exchanged(iteration, index, gain, sample.seconds)
        if self.engine is not None:  # the job's own collectives keep a and b up to date
            samples.append(sample)
        await self._finish(None, total, views)

    # --- where a group's sum lives: the strategy ``TolerantPipeline`` replaces -------------------

    async def _node_sum(self, plan: Plan, index: int, views: list[Buffer]) -> Buffer:
        """The node's sum of group ``index``, where its collective runs: the local ranks
        summed into the first one's buffer."""
        if len(views) > 1:
            await self._memory(self.ops.sum_into, views[0], views[1:], self.dtype)
        return views[0]

    async def _write_back(self, total: Buffer, views: list[Buffer]) -> None:
        """A group's result, scaled for avg, into every local rank's buffer."""
        if self._factor() != 1.0 or len(views) > 1:
            await self._memory(self.ops.finish, total, views[1:], self._factor(), self.dtype)

    async def _commit(self, plan: Plan) -> None:
        """Every group of the iteration is whole on this node; before its ranks are told."""

    async def _finish(self, wire: asyncio.Future[Any] | None, total: Buffer,
                      views: list[Buffer]) -> None:
        if wire is not None:
            await wire
        await self._write_back(total, views)

    async def _memory(self, function: Callable[..., None], buffer: Buffer, *args: Any) -> None:
        if self.ops.stream_ordered or buffer.nbytes <= INLINE_BYTES:
            function(buffer, *args)
            return
        await asyncio.get_running_loop().run_in_executor(self._executor, function, buffer, *args)


def describe(plan: Plan, index: int, iteration: int, itemsize: int) -> str:
    group, (start, stop) = plan.groups[index], plan.spans[index]
    return (f"the collective of group {index} (layers {group[0]}..{group[-1]}, "
            f"{(stop - start) * itemsize} bytes) in iteration {iteration}")


def predicted_s(plan: Plan, index: int, itemsize: int) -> float:
    """The plan's a + b·M for a group (M: its dense bytes, an upper bound when compressed)."""
    start, stop = plan.spans[index]
    alpha, beta = plan.cost
    return alpha + beta * (stop - start) * itemsize


class GroupViews:
    """Each local rank's slice of a group, made once per plan (a device array's slice costs
    microseconds, on the path from the last ready to the launch)."""

    def __init__(self, buffers: Sequence[Buffer]) -> None:
        self._buffers = buffers
        self._plan: Plan | None = None  # the plan whose group views are cached
        self._views: dict[int, list[Buffer]] = {}  # group index -> one view per local rank

    def __call__(self, plan: Plan, index: int) -> list[Buffer]:
        if self._plan is not plan:
            self._plan, self._views = plan, {}
        views = self._views.get(index)
        if views is None:
            start, stop = plan.spans[index]
            views = self._views[index] = [buffer[start:stop] for buffer in self._buffers]
        return views


async def _all_or_cancel(futures: Sequence[asyncio.Future[Any]]) -> None:
    """Every future done; on the first failure the others are cancelled (a group's task
    that still waits for its turn must not linger)."""
    try:
        await asyncio.gather(*futures)
    except BaseException:
        for future in futures:
            future.cancel()
        raise
