"""The coordinator's per-job planning state: job-wide profile in, plan decisions out.

No I/O: the coordinator feeds it every node's report of a round and sends what it returns.
It re-plans when a, b or the backward profile drift beyond ``DRIFT`` since the last plan, and
with compression it also chooses the exchange per group and (``topk:auto``) the ratio.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from commd.compression.planning import compressed_cost, link_cost
from commd.compression.topk import parse_compression
from commd.coordinator.compression_policy import CompressionPolicy
from commd.coordinator.exchange_trials import DENSE, Candidate
from commd.coordinator.plan_search import MAX_OVERHEAD_S, PlanSearch
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
SWITCH_GAIN = 0.01  # a drift re-plan must be predicted this much faster to replace the plan
SEARCHED_PLANNERS = ("optimal", "mgwfbp")  # the planners whose plans depend on a
# Plan searches a compressed job keeps (one per candidate settled on; every re-measuring of
# the exchanges may settle on a new ratio): the oldest goes first.
MAX_SEARCHES = 8


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
    # compressed jobs: how the exchange was chosen (forced, exploring, measuring, measured)
    # and (candidate, predicted s, measured s or -1) per candidate
    selection: str = ""
    candidates: list[tuple[str, float, float]] = field(default_factory=list)


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
    search: PlanSearch = field(default_factory=PlanSearch)
    policy: CompressionPolicy | None = None  # None: a dense job
    _next: Candidate | None = None  # what the plan being made runs (compressed jobs)
    _network_epoch: int = -1  # compressed jobs: the trial epoch a, b were last fitted in
    _network_cost: LinearCost | None = None  # compressed jobs: a, b from dense collectives
    # compressed jobs: one plan search per candidate the trials chose (``_enable_search``)
    _searches: dict[Candidate, PlanSearch] = field(default_factory=dict)
    _overhead_in_force: float = 0.0  # the per-group overhead the plan in force was made with

    def __post_init__(self) -> None:
        spec = parse_compression(self.compression)
        if spec is not None:
            self.policy = CompressionPolicy(spec, self.nodes, self.itemsize)
        # Only plans that depend on a can be tuned by measuring. A compressed job searches
        # the plan of what its trials chose, once chosen (``_enable_search``).
        self.search.enabled = self._searchable() and spec is None

    def resize(self, nodes: int) -> None:
        """A tolerant job's new membership: later rounds fit the link and cost the exchanges
        for ``nodes``; the plan in force runs on until a round's decision re-plans."""
        self.nodes = nodes
        if self.policy is not None:
            self.policy.nodes = nodes

    def decide(self, reports: Sequence[PeerProfile]) -> Decision:
        """The plan for the round all ``reports`` (one per node) belong to."""
        round_number = reports[0].round
        samples = combine_comm([r.comm for r in reports])
        cost = self._network(self._fit(samples), reports) or self.cost or FALLBACK_COST
        backward = self._backward(reports)
        reason = self._why_replan(cost, backward)
        compression_reason = self._compression(reports, cost, backward)
        if self.policy is not None and self.groups and not compression_reason:
            # A compressed job keeps the plan its candidate was measured with: drift shows in
            # the measured step, and the trials' watch acts on that.
            reason = ""
        self._enable_search()
        searching = self.search.enabled and not self.search.done
        search_reason = self._search(reports, cost, backward)
        if searching and self.search.done and self.policy is not None:
            best = self.search.best
            assert best is not None and self.policy.running is not None
            search_reason = ", ".join(x for x in (search_reason, self.policy.trials.replanned(
                self.policy.running, best.step_s)) if x)
        reason = ", ".join(x for x in (reason, compression_reason, search_reason) if x)
        if reason:
            previous = (self.groups, self.exchanges, self.ratio)
            self.cost, self.backward_s = cost, backward
            overhead = self._overhead_of(self._next)
            groups, exchanges, self.planning_cost = self._plan(cost, backward, overhead)
            if searching and self.search.done:
                groups, exchanges = self._measured_best(groups, exchanges)
            ratio = self.policy.ratio if self.policy is not None else 0.0
            forced = bool(search_reason or compression_reason)
            if (groups, exchanges, ratio) != previous and (
                    forced or self._worth_switching(groups)):
                self.version += 1
                self.groups, self.exchanges, self.ratio = groups, exchanges, ratio
                self._overhead_in_force = overhead
                if self.policy is not None:
                    self.policy.running = self._next
        assert self.cost is not None and self.planning_cost is not None
        timing = evaluate(self.groups, self.sizes_bytes, self.backward_s, self.planning_cost)
        last = max(r.iteration for r in reports)
        effective = 0 if round_number == 0 else last + 1 + DECISION_LAG
        policy = self.policy
        # a decision that changed no plan (a re-solve that kept the ratio) still reaches the
        # log; joined after the replan above, so it causes none
        said = ", ".join(x for x in (reason, policy.take_note() if policy else "") if x)
        return Decision(effective, self.version, self.groups, self.cost,
                        timing.exposed_comm_s, said or "no drift", self.exchanges,
                        self.ratio, self._overhead_of(policy.running if policy else None),
                        self.search.state,
                        policy.state if policy else "",
                        policy.trials.table() if policy else [])

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

    def _enable_search(self) -> None:
        """A compressed job searches the plan of the candidate its trials chose, once a whole
        round ran it, like a dense job: the model's plan can be much slower than fewer groups
        (at 1 Gbit/s ``allgather@0.01``'s 5 groups ran 90–100 ms, one group 74 ms: selections
        compete with the backward pass for the cores). One search per candidate (a new ratio
        is a new candidate); the others' rounds pause it. A forced exchange searches once its
        ratio is settled."""
        policy = self.policy
        if policy is None or not self._searchable():
            return
        chosen = policy.settled
        if chosen is not None and policy.running == chosen == self._next:
            if chosen not in self._searches and len(self._searches) >= MAX_SEARCHES:
                del self._searches[next(iter(self._searches))]
            # A finalist chosen on another's searched plan (trials.replanned) goes on from it.
            self.search = self._searches.setdefault(
                chosen, PlanSearch(overhead_s=self._overhead_in_force))
        else:
            self.search = PlanSearch(enabled=False)

    def _measured_best(self, groups: list[list[int]], exchanges: list[str]
                       ) -> tuple[list[list[int]], list[str]]:
        """The plan search's kept trial as it ran, in place of the model's plan for its
        overhead (``groups``): the profile has moved since, and the model's plan with it."""
        kept = _kept_groups(self.search, self.search.overhead_s)
        if not kept:
            return groups, exchanges
        return kept, [exchanges[0]] * len(kept) if exchanges else []

    def _overhead_of(self, candidate: Candidate | None) -> float:
        """The per-group overhead ``candidate`` is planned with: its search's, or for a
        finalist measured again the search's of the candidate it lends its plan from
        (``ExchangeTrials.replanned``), else 0 (the model's plan)."""
        if self.policy is None:
            return self.search.overhead_s
        if candidate is None:
            return 0.0
        if self.policy.exploring and candidate.exchange != "dense":
            # `topk:auto`'s explored ratios are compared by their steps, so each runs one
            # group, the first plan's: run as the model's groups for their ratio, a sparse
            # ratio pays a start-up per group that one group does not, and its step looks
            # worse than its ratio makes it. The chosen ratio's plan is searched after.
            return MAX_OVERHEAD_S
        search = self._searches.get(candidate)
        lender = self.policy.trials.lender(candidate)
        if search is None and lender is not None:
            search = self._searches.get(lender)
        if search is None and candidate.exchange != "dense":
            return self._nearest_searched_overhead(candidate)
        return search.overhead_s if search is not None else 0.0

    def _nearest_searched_overhead(self, candidate: Candidate) -> float:
        """The overhead of the fastest plan measured so far for the nearest compressed
        candidate (the same exchange first, then the nearest ratio), else 0. The per-group
        cost a search measures (selections competing with the backward pass for the cores,
        wake-ups) belongs to the node and the job more than to the ratio: a new ratio's
        trial and search start from it, where from the model's plan a `topk:auto` job spent
        its steps searching again after each ratio re-solve (0.025 → 0.048: 7 groups again,
        68 ms a step where the search had reached 2 groups at 60)."""
        searched = [(c, best) for c, s in self._searches.items()
                    if c.exchange != "dense" and (best := s.best) is not None]
        if not searched:
            return 0.0
        _, nearest = min(searched, key=lambda item: (
            item[0].exchange != candidate.exchange,
            abs(np.log(item[0].ratio / candidate.ratio)), item[0]))
        return nearest.overhead_s

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

    def _network(self, fitted: LinearCost | None,
                 reports: Sequence[PeerProfile]) -> LinearCost | None:
        """The network's a, b. A compressed job's few small collectives, timed between CPU
        work on nodes that arrive at different moments, say little about the network: its
        a, b come from the start-up probe and from rounds that ran dense only."""
        policy = self.policy
        if policy is None or fitted is None:
            return fitted
        probe = reports[0].round == 0
        dense = (policy.running == DENSE and all(r.plan == self.version for r in reports))
        if probe or dense or self._network_cost is None:
            self._network_epoch = policy.trials.epoch
            self._network_cost = fitted
        return self._network_cost

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

    def _compression(self, reports: Sequence[PeerProfile], cost: LinearCost,
                     backward: list[float]) -> str:
        """Feed the policy the round; returns why the compressed plan changes ("" if not)."""
        policy = self.policy
        if policy is None:
            return ""
        whole_round = all(r.plan == self.version for r in reports) and bool(self.groups)
        # The plan search's rounds move the step time on purpose: not a changed network.
        retrial = policy.observe(reports, whole_round and not self.search.trying)
        groups = self.groups or [list(range(len(self.sizes_bytes)))]

        def predict(candidate: Candidate) -> float:
            planned, line = self._plan_candidate(candidate, cost, backward,
                                                 self._overhead_of(candidate))
            return evaluate(planned, self.sizes_bytes, backward, line).iteration_s

        # Dense is measured in any case when a, b predate the latest re-measuring for a
        # moved step time (one for the ratio alone leaves them current).
        stale = self._network_epoch < policy.trials.network_epoch
        self._next, why = policy.choose(cost, [self._elements(g) for g in groups], predict,
                                        measure_dense=stale)
        changed = self._next != policy.running
        return ", ".join(x for x in (retrial, why if changed or retrial else "") if x)

    def _plan_candidate(self, candidate: Candidate, measured: LinearCost,
                        backward: list[float], overhead_s: float
                        ) -> tuple[list[list[int]], LinearCost]:
        """A candidate's groups and the cost line that predicts them. The plan is made with
        the plan search's per-group overhead ``overhead_s`` on top, which the prediction
        leaves out: the search's overhead only shapes the plan."""
        assert self.policy is not None
        if candidate.exchange != "dense":
            line = compressed_cost(candidate.exchange, self.nodes,
                                   link_cost(measured, self.nodes), candidate.ratio,
                                   self.itemsize, self.policy.cpu)
        else:
            # The daemon's own cost per group (wake-ups, completions) holds for dense groups
            # too; without it noisy fits split the plan into dozens of groups.
            line = LinearCost(measured.alpha_s + self.policy.cpu.per_group_s,
                              measured.beta_s_per_byte)
        planning = LinearCost(line.alpha_s + overhead_s, line.beta_s_per_byte)
        return plan_with(self.planner, self.sizes_bytes, backward, planning), line

    def _plan(self, measured: LinearCost, backward: list[float],
              overhead_s: float | None = None) -> tuple[list[list[int]], list[str], LinearCost]:
        """Groups, per-group exchanges and the cost the plan was made with (the measured a
        plus the plan search's per-group overhead)."""
        overhead = self._overhead_of(self._next) if overhead_s is None else overhead_s
        planning = LinearCost(measured.alpha_s + overhead, measured.beta_s_per_byte)
        if self.policy is None or self._next is None:
            return plan_with(self.planner, self.sizes_bytes, backward, planning), [], planning
        groups, line = self._plan_candidate(self._next, measured, backward, overhead)
        groups = self._kept_plan(self._next, overhead) or groups
        return groups, [self._next.exchange] * len(groups), line

    def _kept_plan(self, candidate: Candidate, overhead_s: float) -> list[list[int]]:
        """The groups that ``candidate``'s finished plan search kept (for a finalist measured
        again, its lender's), as they ran, where it is planned with that search's overhead;
        [] otherwise. A candidate chosen again later (after a finalist's round, or as the
        watch's runner-up) runs what its search measured, not the model's plan for the
        overhead, which moves with the profile: dense came back on loopback as 10 groups at
        63 ms where its search had kept 4 at 48."""
        assert self.policy is not None
        search = self._searches.get(candidate)
        lender = self.policy.trials.lender(candidate)
        if (search is None or not search.done) and lender is not None:
            search = self._searches.get(lender)
        return _kept_groups(search, overhead_s)


def _kept_groups(search: PlanSearch | None, overhead_s: float) -> list[list[int]]:
    """The groups a finished ``search`` kept, as they ran, where the plan is made with its
    kept trial's overhead ``overhead_s``; [] otherwise."""
    best = search.best if search is not None and search.done else None
    if best is None or not best.plan or best.overhead_s != overhead_s:
        return []
    return [list(group) for group in best.plan]
