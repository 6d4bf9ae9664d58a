"""The two ways to exchange top-k compressed groups between nodes, with error feedback.

Both run at node level on E = S + R, where S is the node's sum of its local ranks and R its
residual (zero at the start), and leave R = E with the sent positions zeroed. With momentum
correction (DGC's, without its factor masking) the node also keeps a velocity u = m·u + S and
E = R + u: every gradient then reaches the sum with the weight 1/(1 − m) that momentum SGD
gives it, only later where top-k holds it back, and the optimizer runs without momentum.

* ``allreduce`` (AR-compatible top-k, STAR): the iteration's leader broadcasts its top-k
  indices of |E|; every node all-reduces its E at those indices; the sums are scattered
  into a zero buffer. k values and k indices move, and the result is one dense sum.
* ``allgather``: every node sends its own top-k pairs; every node adds all received pairs
  into a zero buffer. float32 groups send them compact (wire.py: bfloat16 values and 16-bit
  offsets, 4 bytes a pair; the rounding's remainder stays in R), others as values and int32
  indices.

Groups are pipelined: a group's CPU work before the wire (E = S + R, the selection) runs as
soon as its layers are ready, while earlier groups are still on the wire. Its collectives
wait for their ``turn`` (the previous group has issued all of its own), so every node issues
the same collectives in the same order. The arithmetic runs on worker threads (the event loop
never blocks); the collectives are issued from the loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

import numpy as np

from commd.compression import wire
from commd.compression.fused import add_and_select
from commd.compression.kernels import (
    accumulate_pairs,
    add_and_energy,
    put,
    take_and_clear,
    top_energies,
)
from commd.compression.steps import WireSpans, mark_issued, off_loop
from commd.compression.topk import TopkScratch
from commd.engines import Engine
from commd.engines.completion import Completion

T = TypeVar("T")
Pairs = tuple[np.ndarray, np.ndarray]  # all nodes' indices and values


@dataclass
class CpuTimes:
    """One group's CPU work on this node, for the coordinator's cost model."""

    elements: int  # the group's dense elements
    select_s: float = 0.0  # the top-k selection (0: this node did not select)
    update_s: float = 0.0  # E = S + R, taking the values and clearing them, the write-back
    # the rest of the group's time, neither CPU work nor the values' wire nor waiting for its
    # turn: hops to worker threads, the indices' broadcast, wake-ups
    overhead_s: float = 0.0


@dataclass(frozen=True)
class ExchangeResult:
    """What exchanging one compressed group measured on this node: its gain, the value
    collectives' time on the wire, its CPU work and, where asked, the gains of smaller top-k
    counts."""

    gain: float  # ‖E at the sent indices‖² / ‖E‖² on this node
    wire_s: float  # the value collectives' time on the wire
    cpu: CpuTimes
    # per count of ``lower`` (the caller's): the gain a top-k of that count would have had
    # ([]: not asked, or this node did not select, e.g. a STAR node that is not the leader)
    lower_gains: list[float] = field(default_factory=list)


@dataclass
class GroupExchange:
    """Compressed groups of one job on this node."""

    engine: Engine | None  # None: a single-node job, nothing to exchange
    executor: Executor
    node_index: int
    nodes: int
    dtype: str
    clock: WireSpans  # the job's wire clock: collectives queue one behind another
    momentum: float = 0.0  # momentum correction's factor (the velocity is the caller's)
    _scratches: list[TopkScratch] = field(default_factory=list)  # free, reused every iteration

    async def _timed(self, function: Callable[..., T], buffer: np.ndarray,
                     *args: Any) -> tuple[T, float]:
        """``function(buffer, *args)`` and the seconds it ran (not queued): on a worker
        thread, or inline for a small buffer, where the hop would cost more than the work."""
        def timed(target: np.ndarray) -> tuple[T, float]:
            began = time.perf_counter()
            return function(target, *args), time.perf_counter() - began

        return await off_loop(self.executor, timed, buffer)

    def _scratch(self, error: np.ndarray) -> TopkScratch:
        """A free scratch that fits ``error`` (give it back with ``_scratches.append``)."""
        fits = [s for s in self._scratches if s.capacity >= error.size and s.dtype == error.dtype]
        if fits:
            self._scratches.remove(fits[0])
            return fits[0]
        # the largest group so far: made once, reused in later iterations
        self._scratches = [s for s in self._scratches if s.dtype != error.dtype]
        return TopkScratch(error.size, error.dtype)

    async def _error(self, target: np.ndarray, residual: np.ndarray,
                     velocity: np.ndarray | None) -> tuple[float, float]:
        """E = S + R (or R + u, u = m·u + S, with momentum correction) into the residual, and
        the seconds it took; the sum's buffer is zeroed in the same pass, ready for the
        result's few values."""
        return await self._timed(add_and_energy, residual, target, True, velocity,
                                 self.momentum)

    async def _error_and_select(self, target: np.ndarray, residual: np.ndarray,
                                velocity: np.ndarray | None, k: int,
                                cpu: CpuTimes) -> tuple[float, np.ndarray]:
        """``_error`` and the top-k of E in one pass where the compiled loops run
        (fused.py); the selection's own seconds go to ``cpu.select_s``, the rest to
        ``cpu.update_s``."""
        scratch = self._scratch(residual)
        try:
            fused = partial(add_and_select, clear=True, velocity=velocity,
                            momentum=self.momentum)
            (energy, indices, select_s), took = await self._timed(fused, residual, target, k,
                                                                  scratch)
        finally:
            self._scratches.append(scratch)
        cpu.select_s, cpu.update_s = select_s, max(0.0, took - select_s)
        return energy, indices

    async def allreduce(self, target: np.ndarray, residual: np.ndarray,
                        velocity: np.ndarray | None, k: int, leader: int,
                        turn: asyncio.Future[None], issued: asyncio.Future[None],
                        lower: Sequence[int] = ()) -> ExchangeResult:
        """STAR top-k; ``issued`` is set once both collectives are issued; ``lower``: counts
        below k whose gains the leader works out from its selection (``_lower_gains``)."""
        began_group = time.perf_counter()
        cpu = CpuTimes(target.size)
        indices = np.zeros(k, dtype=np.int32)
        lower_gains: list[float] = []
        lower_s = 0.0
        if self.node_index == leader:
            energy, indices = await self._error_and_select(target, residual, velocity, k, cpu)
            lower_gains, lower_s = await self._lower_gains(energy, lower, residual, indices)
        else:
            energy, cpu.update_s = await self._error(target, residual, velocity)
        try:
            waited = await _waited(turn)
            wire_s = 0.0
            if self.engine is not None:
                began = time.perf_counter()
                await self.engine.broadcast(indices, leader, "int32")
                self.clock.span(began)
            (values, sent), took = await self._timed(take_and_clear, residual, indices)
            cpu.update_s += took
            if self.engine is not None:
                began = time.perf_counter()
                wire = self.engine.allreduce(values, self.dtype)
                mark_issued(issued)
                await wire
                wire_s = self.clock.span(began)
        finally:
            mark_issued(issued)
        _, took = await self._timed(put, target, indices, values)
        cpu.update_s += took
        cpu.overhead_s = _rest(began_group, waited, wire_s, cpu, lower_s)
        return ExchangeResult(_gain(sent, energy), wire_s, cpu, lower_gains)

    async def allgather(self, target: np.ndarray, residual: np.ndarray,
                        velocity: np.ndarray | None, k: int,
                        turn: asyncio.Future[None], issued: asyncio.Future[None],
                        lower: Sequence[int] = ()) -> ExchangeResult:
        """Every node's own top-k pairs, summed; ``issued`` and ``lower`` as for
        ``allreduce``. float32 groups travel in the compact format (wire.py: 4 bytes a pair,
        one collective), others as values and int32 indices."""
        began_group = time.perf_counter()
        cpu = CpuTimes(target.size)
        energy, indices = await self._error_and_select(target, residual, velocity, k, cpu)
        packed = None
        if self.engine is not None and residual.dtype == np.float32:
            # the gains measure E, not its rounding: the exact values, while exploring only
            values = residual[indices] if lower else np.empty(0, np.float32)
            packed = np.empty(wire.packed_bytes(residual.size, k), np.uint8)
            sent, took = await self._timed(wire.pack_take, residual, indices, packed)
        else:
            (values, sent), took = await self._timed(take_and_clear, residual, indices)
        cpu.update_s += took
        lower_gains, lower_s = await self._lower_gains(energy, lower, values)
        try:
            waited = await _waited(turn)
            wire_s = 0.0
            pairs: Pairs = (indices, values)  # one node: its own
            gathered = None  # the compact buffers of every node
            if self.engine is not None:
                began = time.perf_counter()
                if packed is not None:
                    gathered = np.empty(packed.size * self.nodes, np.uint8)
                    wires = [self.engine.allgather(gathered, packed, "uint8")]
                else:
                    wires, pairs = self._issue_pairs(values, indices)
                mark_issued(issued)
                await asyncio.gather(*wires)
                wire_s = self.clock.span(began)
        finally:
            mark_issued(issued)
        if gathered is not None:  # checked, and decoded as the pairs are added
            _, took = await self._timed(wire.unpack_add, target, gathered, self.nodes, k, True)
        else:
            _, took = await self._timed(accumulate_pairs, target, *pairs, True)
        cpu.update_s += took
        cpu.overhead_s = _rest(began_group, waited, wire_s, cpu, lower_s)
        return ExchangeResult(_gain(sent, energy), wire_s, cpu, lower_gains)

    def _issue_pairs(self, values: np.ndarray,
                     indices: np.ndarray) -> tuple[list[Completion], Pairs]:
        """Issue the allgathers of the values and of the int32 indices (a float64 group)."""
        assert self.engine is not None
        all_values = np.empty(indices.size * self.nodes, dtype=values.dtype)
        all_indices = np.empty(indices.size * self.nodes, dtype=np.int32)
        return [self.engine.allgather(all_values, values, self.dtype),
                self.engine.allgather(all_indices, indices, "int32")], (all_indices, all_values)

    async def _lower_gains(self, energy: float, counts: Sequence[int], source: np.ndarray,
                           indices: np.ndarray | None = None) -> tuple[list[float], float]:
        """The gains of top-k with each of ``counts`` (< k) elements: the energy of the
        largest of this node's top-k values of E (``source``, or ``source[indices]``) over
        ‖E‖²; and the seconds it took, which the group's CPU accounting leaves out: this
        is measuring, not the exchange's work."""
        if not counts:
            return [], 0.0

        def tops(values: np.ndarray) -> list[float]:
            return top_energies(values if indices is None else values[indices], list(counts))

        found, took = await self._timed(tops, source)
        return [_gain(top, energy) for top in found], took


async def _waited(turn: asyncio.Future[None]) -> float:
    """Seconds spent waiting for the group's turn (earlier groups issuing)."""
    if turn.done():
        return 0.0
    began = time.perf_counter()
    await turn
    return time.perf_counter() - began


def _rest(began: float, waited: float, wire_s: float, cpu: CpuTimes,
          measuring_s: float = 0.0) -> float:
    total = time.perf_counter() - began
    return max(0.0, total - waited - wire_s - cpu.select_s - cpu.update_s - measuring_s)


def _gain(sent: float, energy: float) -> float:
    return 1.0 if energy <= 0 else min(1.0, sent / energy)
