"""The coordinator's per-job planning state: job-wide profile in, plan decisions out.

No I/O: the coordinator feeds it every node's report of a round and sends what it returns.
It re-plans when a, b or the backward profile drift beyond ``DRIFT`` since the last plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from commd_protocol import PeerProfile

from .planner import LinearCost, evaluate, plan_with
from .profiler import (
    DECISION_LAG,
    backward_from_offsets,
    combine_comm,
    fit_cost,
    profile_drift,
    relative_change,
)

DRIFT = 0.25  # relative change of a, b or the backward profile that triggers a re-plan
FALLBACK_COST = LinearCost(alpha_s=100e-6, beta_s_per_byte=1e-9)  # before any measurement


@dataclass(frozen=True)
class Decision:
    effective_iteration: int
    version: int
    groups: list[list[int]]
    cost: LinearCost
    predicted_comm_s: float
    reason: str


@dataclass
class Replanner:
    planner: str
    sizes_bytes: list[int]
    version: int = 0
    groups: list[list[int]] = field(default_factory=list)
    cost: LinearCost | None = None
    backward_s: list[float] = field(default_factory=list)

    def decide(self, reports: Sequence[PeerProfile]) -> Decision:
        """The plan for the round all ``reports`` (one per node) belong to."""
        round_number = reports[0].round
        samples = combine_comm([r.comm for r in reports])
        cost = self._fit(samples) or self.cost or FALLBACK_COST
        backward = self._backward(reports)
        reason = self._why_replan(cost, backward)
        if reason:
            groups = plan_with(self.planner, self.sizes_bytes, backward, cost)
            if groups != self.groups:
                self.version += 1
                self.groups = groups
            self.cost, self.backward_s = cost, backward
        assert self.cost is not None
        timing = evaluate(self.groups, self.sizes_bytes, self.backward_s, self.cost)
        last = max(r.iteration for r in reports)
        effective = 0 if round_number == 0 else last + 1 + DECISION_LAG
        return Decision(effective, self.version, self.groups, self.cost,
                        timing.exposed_comm_s, reason or "no drift")

    def _fit(self, samples: list[tuple[int, float]]) -> LinearCost | None:
        """a, b from this round's collectives alone, so a change of network shows at once."""
        sizes = {n for n, _ in samples}
        if len(sizes) >= 2:
            return fit_cost(samples)
        if len(sizes) == 1 and self.cost is not None:
            # One size (e.g. a single group) cannot separate a from b: keep the known
            # start-up cost and put the change on the bandwidth term.
            (nbytes,) = sizes
            seconds = float(np.median([s for _, s in samples]))
            beta = max(0.0, (seconds - self.cost.alpha_s) / max(nbytes, 1))
            return LinearCost(alpha_s=self.cost.alpha_s, beta_s_per_byte=beta)
        return None

    def _backward(self, reports: Sequence[PeerProfile]) -> list[float]:
        offsets = [r.ready_offsets_s for r in reports if r.ready_offsets_s]
        if not offsets:
            return self.backward_s or [0.0] * len(self.sizes_bytes)
        # A group can start only when the slowest node has the layer ready.
        return backward_from_offsets(np.max(np.array(offsets), axis=0))

    def _why_replan(self, cost: LinearCost, backward: list[float]) -> str:
        if self.cost is None:
            return "first plan"
        moved = []
        if relative_change(self.cost.alpha_s, cost.alpha_s) > DRIFT:
            moved.append(f"a {self.cost.alpha_s * 1e6:.0f}→{cost.alpha_s * 1e6:.0f} µs")
        if relative_change(self.cost.beta_s_per_byte, cost.beta_s_per_byte) > DRIFT:
            moved.append(f"b {self.cost.beta_s_per_byte * 1e9:.3f}→"
                         f"{cost.beta_s_per_byte * 1e9:.3f} ns/B")
        if profile_drift(self.backward_s, backward) > DRIFT:
            moved.append("backward profile")
        return ", ".join(moved)
