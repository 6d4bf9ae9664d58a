"""A 16-bit dense wire on this node (``compression="fp16"``, and ``auto``'s middle choice):
each group's node sum is divided by the job's ranks, cast to float16, summed over the nodes
in float16 and cast back, as torch's ``fp16_compress_hook`` does per rank. Half the bytes of
a float32 group; no error feedback (torch's hook keeps none), so nothing is held back.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import Executor

import numpy as np

from commd.compression.steps import allreduce_in_turn, off_loop
from commd.engines import Engine
from commd.job.measurements import CommSample, IterationGains, WireClock
from commd.job.schedule import Plan
from commd_protocol.peer import ALLREDUCE


class NodeHalf:
    """float16 groups of one job on this node."""

    def __init__(self, engine: Engine | None, executor: Executor, clock: WireClock,
                 world_size: int) -> None:
        self.engine = engine
        self._executor = executor
        self._clock = clock
        self._world_size = max(1, world_size)
        self.carried = False  # nothing is ever held back

    @property
    def dense_work(self) -> bool:
        return False

    def flush(self, total: np.ndarray, start: int, stop: int) -> None:
        """Not used (``dense_work`` is False)."""

    async def run(self, plan: Plan, index: int, iteration: int, total: np.ndarray,
                  turn: asyncio.Future[None], issued: asyncio.Future[None]
                  ) -> tuple[float, CommSample]:
        """Group ``index``'s node sum, summed over the nodes in float16, written back into
        ``total`` (the sum over every rank, in float32)."""
        wire = np.empty(total.size, dtype=np.float16)
        await off_loop(self._executor, scaled_to_half, total, wire, 1.0 / self._world_size)
        seconds = await allreduce_in_turn(self.engine, wire, "float16", turn, issued,
                                          self._clock)
        await off_loop(self._executor, scaled_from_half, total, wire, float(self._world_size))
        return 1.0, CommSample((iteration, index), wire.nbytes, seconds, ALLREDUCE)

    def end_iteration(self, exchanges: Sequence[str]) -> IterationGains:
        return IterationGains()


def scaled_to_half(total: np.ndarray, wire: np.ndarray, factor: float) -> None:
    """torch's hook divides before the sum (in float16 there; here before the cast, the same
    for a job of 2, 4, 8… ranks): the sum of the averages stays in float16's range."""
    np.multiply(total, factor, out=total)
    wire[...] = total


def scaled_from_half(total: np.ndarray, wire: np.ndarray, factor: float) -> None:
    np.multiply(wire, factor, out=total, dtype=total.dtype)
