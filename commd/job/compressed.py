"""A compressed job's state on this node: the error-feedback residuals, what this iteration's
compressed groups measured, and the exchange that runs them (``commd.compression.exchange``).

The pipeline owns when a group runs; this owns what a compressed group does to the node's sum.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence

import numpy as np

from commd.compression.exchange import GroupExchange
from commd.compression.momentum import add_momentum, release_held
from commd.compression.topk import topk_count
from commd.job.measurements import CommSample, IterationGains
from commd.job.schedule import Plan
from commd_protocol.peer import ALLGATHER, ALLREDUCE, REPORT_EVERY

INDEX_BYTES = 4  # int32 indices travel beside an allgather's values
# Every this many iterations a `topk:auto` job's nodes also work out the gains of the
# smaller explored ratios from what they selected (a partition of the k values sent, tens of
# milliseconds for a ResNet-50-sized model at ratio 0.1: too much for every iteration),
# while the job explores; then
# once a report round until LOWER_GAINS_SETTLING (the coordinator watches the gains' slope
# settle round by round after its first solve, compression_policy.py), then ten times less
# often than at first, to keep the gain model fresh.
LOWER_GAINS_EVERY = 5
LOWER_GAINS_EARLY = 50
LOWER_GAINS_SETTLING = 100
# Without the daemon's momentum, the share of what top-k held back that each dense iteration
# after compressed ones sends (the rest stays held): the rate momentum 0.9 spreads a
# gradient at. Sent in the first dense iteration at once, the backlog is many steps' worth
# of gradient applied in one step (under the DDP wrapper's momentum correction, at the full
# learning rate), and the loss jumped at the switch.
RELEASE_SHARE = 0.1


def lower_gains_due(iteration: int) -> bool:
    """Whether this iteration's selections also give the smaller ratios' gains."""
    every = (LOWER_GAINS_EVERY if iteration < LOWER_GAINS_EARLY
             else REPORT_EVERY if iteration < LOWER_GAINS_SETTLING
             else 10 * LOWER_GAINS_EVERY)
    return iteration % every == 0


class NodeCompression:
    """The ``Compressor`` of a top-k job on this node: the error-feedback residuals (and momentum
    correction's velocity), the release of what top-k held back through later dense groups, and
    what the iteration's compressed groups measured."""

    def __init__(self, like: np.ndarray, exchange: GroupExchange,
                 lower_ratios: Sequence[float] = ()) -> None:
        self.exchange = exchange
        # ratios whose gains are worked out from a larger ratio's selection (`topk:auto`:
        # the coordinator then need not run them to fit its gain model)
        self.lower_ratios = tuple(lower_ratios)
        self.lower: dict[float, list[float]] = {}  # ratio -> gains, this iteration
        self.residual = np.zeros_like(like)  # one float per element, zero at the start
        # momentum correction's velocity u (None: off), kept through dense rounds too
        self.velocity = np.zeros_like(like) if exchange.momentum else None
        # a compressed group ran and what it held back is not all sent yet (dense rounds
        # send it over ``release_iterations``: RELEASE_SHARE, or with momentum correction
        # 1 − m, of what is left in each)
        self.pending = False
        # the last iteration's dense groups sent some of it (the ``done`` reply then does not
        # say "dense": the DDP wrapper's momentum correction keeps correcting)
        self.carried = False
        self._carrying = False
        self.release_iterations = _release_iterations(exchange.momentum)
        self.release_left = 0  # momentum correction: dense iterations left in the release
        self.gains: list[float] = []  # per compressed group of this iteration
        # per compressed group of this iteration: (elements, selection s, update s, overhead s)
        self.cpu: list[tuple[int, float, float, float]] = []

    async def run(self, plan: Plan, index: int, iteration: int, total: np.ndarray,
                  turn: asyncio.Future[None], issued: asyncio.Future[None]
                  ) -> tuple[float, CommSample]:
        """Group ``index``'s node sum ``total`` exchanged and written back into it; returns
        its gain and the sample of its value collective(s)."""
        start, stop = plan.spans[index]
        k = topk_count(stop - start, plan.ratio)
        if k < stop - start:  # something is held back (at ratio 1 nothing is: no release)
            self.pending = True
            self.release_left = self.release_iterations
        residual = self.residual[start:stop]
        velocity = None if self.velocity is None else self.velocity[start:stop]
        itemsize = total.itemsize
        key = (iteration, index)
        lower = self._lower(stop - start, k) if lower_gains_due(iteration) else {}
        counts = list(lower.values())
        if plan.exchanges[index] == "allreduce":
            leader = iteration % self.exchange.nodes
            result = await self.exchange.allreduce(total, residual, velocity, k, leader, turn,
                                                   issued, counts)
            sample = CommSample(key, k * itemsize, result.wire_s, ALLREDUCE)
        else:
            result = await self.exchange.allgather(total, residual, velocity, k, turn, issued,
                                                   counts)
            sample = CommSample(key, k * (itemsize + INDEX_BYTES), result.wire_s, ALLGATHER)
        for ratio, gain in zip(lower, result.lower_gains, strict=False):
            self.lower.setdefault(ratio, []).append(gain)
        cpu = result.cpu
        self.gains.append(result.gain)
        self.cpu.append((cpu.elements, cpu.select_s, cpu.update_s, cpu.overhead_s))
        return result.gain, sample

    @property
    def dense_work(self) -> bool:
        """Whether a dense group of this job has to go through ``flush`` first."""
        return self.pending or self.velocity is not None

    def flush(self, total: np.ndarray, start: int, stop: int) -> None:
        """A dense group of a compressed job: a share of what top-k held back is sent with
        it (and with momentum correction, the velocity instead of the plain sum)."""
        residual = self.residual[start:stop]
        self._carrying = self._carrying or self.pending
        if self.velocity is not None:
            add_momentum(total, residual if self.pending else None,
                         self.velocity[start:stop], self.exchange.momentum,
                         release_all=self.release_left <= 1)
            return
        if self.pending:
            release_held(total, residual, RELEASE_SHARE, release_all=self.release_left <= 1)

    def _lower(self, elements: int, k: int) -> dict[float, int]:
        """ratio -> top-k count, for the lower ratios whose count is below ``k``."""
        counts = {ratio: topk_count(elements, ratio) for ratio in self.lower_ratios}
        return {ratio: count for ratio, count in counts.items() if count < k}

    def end_iteration(self, exchanges: Sequence[str]) -> IterationGains:
        """The iteration's gains and CPU rows, and a fresh start for the next one."""
        gains = IterationGains(
            float(np.mean(self.gains)) if self.gains else 1.0, self.cpu,
            [(ratio, float(np.mean(g))) for ratio, g in sorted(self.lower.items())])
        self.gains, self.cpu, self.lower = [], [], {}
        self.carried, self._carrying = self._carrying, False
        if self.pending and all(e == "dense" for e in exchanges):
            # A dense iteration sent one more step of the release (the last: all of it).
            self.release_left -= 1
            self.pending = self.release_left > 0
        return gains


def _release_iterations(momentum: float, remainder: float = 1e-3) -> int:
    """Dense iterations over which what top-k held back is released: m^j of it (without
    momentum correction, (1 − RELEASE_SHARE)^j) is still held after j, and the last sends the
    rest (``remainder`` or less)."""
    keep = momentum if momentum > 0 else 1 - RELEASE_SHARE
    return max(1, math.ceil(math.log(remainder) / math.log(keep)))
