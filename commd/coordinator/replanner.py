"""The coordinator's per-job planning state: job-wide profile in, plan decisions out.

No I/O: the coordinator feeds it every node's report of a round and sends what it returns.
It re-plans when a, b or the backward profile drift beyond ``DRIFT`` since the last plan, and
with compression it also chooses the exchange per group and (``topk:auto``) the ratio.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from commd.compression.planning import (
    EXPLORE_RATIOS,
    RESOLVE_CHANGE,
    choose_exchange,
    compressed_cost,
    exchange_time,
    fit_gain,
    link_cost,
    pick_ratio,
)
from commd.compression.topk import CompressionSpec, parse_compression
from commd.coordinator.plan_search import PlanSearch
from commd.plan import LinearCost, evaluate, plan_with
from commd.plan.fitting import (
    allreduce_terms,
    backward_from_offsets,
    combine_comm,
    fit_terms,
    profile_drift,
    relative_change,
)
from commd_protocol import PeerProfile
from commd_protocol.peer import DECISION_LAG

DRIFT = 0.25  # relative change of a, b or the backward profile that triggers a re-plan
FALLBACK_COST = LinearCost(alpha_s=100e-6, beta_s_per_byte=1e-9)  # before any measurement
GAIN_MEMORY = 200  # (ratio, gain) observations kept for the gain model
SWITCH_GAIN = 0.01  # a drift re-plan must be predicted this much faster to replace the plan
SEARCHED_PLANNERS = ("optimal", "mgwfbp")  # the planners whose plans depend on a


@dataclass(frozen=True)
class Decision:
    effective_iteration: int
    version: int
    groups: list[list[int]]
    cost: LinearCost
    predicted_comm_s: float
    reason: str
    exchanges: list[str] = field(default_factory=list)
    ratio: float = 0.0
    overhead_s: float = 0.0  # the plan search's per-group overhead in the planning cost
    search: str = "off"  # the plan search's state: off, measuring, done


@dataclass
class Replanner:
    planner: str
    sizes_bytes: list[int]
    nodes: int = 1
    compression: str = "none"
    itemsize: int = 4
    version: int = 0
    groups: list[list[int]] = field(default_factory=list)
    exchanges: list[str] = field(default_factory=list)
    ratio: float = 0.0
    cost: LinearCost | None = None
    planning_cost: LinearCost | None = None
    backward_s: list[float] = field(default_factory=list)
    gains: list[tuple[float, float]] = field(default_factory=list)  # (ratio, gain)
    search: PlanSearch = field(default_factory=PlanSearch)
    _spec: CompressionSpec | None = None
    _ratio_basis: tuple[float, float, float] | None = None  # α, β, gain at the last solve

    def __post_init__(self) -> None:
        self._spec = parse_compression(self.compression)
        # Only plans that depend on a can be tuned by measuring; compressed jobs keep their
        # ratio exploration free of a second search.
        self.search.enabled = (self.planner in SEARCHED_PLANNERS and self.nodes > 1
                               and self._spec is None)

    def decide(self, reports: Sequence[PeerProfile]) -> Decision:
        """The plan for the round all ``reports`` (one per node) belong to."""
        round_number = reports[0].round
        samples = combine_comm([r.comm for r in reports])
        cost = self._fit(samples) or self.cost or FALLBACK_COST
        backward = self._backward(reports)
        for report in reports:
            self.gains.extend((r, g) for r, g in report.gains)
        self.gains = self.gains[-GAIN_MEMORY:]
        reason = self._why_replan(cost, backward)
        ratio, ratio_reason = self._choose_ratio(cost)
        search_reason = self._search(reports, cost, backward)
        reason = ", ".join(x for x in (reason, ratio_reason, search_reason) if x)
        if reason:
            previous = (self.groups, self.exchanges, self.ratio)
            self.cost, self.backward_s, self.ratio = cost, backward, ratio
            groups, exchanges, self.planning_cost = self._plan(cost, backward)
            forced = bool(search_reason or ratio_reason or self._spec is not None)
            if (groups, exchanges, ratio) != previous and (
                    forced or self._worth_switching(groups)):
                self.version += 1
                self.groups, self.exchanges = groups, exchanges
        assert self.cost is not None and self.planning_cost is not None
        timing = evaluate(self.groups, self.sizes_bytes, self.backward_s, self.planning_cost)
        last = max(r.iteration for r in reports)
        effective = 0 if round_number == 0 else last + 1 + DECISION_LAG
        return Decision(effective, self.version, self.groups, self.cost,
                        timing.exposed_comm_s, reason or "no drift", self.exchanges,
                        self.ratio, self.search.overhead_s, self.search.state)

    def _worth_switching(self, groups: list[list[int]]) -> bool:
        """A drift re-plan replaces the current plan only if the model expects it to be
        better by SWITCH_GAIN: noisy fits of a and b must not make the plan flap."""
        if not self.groups:
            return True
        assert self.planning_cost is not None
        current = evaluate(self.groups, self.sizes_bytes, self.backward_s, self.planning_cost)
        new = evaluate(groups, self.sizes_bytes, self.backward_s, self.planning_cost)
        return new.iteration_s < current.iteration_s * (1 - SWITCH_GAIN)

    # --- measuring plans ------------------------------------------------------------------------

    def _search(self, reports: Sequence[PeerProfile], cost: LinearCost,
                backward: list[float]) -> str:
        """Feed the plan search the round's step time, if the whole round ran our plan."""
        # Round 1 ran the plan made before any backward profile: not a fair trial.
        if reports[0].round < 2 or not self.groups:
            return ""
        if any(r.plan != self.version or r.step_s <= 0 for r in reports):
            return ""
        step_s = float(np.mean([r.step_s for r in reports]))

        def plan_for(overhead_s: float) -> list[list[int]]:
            return self._plan(cost, backward, overhead_s)[0]

        return self.search.observe(self.groups, step_s, cost.alpha_s, plan_for)

    # --- the network and the backward profile ------------------------------------------------

    def _fit(self, samples: list[tuple[int, int, float]]) -> LinearCost | None:
        """a, b from this round's collectives alone, so a change of network shows at once."""
        rows = [(*allreduce_terms(kind, nbytes, self.nodes), s) for kind, nbytes, s in samples]
        terms = {(ca, cb) for ca, cb, _ in rows}
        if len(terms) >= 2:
            return fit_terms(rows)
        if len(terms) == 1 and self.cost is not None:
            # One size (e.g. a single group) cannot separate a from b: keep the known
            # start-up cost and put the change on the bandwidth term.
            ((ca, cb),) = terms
            seconds = float(np.median([s for _, _, s in rows]))
            beta = max(0.0, (seconds - ca * self.cost.alpha_s) / max(cb, 1.0))
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

    # --- compression -------------------------------------------------------------------------

    def _elements(self, group: Sequence[int]) -> int:
        return max(1, sum(self.sizes_bytes[i] for i in group) // self.itemsize)

    def _plan(self, measured: LinearCost, backward: list[float],
              overhead_s: float | None = None) -> tuple[list[list[int]], list[str], LinearCost]:
        """Groups, per-group exchanges and the cost the plan was made with (the measured a
        plus the plan search's per-group overhead)."""
        overhead = self.search.overhead_s if overhead_s is None else overhead_s
        planning = LinearCost(measured.alpha_s + overhead, measured.beta_s_per_byte)
        spec = self._spec
        if spec is None:
            return plan_with(self.planner, self.sizes_bytes, backward, planning), [], planning
        link = link_cost(measured, self.nodes)
        best: tuple[float, list[list[int]], LinearCost] | None = None
        for exchange in ([spec.exchange] if spec.exchange != "auto"
                         else ["allgather", "allreduce"]):
            cost = compressed_cost(exchange, self.nodes, link, self.ratio, self.itemsize)
            groups = plan_with(self.planner, self.sizes_bytes, backward, cost)
            iteration = evaluate(groups, self.sizes_bytes, backward, cost).iteration_s
            if best is None or iteration < best[0]:
                best = (iteration, groups, cost)
        assert best is not None
        _, groups, cost = best
        exchanges = [choose_exchange(spec.exchange, self.nodes, link, self._elements(g),
                                     self.ratio) for g in groups]
        return groups, exchanges, cost

    def _choose_ratio(self, cost: LinearCost) -> tuple[float, str]:
        """(ratio, why it changed or ""): fixed, exploring, or solved on the Pareto front."""
        spec = self._spec
        if spec is None:
            return 0.0, ""
        if spec.ratio is not None:
            return spec.ratio, ""
        tried = {r for r, _ in self.gains}
        for ratio in EXPLORE_RATIOS:
            if ratio not in tried:
                return ratio, "" if ratio == self.ratio else f"exploring ratio {ratio:g}"
        model = fit_gain(self.gains)
        assert model is not None  # three ratios tried
        at_current = [g for r, g in self.gains[-20:] if r == self.ratio]
        gain_now = float(np.mean(at_current)) if at_current else float(model.gain(self.ratio))
        basis = (cost.alpha_s, cost.beta_s_per_byte, gain_now)
        if self._ratio_basis is not None and all(
            relative_change(old, new) < RESOLVE_CHANGE
            for old, new in zip(self._ratio_basis, basis, strict=True)
        ):
            return self.ratio, ""
        self._ratio_basis = basis
        link = link_cost(cost, self.nodes)
        groups = self.groups or [list(range(len(self.sizes_bytes)))]
        spec_exchange = spec.exchange

        def time_of(ratio: float) -> float:
            return sum(
                exchange_time(
                    choose_exchange(spec_exchange, self.nodes, link, self._elements(g), ratio),
                    self.nodes, link, self._elements(g), ratio,
                )
                for g in groups
            )

        ratio, _front = pick_ratio(time_of, model)
        changed = relative_change(self.ratio, ratio) >= RESOLVE_CHANGE
        return ratio, f"ratio {self.ratio:g}→{ratio:.4g} (Pareto/ASF)" if changed else ""
