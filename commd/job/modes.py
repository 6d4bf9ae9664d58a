"""How a ``Pipeline`` runs its groups: one strategy per kind of job, chosen once when the
pipeline is built (``mode_for``).

* ``HostMode``: host buffers, dense groups. Each group's collective and write-back run as a
  task; the iteration's record and the clients' ``done`` follow once every group is whole.
* ``DeviceMode``: device buffers (stream-ordered operations, NCCL). A group's local sum,
  collective and copy back are only enqueued; the clients are told ``done`` as soon as the
  iteration's last group is issued (their streams wait on the done event), and the
  iteration's record follows when the device has finished it, records in order.
* ``CompressedMode``: host buffers, top-k or low-rank compression (a ``Compressor``). A
  compressed group runs as a task whose CPU work starts at once, its collectives in plan
  order after the previous group's (``turn``); a dense group of a top-k job first sends what
  top-k held back.

The pipeline owns when a group is ready and the operations on a group (``Stage``); a mode
owns what launching a group, finishing it and ending an iteration mean for its kind of job.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import numpy as np

from commd.compression.spec import Spec
from commd.engines.buffer_ops import Buffer, BufferOps
from commd.job.measurements import CommSample, IterationGains
from commd.job.schedule import Plan

Prepare = Callable[[Buffer, int, int], None]  # on a group's node sum before its collective


class Wired(NamedTuple):
    """A dense group on its way: the node's sum, each local rank's view of the group, and
    its collective (None: a single node, nothing on the wire)."""

    total: Buffer
    views: list[Buffer]
    wire: asyncio.Future[Any] | None


@dataclass
class Iteration:
    """One iteration's launches as they go."""

    turn: asyncio.Future[Any]  # the collectives of the next group wait for this one
    samples: list[CommSample] = field(default_factory=list)
    finishing: list[asyncio.Future[Any]] = field(default_factory=list)  # one per group
    wires: list[asyncio.Future[Any]] = field(default_factory=list)  # device: on the stream


class Compressor(Protocol):
    """A compressed job's state on this node and what its compressed groups do to the node's
    sum: top-k's ``NodeCompression`` or PowerSGD's ``NodeLowRank``."""

    @property
    def carried(self) -> bool:
        """The last iteration's dense groups sent some of what compression held back (the
        ``done`` reply then does not say "dense")."""
        ...

    @property
    def dense_work(self) -> bool:
        """Whether a dense group of this job has to go through ``flush`` first."""
        ...

    def flush(self, total: np.ndarray, start: int, stop: int) -> None:
        """A dense group of the job, before its collective."""

    async def run(self, plan: Plan, index: int, iteration: int, total: np.ndarray,
                  turn: asyncio.Future[None], issued: asyncio.Future[None]
                  ) -> tuple[float, CommSample]:
        """Group ``index``'s node sum exchanged and written back into ``total``: its gain
        and the sample of its (first) collective."""
        ...

    def end_iteration(self, exchanges: Sequence[str]) -> IterationGains:
        """The iteration's gains, and a fresh start for the next one."""
        ...


class Stage(Protocol):
    """What a mode uses of its pipeline: the operations on one group, and the clients."""

    ops: BufferOps
    compression: Compressor | None

    async def to_wire(self, plan: Plan, index: int, samples: list[CommSample],
                      prepare: Prepare | None = None) -> Wired:
        """Group ``index``'s node sum (``prepare``d) put on the wire."""
        ...

    async def finish_group(self, wired: Wired) -> None:
        """The group's collective awaited and its result written back (host)."""
        ...

    def enqueue_write_back(self, wired: Wired) -> None:
        """The group's result copied back behind its collective on the stream (device)."""

    async def exchange(self, plan: Plan, index: int, samples: list[CommSample],
                       turn: asyncio.Future[Any], issued: asyncio.Future[None]) -> None:
        """A top-k group, its collectives after ``turn``; ``issued`` once they are."""
        ...

    def record(self, plan: Plan, iteration: int, ready_at: np.ndarray,
               samples: list[CommSample], gains: IterationGains, finished: float) -> None:
        """The iteration's record, for the node's profile."""

    def complete(self, iteration: int, plan: Plan) -> None:
        """The clients are told the iteration is done."""

    def fail(self, error: BaseException) -> None:
        """The job's data plane failed."""


class Mode(Protocol):
    """What an iteration does with its groups, by kind of job."""

    def begin(self) -> Iteration:
        """A new iteration's state."""
        ...

    async def launch(self, plan: Plan, index: int, run: Iteration) -> asyncio.Future[Any]:
        """Group ``index`` is ready: launch it; the future is done once it is whole here."""
        ...

    def gains(self, plan: Plan) -> IterationGains:
        """The iteration ``plan`` ran is over on this node: what its compression measured."""
        ...

    def end(self, plan: Plan, iteration: int, ready_at: np.ndarray, gains: IterationGains,
            run: Iteration) -> None:
        """Every group is whole (host) or issued (device): tell the clients, record it."""

    def stop(self) -> None:
        """The pipeline stops: nothing of the mode's may run on."""


class HostMode:
    """Host buffers, dense groups: each group runs as a task on its ``Stage``; the iteration ends
    with its record and the clients' ``done``."""

    def __init__(self, stage: Stage) -> None:
        self._stage = stage

    def begin(self) -> Iteration:
        return Iteration(completed())

    async def launch(self, plan: Plan, index: int, run: Iteration) -> asyncio.Future[Any]:
        """Sum the local ranks into the first one's buffer, put the group on the wire; a task
        writes the result back once it is through."""
        wired = await self._stage.to_wire(plan, index, run.samples)
        return asyncio.ensure_future(self._stage.finish_group(wired))

    def gains(self, plan: Plan) -> IterationGains:
        return IterationGains()

    def end(self, plan: Plan, iteration: int, ready_at: np.ndarray, gains: IterationGains,
            run: Iteration) -> None:
        self._stage.record(plan, iteration, ready_at, run.samples, gains, time.monotonic())
        self._stage.complete(iteration, plan)

    def stop(self) -> None:
        pass


class CompressedMode(HostMode):
    """Host buffers with top-k or low-rank compression: ``HostMode``, but each group's collectives
    wait for the previous group's (``turn``), and the iteration's gains come from the
    compressor."""

    async def launch(self, plan: Plan, index: int, run: Iteration) -> asyncio.Future[Any]:
        """Every node issues the groups' collectives in plan order: a group issues its own
        once the previous group has issued all of its (a compressed group's may wait for CPU
        work and a broadcast in between)."""
        stage = self._stage
        if plan.exchanges[index] == "dense":
            if not run.turn.done():
                await run.turn
            compression = stage.compression
            # A compressed job runs dense: what top-k held back goes too.
            prepare = (compression.flush if compression is not None and compression.dense_work
                       else None)
            wired = await stage.to_wire(plan, index, run.samples, prepare)
            return asyncio.ensure_future(stage.finish_group(wired))
        issued = asyncio.get_running_loop().create_future()
        # A task: its CPU work starts now, overlapping earlier groups' wire time.
        task = asyncio.ensure_future(stage.exchange(plan, index, run.samples, run.turn, issued))
        run.turn = issued
        return task

    def gains(self, plan: Plan) -> IterationGains:
        compression = self._stage.compression
        return (compression.end_iteration(plan.exchanges) if compression is not None
                else IterationGains())


class DeviceMode:
    """Device buffers: a group's work is only enqueued on the stream; the clients hear ``done`` once
    the iteration is issued, and its record follows when the device has finished it, in order."""

    def __init__(self, stage: Stage) -> None:
        self._stage = stage
        self._records: asyncio.Future[None] | None = None  # the last pending record

    def begin(self) -> Iteration:
        return Iteration(completed())

    async def launch(self, plan: Plan, index: int, run: Iteration) -> asyncio.Future[Any]:
        """Stream-ordered: the copy back queues behind the collective on the same stream."""
        wired = await self._stage.to_wire(plan, index, run.samples)
        if wired.wire is not None:
            run.wires.append(wired.wire)
        self._stage.enqueue_write_back(wired)
        return completed()

    def gains(self, plan: Plan) -> IterationGains:
        return IterationGains()

    def end(self, plan: Plan, iteration: int, ready_at: np.ndarray, gains: IterationGains,
            run: Iteration) -> None:
        """Everything is issued. The clients' streams wait on the done event; the record
        follows once the device has finished (in order, never blocking the loop)."""
        ops = self._stage.ops
        ops.release()
        self._stage.complete(iteration, plan)
        finished = ops.fence()
        previous = self._records
        self._records = asyncio.ensure_future(self._record_when_finished(
            previous, [*run.wires, finished], plan, iteration, ready_at, run.samples, gains))

    async def _record_when_finished(self, previous: asyncio.Future[None] | None,
                                    pending: list[asyncio.Future[Any]], plan: Plan,
                                    iteration: int, ready_at: np.ndarray,
                                    samples: list[CommSample], gains: IterationGains) -> None:
        try:
            if previous is not None:
                with contextlib.suppress(Exception):  # its failure was reported already
                    await previous
            await asyncio.gather(*pending)
            finished = time.monotonic()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._stage.fail(exc)
            return
        self._stage.record(plan, iteration, ready_at, samples, gains, finished)

    def stop(self) -> None:
        if self._records is not None:
            self._records.cancel()


def mode_for(stage: Stage, compression: Spec | None) -> Mode:
    """The mode of a pipeline whose buffers ``stage.ops`` hold (compression needs host
    buffers: ``commd.job.buffers``)."""
    if compression is not None:
        return CompressedMode(stage)
    if stage.ops.stream_ordered:
        return DeviceMode(stage)
    return HostMode(stage)


def completed() -> asyncio.Future[Any]:
    future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    future.set_result(None)
    return future
