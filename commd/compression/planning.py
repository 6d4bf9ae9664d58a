"""Compression in the planner's terms: pure functions, no I/O.

* α, β (per message, per byte) from the fitted ring all-reduce cost a + b·M:
  a = 2(N−1)α and b = 2(N−1)/N·β (Table I's ring model, which is what the job measures).
* A compressed group's cost as a line in its dense bytes B (k = ratio·B/itemsize values):
  allgather of the pairs: α·log N + (N−1)·4k·β for float32 (the compact wire, wire.py:
  4 bytes a pair), α·log N + (N−1)·(itemsize + 4)·k·β otherwise;
  AR-compatible: broadcast of 4k index bytes + ring all-reduce of 4k value bytes.
* The adaptive ratio: a Pareto front of (time, 1/gain) over ratio, one point picked by an
  achievement scalarizing function.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from commd.compression.costs import INDEX_BYTES, VALUE_BYTES
from commd.compression.topk import RATIO_RANGE
from commd.compression.wire import WIRE_BYTES_PER_ELEMENT
from commd.plan import LinearCost

ASF_WEIGHTS = (0.6, 0.4)  # time, 1/gain — the paper's weights
EXPLORE_RATIOS = (0.1, 0.01, 0.001)  # their gains fit the gain model, before the first pick
# Run for a round while exploring: the densest explored ratio only. Its measured step anchors
# the time against the ratio (below it, the cost model shifted to meet it); the nodes work
# out the smaller ratios' gains from its selections. A round at a sparser ratio would hold
# back most of every gradient in the residual, and whatever runs next (the picked, larger
# ratio, or dense) would send that backlog within a few steps: stale gradients applied at
# once, and, in a learning-rate warm-up, at a larger rate than they were computed for.
TIMED_RATIOS = (0.1,)


@dataclass(frozen=True)
class CpuCost:
    """A node's CPU work per dense element of a compressed group, measured like a and b."""

    select_s_per_element: float  # the top-k selection
    update_s_per_element: float  # E = S + R, take and clear, scatter or accumulate
    per_group_s: float = 0.0  # hops to worker threads, the indices' broadcast, wake-ups

    @property
    def per_element(self) -> float:
        return self.select_s_per_element + self.update_s_per_element


NO_CPU = CpuCost(0.0, 0.0)
# Before any node has measured: the fast path's order of magnitude on a small, shared machine
# (docs/design/compression.md, "Fast top-k, measured"); the first measured round replaces it.
DEFAULT_CPU = CpuCost(select_s_per_element=3e-9, update_s_per_element=3e-9, per_group_s=1e-3)


@dataclass(frozen=True)
class LinkCost:
    """One message's cost on one link between two nodes, a + b·bytes: ``link_cost`` derives it
    from the fitted all-reduce cost, as a ring all-reduce of M bytes sends 2(n − 1) messages of
    M/n bytes."""

    alpha_s: float  # per message
    beta_s_per_byte: float  # per byte on one link


def link_cost(cost: LinearCost, nodes: int) -> LinkCost:
    if nodes < 2:
        return LinkCost(0.0, 0.0)
    return LinkCost(cost.alpha_s / (2 * (nodes - 1)),
                    cost.beta_s_per_byte * nodes / (2 * (nodes - 1)))


def compressed_cost(exchange: str, nodes: int, link: LinkCost, ratio: float,
                    itemsize: int, cpu: CpuCost = NO_CPU) -> LinearCost:
    """A group's exchange cost as a + b·(dense bytes) (k rounded as a fraction), with the
    node's CPU work per dense byte in b and its per-group overhead in a."""
    cpu_per_byte = cpu.per_element / itemsize
    if nodes < 2:
        return LinearCost(cpu.per_group_s, cpu_per_byte)
    log_n = math.log2(nodes)
    per_dense_byte = ratio / itemsize  # k per dense byte
    if exchange == "allgather":
        pair_bytes = WIRE_BYTES_PER_ELEMENT if itemsize == 4 else itemsize + INDEX_BYTES
        return LinearCost(
            alpha_s=link.alpha_s * log_n + cpu.per_group_s,
            beta_s_per_byte=(nodes - 1) * pair_bytes * per_dense_byte
            * link.beta_s_per_byte + cpu_per_byte,
        )
    alpha = link.alpha_s * (log_n + 2 * (nodes - 1)) + cpu.per_group_s
    beta = (log_n * INDEX_BYTES + 2 * (nodes - 1) / nodes * VALUE_BYTES) * per_dense_byte
    return LinearCost(alpha_s=alpha, beta_s_per_byte=beta * link.beta_s_per_byte + cpu_per_byte)


@dataclass(frozen=True)
class GainModel:
    """1/gain = exp(c0) · ratio^c1, fitted in log-log space (gain capped at 1)."""

    c0: float
    c1: float
    assumed: bool = False  # the slope is assumed (``steeper_than``), not fitted

    @property
    def slope(self) -> float:
        """s in gain ∝ ratio^s (uncapped)."""
        return -self.c1

    def gain(self, ratio: float | np.ndarray) -> np.ndarray:
        gains: np.ndarray = np.minimum(1.0, np.exp(-self.c0) * np.power(ratio, -self.c1))
        return gains


def steeper_than(model: GainModel, slope: float) -> GainModel:
    """``model``, or where its slope is flatter than ``slope``, a model of that slope whose
    gain reaches 1 at the top of RATIO_RANGE. The pick on the front depends on the slope
    alone (both of its objectives are relative) except where the gain is capped at 1; the
    level of gains measured before error feedback's residuals have built up says nothing
    (every ratio's is near 1), so none is taken from them."""
    if model.slope >= slope:
        return model
    return GainModel(slope * math.log(RATIO_RANGE[1]), -slope, assumed=True)


def mean_gain_per_ratio(gains: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """(ratio, mean gain) per distinct ratio of (ratio, gain) observations, smallest first."""
    by_ratio: dict[float, list[float]] = {}
    for ratio, gain in gains:
        by_ratio.setdefault(ratio, []).append(gain)
    return [(r, float(np.mean(g))) for r, g in sorted(by_ratio.items())]


def fit_gain(observations: Sequence[tuple[float, float]]) -> GainModel | None:
    """Least squares over (ratio, gain) pairs with at least two distinct ratios."""
    points = [(r, g) for r, g in observations if r > 0 and 0 < g <= 1]
    if len({r for r, _ in points}) < 2:
        return None
    x = np.log([r for r, _ in points])
    y = np.log([1.0 / g for _, g in points])
    c1, c0 = np.polyfit(x, y, 1)
    return GainModel(float(c0), float(min(c1, 0.0)))


def pick_ratio(time_of: Callable[[float], float], model: GainModel,
               grid: int = 64) -> tuple[float, list[tuple[float, float, float]]]:
    """The ratio picked from the Pareto front of (time, 1/gain), and the front.

    With one variable the front is computed exactly on a fine log grid over RATIO_RANGE:
    keep the points no other point beats on both objectives. Both objectives are relative
    shortfalls from the front's best point: the time is the slowdown against the fastest (it
    is a whole step, compute included, and a difference matters in proportion to the step: a
    front spanning 2 % of the step is no reason to give up gain), 1/gain the factor by which
    less of E is sent than at the best gain, minus 1. Neither depends on where the grid
    ends: normalised over the front instead (ideal → 0, nadir → 1), 1/gain's scale was set by
    the smallest ratio's (0.001: 1/gain ≈ 100 on our DDP task, against 3–17 over
    0.01–0.1), which made every gain difference above 0.01 look negligible. The pick
    minimises the achievement scalarizing function max(w_time·time, w_gain·(1/gain)).
    """
    ratios = np.geomspace(RATIO_RANGE[0], RATIO_RANGE[1], grid)
    times = np.array([time_of(float(r)) for r in ratios])
    inverse_gain = 1.0 / model.gain(ratios)
    front = [i for i in range(grid)
             if not np.any((times <= times[i]) & (inverse_gain <= inverse_gain[i])
                           & ((times < times[i]) | (inverse_gain < inverse_gain[i])))]
    f1, f2 = times[front], inverse_gain[front]
    scores = np.maximum(ASF_WEIGHTS[0] * _shortfall(f1), ASF_WEIGHTS[1] * _shortfall(f2))
    best = front[int(np.argmin(scores))]
    points = [(float(ratios[i]), float(times[i]), float(inverse_gain[i])) for i in front]
    return float(ratios[best]), points


def _shortfall(values: np.ndarray) -> np.ndarray:
    """How much worse than the best (smallest) of ``values`` each is, as a fraction of it."""
    best = values.min()
    shortfall: np.ndarray = (values - best) / max(abs(best), 1e-30)
    return shortfall
