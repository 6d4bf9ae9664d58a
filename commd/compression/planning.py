"""Compression in the planner's terms: pure functions, no I/O.

* α, β (per message, per byte) from the fitted ring all-reduce cost a + b·M:
  a = 2(N−1)α and b = 2(N−1)/N·β (Table I's ring model, which is what the job measures).
* A compressed group's cost as a line in its dense bytes B (k = ratio·B/itemsize values):
  allgather of values+indices: α·log N + (N−1)·2·4k·β;
  AR-compatible: broadcast of 4k index bytes + ring all-reduce of 4k value bytes.
* The adaptive ratio: a Pareto front of (time, 1/gain) over ratio, one point picked by an
  achievement scalarizing function.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from commd.compression.costs import INDEX_BYTES, VALUE_BYTES, exchange_costs
from commd.compression.topk import RATIO_RANGE
from commd.plan import LinearCost

ASF_WEIGHTS = (0.6, 0.4)  # time, 1/gain — the paper's weights
RESOLVE_CHANGE = 0.10  # re-solve the ratio when α, β or the smoothed gain move this much
EXPLORE_RATIOS = (0.1, 0.01, 0.001)  # tried in turn before the gain model is fitted


@dataclass(frozen=True)
class LinkCost:
    alpha_s: float  # per message
    beta_s_per_byte: float  # per byte on one link


def link_cost(cost: LinearCost, nodes: int) -> LinkCost:
    if nodes < 2:
        return LinkCost(0.0, 0.0)
    return LinkCost(cost.alpha_s / (2 * (nodes - 1)),
                    cost.beta_s_per_byte * nodes / (2 * (nodes - 1)))


def compressed_cost(exchange: str, nodes: int, link: LinkCost, ratio: float,
                    itemsize: int) -> LinearCost:
    """A group's exchange cost as a + b·(dense bytes) (k rounded as a fraction)."""
    if nodes < 2:
        return LinearCost(0.0, 0.0)
    log_n = math.log2(nodes)
    per_dense_byte = ratio / itemsize  # k per dense byte
    if exchange == "allgather":
        return LinearCost(
            alpha_s=link.alpha_s * log_n,
            beta_s_per_byte=(nodes - 1) * (VALUE_BYTES + INDEX_BYTES) * per_dense_byte
            * link.beta_s_per_byte,
        )
    alpha = link.alpha_s * (log_n + 2 * (nodes - 1))
    beta = (log_n * INDEX_BYTES + 2 * (nodes - 1) / nodes * VALUE_BYTES) * per_dense_byte
    return LinearCost(alpha_s=alpha, beta_s_per_byte=beta * link.beta_s_per_byte)


def choose_exchange(requested: str, nodes: int, link: LinkCost, elements: int,
                    ratio: float) -> str:
    """The requested exchange, or with ``auto`` the cheaper one by the cost models."""
    if requested != "auto":
        return requested
    if nodes < 2:
        return "allreduce"
    # The engine's all-reduce is a ring: compare with that, not with the tree model.
    costs = exchange_costs(nodes, link.alpha_s, link.beta_s_per_byte, elements, ratio)
    return "allgather" if costs.allgather_s <= costs.allreduce_ring_s else "allreduce"


def exchange_time(exchange: str, nodes: int, link: LinkCost, elements: int,
                  ratio: float) -> float:
    if nodes < 2:
        return 0.0
    costs = exchange_costs(nodes, link.alpha_s, link.beta_s_per_byte, elements, ratio)
    return costs.allgather_s if exchange == "allgather" else costs.allreduce_ring_s


@dataclass(frozen=True)
class GainModel:
    """1/gain = exp(c0) · ratio^c1, fitted in log-log space (gain capped at 1)."""

    c0: float
    c1: float

    def gain(self, ratio: float | np.ndarray) -> np.ndarray:
        return np.minimum(1.0, np.exp(-self.c0) * np.power(ratio, -self.c1))


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
    keep the points no other point beats on both objectives. Each objective is normalised
    to [0, 1] over the front (ideal → 0, nadir → 1) and the pick minimises the achievement
    scalarizing function max(w_time·time, w_gain·(1/gain)).
    """
    ratios = np.geomspace(RATIO_RANGE[0], RATIO_RANGE[1], grid)
    times = np.array([time_of(float(r)) for r in ratios])
    inverse_gain = 1.0 / model.gain(ratios)
    front = [i for i in range(grid)
             if not np.any((times <= times[i]) & (inverse_gain <= inverse_gain[i])
                           & ((times < times[i]) | (inverse_gain < inverse_gain[i])))]
    f1, f2 = times[front], inverse_gain[front]
    span1 = max(f1.max() - f1.min(), 1e-30)
    span2 = max(f2.max() - f2.min(), 1e-30)
    scores = np.maximum(ASF_WEIGHTS[0] * (f1 - f1.min()) / span1,
                        ASF_WEIGHTS[1] * (f2 - f2.min()) / span2)
    best = front[int(np.argmin(scores))]
    points = [(float(ratios[i]), float(times[i]), float(inverse_gain[i])) for i in front]
    return float(ratios[best]), points
