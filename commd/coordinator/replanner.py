"""The coordinator's per-job planning state: job-wide profile in, plan decisions out.

No I/O: the coordinator feeds it every node's report of a round and sends what it returns.
The ``Replanner`` owns the dense re-planning: it fits a and b, re-plans with the pure
``commd.plan`` code when a, b or the backward profile drift beyond ``DRIFT`` since the last
plan, and runs the measured plan search. What the groups exchange (with compression: the
ratio, the exchange per group and its trials) is its ``PlanChoice``'s
(``commd.coordinator.choice``), which it reaches through that interface only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import InitVar, dataclass, field

import numpy as np

from commd.compression.topk import parse_compression
from commd.coordinator.choice import DenseChoice, PlanChoice, Planned, RoundPlanner
from commd.coordinator.compressed_choice import choice_for
from commd.coordinator.plan_search import PlanSearch, kept_groups
from commd.plan import LinearCost, evaluate
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
SWITCH_GAIN = 0.01  # a drift re-plan must be predicted this much faster to replace the plan
SEARCHED_PLANNERS = ("optimal", "mgwfbp")  # the planners whose plans depend on a


@dataclass(frozen=True)
class Decision:
    """One round's plan as the ``Replanner`` decides it: from which iteration it runs, its version
    and groups, the fitted cost and prediction, why, and what the choice and the plan search
    say. The coordinator sends it to every node as a ``PeerPlan``."""

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
    # compressed jobs: how the exchange was chosen (forced, exploring, measuring, measured)
    # and (candidate, predicted s, measured s or -1) per candidate
    selection: str = ""
    candidates: list[tuple[str, float, float]] = field(default_factory=list)
    choice: str = ""  # what the exchange in force is and why (``ChoiceStatus.why``)


@dataclass
class Replanner:
    """One job's plans on its coordinator: the plan in force (version, groups, exchanges, ratio),
    the fitted a, b and backward profile it was made from, the plan search, and the
    ``PlanChoice`` of what the groups exchange."""

    planner: str
    sizes_bytes: list[int]
    nodes: int = 1
    # A shorthand where no ``choice`` is given: the job's compression, as registered, and
    # its gradients' item size (the coordinator composes the choice: ``replanner_for``).
    compression: InitVar[str] = "none"
    itemsize: InitVar[int] = 4
    version: int = 0
    groups: list[list[int]] = field(default_factory=list)
    exchanges: list[str] = field(default_factory=list)
    ratio: float = 0.0
    cost: LinearCost | None = None
    planning_cost: LinearCost | None = None
    backward_s: list[float] = field(default_factory=list)
    search: PlanSearch = field(default_factory=PlanSearch)
    choice: PlanChoice = field(default_factory=DenseChoice)  # what the groups exchange

    def __post_init__(self, compression: str, itemsize: int) -> None:
        if parse_compression(compression) is not None:
            sizes = [size // itemsize for size in self.sizes_bytes]
            self.choice = choice_for(compression, self.nodes, itemsize, sizes)
        # Only plans that depend on a can be tuned by measuring. A compressed job searches
        # the plan of what its trials chose, once chosen (``CompressedChoice.search``).
        self.search.enabled = self._searchable()
        if self._searchable():
            self.search = self.choice.search(self.search)

    def resize(self, nodes: int) -> None:
        """A tolerant job's new membership: later rounds fit the link and cost the exchanges
        for ``nodes``; the plan in force runs on until a round's decision re-plans."""
        self.nodes = nodes
        self.choice.resize(nodes)

    def decide(self, reports: Sequence[PeerProfile]) -> Decision:
        """The plan for the round all ``reports`` (one per node) belong to."""
        round_number = reports[0].round
        samples = combine_comm([r.comm for r in reports])
        choice = self.choice
        cost = (choice.network(self._fit(samples), reports, self.version) or self.cost
                or FALLBACK_COST)
        backward = self._backward(reports)
        reason = self._why_replan(cost, backward)
        whole_round = all(r.plan == self.version for r in reports) and bool(self.groups)
        # The plan search's rounds move the step time on purpose: not a changed network.
        choice_reason = choice.observe(reports, whole_round and not self.search.trying,
                                       self.groups, cost, self._round_planner(backward))
        if not choice.replans_on_drift and self.groups and not choice_reason:
            reason = ""
        if self._searchable():
            self.search = choice.search(self.search)
        searching = self.search.enabled and not self.search.done
        search_reason = self._search(reports, cost, backward)
        if searching and self.search.done:
            best = self.search.best
            assert best is not None
            search_reason = ", ".join(
                x for x in (search_reason, choice.searched(best.step_s)) if x)
        reason = ", ".join(x for x in (reason, choice_reason, search_reason) if x)
        if reason:
            previous = (self.groups, self.exchanges, self.ratio)
            self.cost, self.backward_s = cost, backward
            overhead = choice.overhead_s(self.search, running=False)
            groups, exchanges, self.planning_cost, ratio = self._plan(cost, backward, overhead)
            if searching and self.search.done:
                groups, exchanges = self._measured_best(groups, exchanges)
            forced = bool(search_reason or choice_reason)
            if (groups, exchanges, ratio) != previous and (
                    forced or self._worth_switching(groups)):
                self.version += 1
                self.groups, self.exchanges, self.ratio = groups, exchanges, ratio
                choice.applied(overhead)
        assert self.cost is not None and self.planning_cost is not None
        timing = evaluate(self.groups, self.sizes_bytes, self.backward_s, self.planning_cost)
        last = max(r.iteration for r in reports)
        effective = 0 if round_number == 0 else last + 1 + DECISION_LAG
        status = choice.status()
        # a decision that changed no plan (a re-solve that kept the ratio) still reaches the
        # log; joined after the replan above, so it causes none
        said = ", ".join(x for x in (reason, status.note) if x)
        return Decision(effective, self.version, self.groups, self.cost,
                        timing.exposed_comm_s, said or "no drift", self.exchanges,
                        self.ratio, choice.overhead_s(self.search, running=True),
                        self.search.state, status.selection, status.candidates,
                        status.why)

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

    def _searchable(self) -> bool:
        return self.planner in SEARCHED_PLANNERS and self.nodes > 1

    def _measured_best(self, groups: list[list[int]], exchanges: list[str]
                       ) -> tuple[list[list[int]], list[str]]:
        """The plan search's kept trial as it ran, in place of the model's plan for its
        overhead (``groups``): the profile has moved since, and the model's plan with it."""
        kept = kept_groups(self.search, self.search.overhead_s)
        if not kept:
            return groups, exchanges
        return kept, [exchanges[0]] * len(kept) if exchanges else []

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

    # --- planning ----------------------------------------------------------------------------

    def _round_planner(self, backward: list[float]) -> RoundPlanner:
        return RoundPlanner(self.planner, self.sizes_bytes, backward)

    def _plan(self, measured: LinearCost, backward: list[float],
              overhead_s: float | None = None) -> Planned:
        """Groups, per-group exchanges, the cost the plan was made with (the measured a plus
        the plan search's per-group overhead) and the ratio, as the choice plans them."""
        overhead = (self.choice.overhead_s(self.search, running=False) if overhead_s is None
                    else overhead_s)
        return self.choice.plan(measured, overhead, self._round_planner(backward))
