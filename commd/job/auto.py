"""``compression="auto"`` on this node: each group of a plan runs dense, in float16 or
low-rank, as the coordinator's ``AutoChoice`` decided; the node keeps what each needs.

What PowerSGD held back (its error feedback) goes with the next groups that are not
low-rank: a dense group's ``flush``, or a float16 group's sum before its cast.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np

from commd.compression.spec import HALF
from commd.job.half import NodeHalf
from commd.job.lowrank import NodeLowRank
from commd.job.measurements import CommSample, IterationGains
from commd.job.schedule import Plan


class NodeAuto:
    """The ``Compressor`` of a ``compression="auto"`` job on this node: float16 groups run through
    its ``NodeHalf``, the others through its ``NodeLowRank``, which also holds PowerSGD's error
    feedback for both."""

    def __init__(self, low_rank: NodeLowRank, half: NodeHalf) -> None:
        self.low_rank = low_rank
        self.half = half

    @property
    def carried(self) -> bool:
        return self.low_rank.carried

    @property
    def dense_work(self) -> bool:
        return self.low_rank.dense_work

    def flush(self, total: np.ndarray, start: int, stop: int) -> None:
        self.low_rank.flush(total, start, stop)

    async def run(self, plan: Plan, index: int, iteration: int, total: np.ndarray,
                  turn: asyncio.Future[None], issued: asyncio.Future[None]
                  ) -> tuple[float, CommSample]:
        if plan.exchanges[index] != HALF:
            return await self.low_rank.run(plan, index, iteration, total, turn, issued)
        if self.low_rank.dense_work:
            self.low_rank.flush(total, *plan.spans[index])
        return await self.half.run(plan, index, iteration, total, turn, issued)

    def end_iteration(self, exchanges: Sequence[str]) -> IterationGains:
        # a float16 group sent its part of PowerSGD's error, as a dense one does
        return self.low_rank.end_iteration(["dense" if e == HALF else e for e in exchanges])
