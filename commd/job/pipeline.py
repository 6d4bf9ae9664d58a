"""The data plane of one job on one node: readiness tracking and group execution.

Groups run in plan order on every node, so no per-iteration negotiation is needed. Each group
is summed over the local ranks, all-reduced once among the nodes, scaled for avg and written
back to every local rank; group g+1 is summed while group g is on the wire. Readiness is kept
per layer, not per group, so a new plan can take over at any iteration boundary.

Where the buffers live is the business of ``BufferOps``. Host operations run when called.
Device operations are stream-ordered: a group's local sum, collective and copy back are only
enqueued, the clients are told ``done`` as soon as the iteration's last group is issued (their
streams wait on the done event), and the iteration's record for the profiler follows when the
device has finished it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import numpy as np

from commd.compression.exchange import GroupExchange
from commd.compression.topk import topk_count
from commd.engines import Engine
from commd.engines.buffer_ops import Buffer, BufferOps, HostOps
from commd.job.latency import LatencyWindow
from commd.plan.fitting import (
    ALLGATHER,
    ALLREDUCE,
    PROBE_ELEMENTS,
    PROBE_REPEATS,
    CommSample,
    IterationRecord,
)
from commd_client.layout import backward_offsets, group_span

# Below this many bytes a memory op is cheaper inline than a hop to a worker thread.
_INLINE_BYTES = 256 * 1024


class ReadyError(ValueError):
    """A bad ready notification; the job carries on."""


@dataclass(frozen=True)
class Plan:
    version: int
    groups: list[list[int]]
    spans: list[tuple[int, int]]  # element range of each group in the flat buffer
    exchanges: list[str]  # per group: "dense", or a top-k exchange ("allgather", "allreduce")
    ratio: float  # top-k ratio of the compressed groups


def make_plan(version: int, groups: Sequence[Sequence[int]], sizes: Sequence[int],
              exchanges: Sequence[str] = (), ratio: float = 0.0) -> Plan:
    offsets = backward_offsets(sizes)
    lists = [sorted(g) for g in groups]
    kinds = list(exchanges) or ["dense"] * len(lists)
    if len(kinds) != len(lists):
        raise ValueError(f"{len(kinds)} exchanges for {len(lists)} groups")
    return Plan(version, lists, [group_span(g, sizes, offsets) for g in lists], kinds, ratio)


class Pipeline:
    """Runs iterations for one job: counts ready marks, launches groups, reports completion."""

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
        on_complete: Callable[[int, int], None],
        on_record: Callable[[IterationRecord], None],
        on_failure: Callable[[BaseException], None],
        node_index: int = 0,
        nodes: int = 1,
        compressed: bool = False,
        ops: BufferOps | None = None,
    ) -> None:
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
        self._marked = np.zeros((len(self.buffers), len(self.sizes)), dtype=bool)
        self._count = np.zeros(len(self.sizes), dtype=np.int64)
        # CLOCK_MONOTONIC time each layer became ready on this node (the latest local rank's)
        self._ready_at = np.zeros(len(self.sizes), dtype=np.float64)
        # CLOCK_MONOTONIC send time of the notification that completed each layer (0: unknown)
        self._sent_at = np.zeros(len(self.sizes), dtype=np.float64)
        self.ready_to_launch = LatencyWindow()  # last ready sent → the group's reduction issued
        self._records: asyncio.Future[None] | None = None  # device: the last pending record
        self._views_plan: Plan | None = None  # the plan whose group views are cached
        self._views: dict[int, list[Buffer]] = {}  # group index -> one view per local rank
        self._changed = asyncio.Event()
        self.plan: Plan | None = None
        self._scheduled: dict[int, Plan] = {}  # effective iteration -> plan
        self._required: set[int] = set()  # iterations that must not start without a decision
        self._decided = asyncio.Event()
        self.iteration = 0
        self.plan_history: list[dict[str, int]] = []
        self._task: asyncio.Task[None] | None = None
        self._last_wire_end = 0.0
        self.notifications = 0  # ready messages received (clients batch them per group)
        self._last_finished = 0.0  # when the previous iteration's record was finished
        self._exchange = GroupExchange(engine, executor, node_index, nodes, dtype)
        # Error-feedback residuals of the node's sums, zero at the start; only when compressing.
        self.residual = np.zeros_like(self.buffers[0]) if compressed else None
        self.gains: list[float] = []  # compression gain of each compressed group, this iteration

    # --- plans (from the control plane) ----------------------------------------------------------

    def expect_decision(self, iteration: int) -> None:
        """Iteration ``iteration`` waits until a plan decision for it has arrived."""
        if iteration >= self.iteration:
            self._required.add(iteration)

    def schedule(self, effective_iteration: int, plan: Plan) -> None:
        self._scheduled[max(effective_iteration, self.iteration)] = plan
        self._decided.set()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="commd-pipeline")

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._records is not None:
            self._records.cancel()

    # --- readiness (from the control plane) ------------------------------------------------------

    def mark(self, local_index: int, layers: Sequence[int], sent_at: float = 0.0,
             stamps: Sequence[float] | None = None) -> None:
        """Record ready layers of one local rank; raise ReadyError and change nothing if bad.
        ``sent_at``: the client's CLOCK_MONOTONIC time of sending (0: not given); ``stamps``:
        when each layer became ready, on the same clock (empty: now)."""
        if stamps and len(stamps) != len(layers):
            raise ReadyError(f"{len(stamps)} stamps for {len(layers)} layers")
        self.notifications += 1
        row = self._marked[local_index]
        if len(layers) == 1:  # one ready per layer, no numpy fancy indexing
            self._mark_one(row, layers[0], sent_at, stamps[0] if stamps else time.monotonic())
            return
        for layer in layers:
            if not 0 <= layer < row.size:
                raise ReadyError(f"ready for unknown layer {layer}; layers are 0..{row.size - 1}")
        chosen = list(layers)
        if len(set(chosen)) != len(chosen) or row[chosen].any():
            twice = sorted({x for x in chosen if row[x] or chosen.count(x) > 1})
            raise ReadyError(
                f"ready twice in iteration {self.iteration} for layer(s) {twice}; "
                "wait for the iteration to finish before marking again"
            )
        row[chosen] = True
        self._count[chosen] += 1
        # A layer is ready when the last local rank's gradient is: keep the latest stamp.
        np.maximum.at(self._ready_at, chosen, stamps if stamps else time.monotonic())
        complete = [x for x in chosen if self._count[x] == len(self.buffers)]
        if complete:
            self._sent_at[complete] = sent_at
            self._changed.set()

    def _mark_one(self, row: np.ndarray, layer: int, sent_at: float, stamp: float) -> None:
        if not 0 <= layer < row.size:
            raise ReadyError(f"ready for unknown layer {layer}; layers are 0..{row.size - 1}")
        if row[layer]:
            raise ReadyError(
                f"ready twice in iteration {self.iteration} for layer(s) [{layer}]; "
                "wait for the iteration to finish before marking again"
            )
        row[layer] = True
        self._count[layer] += 1
        self._ready_at[layer] = max(self._ready_at[layer], stamp)
        if self._count[layer] == len(self.buffers):
            self._sent_at[layer] = sent_at
            self._changed.set()

    @property
    def in_flight(self) -> bool:
        return bool(self._count.any())

    # --- execution -------------------------------------------------------------------------------

    def upcoming_plan(self, iteration: int) -> Plan | None:
        """The plan ``iteration`` will run with, as far as known now (None: undecided)."""
        if iteration in self._scheduled:
            return self._scheduled[iteration]
        if iteration in self._required or iteration < self.iteration:
            return None
        return self.plan

    async def _run(self) -> None:
        try:
            while True:
                plan = await self._plan_for(self.iteration)
                await self._iterate(plan)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._on_failure(exc)

    async def _plan_for(self, iteration: int) -> Plan:
        while iteration in self._required and iteration not in self._scheduled:
            self._decided.clear()
            await self._decided.wait()
        self._required.discard(iteration)
        plan = self._scheduled.pop(iteration, None)
        if plan is not None and (self.plan is None or plan.version != self.plan.version):
            self.plan_history = [*self.plan_history[-9:],
                                 {"iteration": iteration, "version": plan.version,
                                  "groups": len(plan.groups)}]
            self.plan = plan
        assert self.plan is not None, "the first plan must be scheduled before start()"
        return self.plan

    async def _iterate(self, plan: Plan) -> None:
        finishing = []
        samples: list[CommSample] = []
        wires: list[asyncio.Future[Any]] = []  # device: collectives still on the stream
        for index, group in enumerate(plan.groups):
            while self._count[group[0] : group[-1] + 1].min() < len(self.buffers):
                self._changed.clear()
                await self._changed.wait()
            if plan.exchanges[index] == "dense":
                finishing.append(await self._launch(plan, index, samples, wires))
            else:
                finishing.append(await self._compressed(plan, index, samples))
        await asyncio.gather(*finishing)
        ready_at = self._ready_at.copy()
        gain = float(np.mean(self.gains)) if self.gains else 1.0
        self.gains = []
        done = self.iteration
        self.iteration += 1
        self._marked[:] = False
        self._count[:] = 0
        self._ready_at[:] = 0.0
        if not self.ops.stream_ordered:
            self._on_record(self._record(plan, done, ready_at, samples, gain,
                                         time.monotonic()))
            self._on_complete(done, plan.version)
            return
        # Device: everything is issued. The clients' streams wait on the done event; the
        # record follows once the device has finished (in order, never blocking the loop).
        self.ops.release()
        self._on_complete(done, plan.version)
        finished = self.ops.fence()
        previous = self._records
        self._records = asyncio.ensure_future(self._record_when_finished(
            previous, [*wires, finished], plan, done, ready_at, samples, gain))

    def _record(self, plan: Plan, iteration: int, ready_at: np.ndarray,
                samples: list[CommSample], gain: float, finished: float) -> IterationRecord:
        start = float(ready_at.min())
        period = finished - self._last_finished if self._last_finished else 0.0
        self._last_finished = finished
        return IterationRecord(
            plan=plan.version,
            period_s=period,
            gain=gain,
            ratio=plan.ratio if any(e != "dense" for e in plan.exchanges) else 1.0,
            iteration=iteration,
            ready_offsets_s=ready_at - start,
            comm=samples,
            exposed_comm_s=max(0.0, finished - float(ready_at.max())),
            iteration_s=finished - start,
        )

    async def _record_when_finished(self, previous: asyncio.Future[None] | None,
                                    pending: list[asyncio.Future[Any]], plan: Plan,
                                    iteration: int, ready_at: np.ndarray,
                                    samples: list[CommSample], gain: float) -> None:
        try:
            if previous is not None:
                with contextlib.suppress(Exception):  # its failure was reported already
                    await previous
            await asyncio.gather(*pending)
            finished = time.monotonic()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._on_failure(exc)
            return
        self._on_record(self._record(plan, iteration, ready_at, samples, gain, finished))

    async def _launch(
        self, plan: Plan, index: int, samples: list[CommSample],
        wires: list[asyncio.Future[Any]],
    ) -> asyncio.Future[Any]:
        """Sum the local ranks into the first one's buffer, then put the group on the wire."""
        views = self._group_views(plan, index)
        self.ops.acquire()
        if len(views) > 1:
            await self._memory(self.ops.sum_into, views[0], views[1:], self.dtype)
        wire: asyncio.Future[Any] | None = None
        if self.engine is not None:
            wire = self._timed(self.engine.allreduce(views[0], self.dtype),
                               (self.iteration, index), views[0].nbytes, samples)
        self._note_launch(plan.groups[index])
        if not self.ops.stream_ordered:
            return asyncio.ensure_future(self._finish(wire, views))
        # Stream-ordered: the copy back queues behind the collective on the same stream.
        if wire is not None:
            wires.append(wire)
        self.ops.finish(views[0], views[1:], self._factor(), self.dtype)
        return _completed()

    def _group_views(self, plan: Plan, index: int) -> list[Buffer]:
        """Each local rank's slice of a group, made once per plan (a device array's slice
        costs microseconds, on the path from the last ready to the launch)."""
        if self._views_plan is not plan:
            self._views_plan, self._views = plan, {}
        views = self._views.get(index)
        if views is None:
            start, stop = plan.spans[index]
            views = self._views[index] = [buffer[start:stop] for buffer in self.buffers]
        return views

    def _note_launch(self, group: Sequence[int]) -> None:
        sent = float(self._sent_at[group[0] : group[-1] + 1].max())
        if sent > 0.0:
            self.ready_to_launch.add(max(0.0, time.monotonic() - sent))

    def _factor(self) -> float:
        return 1.0 / self.world_size if self.op == "avg" and self.world_size > 1 else 1.0

    async def _compressed(
        self, plan: Plan, index: int, samples: list[CommSample]
    ) -> asyncio.Future[Any]:
        """A top-k group: its collectives finish before the next group's are issued, so that
        every node issues the same collectives in the same order."""
        assert self.residual is not None
        start, stop = plan.spans[index]
        views = [buffer[start:stop] for buffer in self.buffers]
        if len(views) > 1:
            await self._memory(self.ops.sum_into, views[0], views[1:], self.dtype)
        k = topk_count(stop - start, plan.ratio)
        residual = self.residual[start:stop]
        key = (self.iteration, index)
        itemsize = views[0].itemsize
        if plan.exchanges[index] == "allreduce":
            leader = self.iteration % self._exchange.nodes
            gain, wire = await self._exchange.allreduce(views[0], residual, k, leader)
            sample = CommSample(key, k * itemsize, wire, ALLREDUCE)
        else:
            gain, wire = await self._exchange.allgather(views[0], residual, k)
            sample = CommSample(key, k * (itemsize + 4), wire, ALLGATHER)  # values + indices
        self.gains.append(gain)
        self._last_wire_end = time.perf_counter()
        if self.engine is not None:  # the job's own collectives keep a and b up to date
            samples.append(sample)
        return asyncio.ensure_future(self._finish(None, views))

    def _timed(self, wire: asyncio.Future[Any], key: tuple[int, int], nbytes: int,
               samples: list[CommSample]) -> asyncio.Future[Any]:
        # A collective waits behind the previous one on the engine's queue: its wire time
        # starts when it was launched or when the previous one finished, whichever is later.
        launched = time.perf_counter()

        def record(done: asyncio.Future[Any]) -> None:
            ended = time.perf_counter()
            begin = max(launched, self._last_wire_end)
            self._last_wire_end = ended
            # A device engine measures the collective itself (timing events on its stream):
            # the wall clock would also count the wait for the producers' events.
            measured = None if done.cancelled() or done.exception() else done.result()
            took = measured if isinstance(measured, float) else ended - begin
            samples.append(CommSample(key, nbytes, took))

        wire.add_done_callback(record)
        return wire

    async def _finish(self, wire: asyncio.Future[Any] | None, views: list[Buffer]) -> None:
        if wire is not None:
            await wire
        if self._factor() != 1.0 or len(views) > 1:
            await self._memory(self.ops.finish, views[0], views[1:], self._factor(), self.dtype)

    async def _memory(self, function: Callable[..., None], buffer: Buffer, *args: Any) -> None:
        if self.ops.stream_ordered or buffer.nbytes <= _INLINE_BYTES:
            function(buffer, *args)
            return
        await asyncio.get_running_loop().run_in_executor(self._executor, function, buffer, *args)

    # --- the start-up probe ----------------------------------------------------------------------

    async def probe(self) -> list[list[float]]:
        """All-reduce scratch buffers over a range of sizes: samples for the first fit of a, b.

        Costs PROBE_REPEATS × 5.3 MB on the wire: ~40 ms on loopback, ~0.1 s on 1 Gbit/s.
        Runs before the first iteration, in the same order on every node.
        """
        if self.engine is None:
            return []
        samples: list[list[float]] = []
        for repeat in range(PROBE_REPEATS):
            for index, elements in enumerate(PROBE_ELEMENTS):
                scratch = self.ops.zeros(elements, "float32")
                begin = time.perf_counter()
                await self.engine.allreduce(scratch, "float32")
                if repeat > 0:  # the first round is the warm-up
                    samples.append([-repeat, index, scratch.nbytes, time.perf_counter() - begin])
        return samples


def _completed() -> asyncio.Future[Any]:
    future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    future.set_result(None)
    return future
