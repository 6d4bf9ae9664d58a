"""A compressed job's choice of what its groups exchange, as the ``Replanner`` plans it.

``CompressedChoice`` is the one owner of a compressed job's decisions on the coordinator: it
holds the ``CompressionPolicy`` (the top-k ratio, the candidates and their
``ExchangeTrials``), the candidate the plan being made runs, the network's a, b as the dense
rounds measured them, and one plan search per candidate the trials settled on. The
``Replanner`` reaches it through ``PlanChoice`` (``commd.coordinator.choice``) only.

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from commd.compression.planning import compressed_cost, link_cost
from commd.compression.spec import (
    AutoSpec,
    CompressionSpec,
    HalfSpec,
    LowRankSpec,
    parse_compression,
)
from commd.coordinator.auto_choice import AutoChoice
from commd.coordinator.choice import (
    ChoiceStatus,
    DenseChoice,
    PlanChoice,
    Planned,
    RoundPlanner,
    dense_plan,
)
from commd.coordinator.compression_policy import CompressionPolicy
from commd.coordinator.exchange_trials import DENSE, Candidate
from commd.coordinator.lowrank_choice import HalfChoice, LowRankChoice
from commd.coordinator.plan_search import MAX_OVERHEAD_S, PlanSearch, kept_groups
from commd.plan import LinearCost
from commd_protocol import PeerProfile

# Plan searches a compressed job keeps (one per candidate settled on; every re-measuring of
# the exchanges may settle on a new ratio): the oldest goes first.
MAX_SEARCHES = 8


def choice_for(compression: str, nodes: int, itemsize: int, sizes: Sequence[int] = (),
               rows: Sequence[int] = (), device: str = "cpu") -> PlanChoice:
    """The choice of a job registered with ``compression`` among ``nodes`` nodes, whose
    layers have ``sizes`` elements and ``rows`` matrix rows (forward order), its buffers on
    ``device``."""
    spec = parse_compression(compression)
    if spec is None or (isinstance(spec, AutoSpec) and device != "cpu"):
        return DenseChoice()  # a device job's `auto`: dense (its nodes run it so: Pipeline)
    if isinstance(spec, AutoSpec):
        # half-precision gradients stay dense (the nodes run them so: ``Pipeline``)
        return AutoChoice(nodes, list(sizes), list(rows)) if itemsize >= 4 else DenseChoice()
    if isinstance(spec, LowRankSpec):
        return LowRankChoice(spec, list(sizes), list(rows))
    if isinstance(spec, HalfSpec):
        return HalfChoice() if itemsize >= 4 else DenseChoice()
    if spec.ratio is None and nodes <= 1:
        # `topk:auto` on one node: no network to save, only loss to lose (it once measured
        # allreduce@0.1 0.3 ms faster than dense and ended at 11.05 against dense's 0.026)
        return DenseChoice()
    return CompressedChoice(spec, nodes, itemsize)


@dataclass
class CompressedChoice:
    """A top-k job's ``PlanChoice``: its ``CompressionPolicy``, the candidate the next plan runs,
    the network's a, b from rounds that ran dense, and one plan search per candidate the
    trials settled on (see the module's docstring)."""

    spec: CompressionSpec
    nodes: int
    itemsize: int = 4
    policy: CompressionPolicy = field(init=False)
    next: Candidate | None = None  # what the plan being made runs
    _network_epoch: int = -1  # the trial epoch a, b were last fitted in
    _network_cost: LinearCost | None = None  # a, b from dense collectives
    # one plan search per candidate the trials chose (``search``)
    searches: dict[Candidate, PlanSearch] = field(default_factory=dict)
    _overhead_in_force: float = 0.0  # the per-group overhead the plan in force was made with

    # A compressed job keeps the plan its candidate was measured with: drift shows in the
    # measured step, and the trials' watch acts on that.
    replans_on_drift = False

    def __post_init__(self) -> None:
        self.policy = CompressionPolicy(self.spec, self.nodes, self.itemsize)

    def resize(self, nodes: int) -> None:
        self.nodes = self.policy.nodes = nodes

    def network(self, fitted: LinearCost | None, reports: Sequence[PeerProfile],
                version: int) -> LinearCost | None:
        """The network's a, b. A compressed job's few small collectives, timed between CPU
        work on nodes that arrive at different moments, say little about the network: its
        a, b come from the start-up probe and from rounds that ran dense only."""
        if fitted is None:
            return None
        probe = reports[0].round == 0
        dense = (self.policy.running == DENSE and all(r.plan == version for r in reports))
        if probe or dense or self._network_cost is None:
            self._network_epoch = self.policy.trials.epoch
            self._network_cost = fitted
        return self._network_cost

    def observe(self, reports: Sequence[PeerProfile], measurable: bool,
                groups: list[list[int]], cost: LinearCost, planner: RoundPlanner) -> str:
        """Feed the policy the round and choose what the next plan runs; returns why the
        compressed plan changes ("" if not)."""
        policy = self.policy
        retrial = policy.observe(reports, measurable)
        groups = groups or [list(range(len(planner.sizes_bytes)))]

        def predict(candidate: Candidate) -> float:
            planned, line = self._plan_candidate(candidate, cost, planner,
                                                 self.overhead_of(candidate))
            return planner.seconds(planned, line)

        # Dense is measured in any case when a, b predate the latest re-measuring for a
        # moved step time (one for the ratio alone leaves them current).
        stale = self._network_epoch < policy.trials.network_epoch
        elements = [max(1, sum(planner.sizes_bytes[i] for i in g) // self.itemsize)
                    for g in groups]
        self.next, why = policy.choose(cost, elements, predict, measure_dense=stale)
        changed = self.next != policy.running
        return ", ".join(x for x in (retrial, why if changed or retrial else "") if x)

    def search(self, current: PlanSearch) -> PlanSearch:
        """A compressed job searches the plan of the candidate its trials chose, once a whole
        round ran it, like a dense job: the model's plan can be much slower than fewer groups
        (at 1 Gbit/s ``allgather@0.01``'s 5 groups ran 90–100 ms, one group 74 ms: selections
        compete with the backward pass for the cores). One search per candidate (a new ratio
        is a new candidate); the others' rounds pause it. A forced exchange searches once its
        ratio is settled."""
        policy = self.policy
        chosen = policy.settled
        if chosen is not None and policy.running == chosen == self.next:
            if chosen not in self.searches and len(self.searches) >= MAX_SEARCHES:
                del self.searches[next(iter(self.searches))]
            # A finalist chosen on another's searched plan (trials.replanned) goes on from it.
            return self.searches.setdefault(
                chosen, PlanSearch(overhead_s=self._overhead_in_force))
        return PlanSearch(enabled=False)

    def searched(self, step_s: float) -> str:
        """The running candidate's search kept a plan measuring ``step_s``: the trials watch
        that from now on, and its close rivals run once more with it."""
        assert self.policy.running is not None
        return self.policy.trials.replanned(self.policy.running, step_s)

    def overhead_s(self, search: PlanSearch, running: bool) -> float:
        return self.overhead_of(self.policy.running if running else self.next)

    def overhead_of(self, candidate: Candidate | None) -> float:
        """The per-group overhead ``candidate`` is planned with: its search's, or for a
        finalist measured again the search's of the candidate it lends its plan from
        (``ExchangeTrials.replanned``), else 0 (the model's plan)."""
        if candidate is None:
            return 0.0
        if self.policy.exploring and candidate.exchange != "dense":
            # `topk:auto`'s explored ratios are compared by their steps, so each runs one
            # group, the first plan's: run as the model's groups for their ratio, a sparse
            # ratio pays a start-up per group that one group does not, and its step looks
            # worse than its ratio makes it. The chosen ratio's plan is searched after.
            return MAX_OVERHEAD_S
        search = self.searches.get(candidate)
        lender = self.policy.trials.lender(candidate)
        if search is None and lender is not None:
            search = self.searches.get(lender)
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
        searched = [(c, best) for c, s in self.searches.items()
                    if c.exchange != "dense" and (best := s.best) is not None]
        if not searched:
            return 0.0
        _, nearest = min(searched, key=lambda item: (
            item[0].exchange != candidate.exchange,
            abs(np.log(item[0].ratio / candidate.ratio)), item[0]))
        return nearest.overhead_s

    def plan(self, measured: LinearCost, overhead_s: float, planner: RoundPlanner) -> Planned:
        """Groups, per-group exchanges and the cost line that predicts them, of the candidate
        the next plan runs."""
        if self.next is None:
            return dense_plan(planner, measured, overhead_s, self.policy.ratio)
        groups, line = self._plan_candidate(self.next, measured, planner, overhead_s)
        groups = self._kept_plan(self.next, overhead_s) or groups
        return Planned(groups, [self.next.exchange] * len(groups), line, self.policy.ratio)

    def _plan_candidate(self, candidate: Candidate, measured: LinearCost,
                        planner: RoundPlanner, overhead_s: float
                        ) -> tuple[list[list[int]], LinearCost]:
        """A candidate's groups and the cost line that predicts them. The plan is made with
        the plan search's per-group overhead ``overhead_s`` on top, which the prediction
        leaves out: the search's overhead only shapes the plan."""
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
        return planner.plan(planning), line

    def _kept_plan(self, candidate: Candidate, overhead_s: float) -> list[list[int]]:
        """The groups that ``candidate``'s finished plan search kept (for a finalist measured
        again, its lender's), as they ran, where it is planned with that search's overhead;
        [] otherwise. A candidate chosen again later (after a finalist's round, or as the
        watch's runner-up) runs what its search measured, not the model's plan for the
        overhead, which moves with the profile: dense came back on loopback as 10 groups at
        63 ms where its search had kept 4 at 48."""
        search = self.searches.get(candidate)
        lender = self.policy.trials.lender(candidate)
        if (search is None or not search.done) and lender is not None:
            search = self.searches.get(lender)
        return kept_groups(search, overhead_s)

    def applied(self, overhead_s: float) -> None:
        self._overhead_in_force = overhead_s
        self.policy.running = self.next

    def status(self) -> ChoiceStatus:
        return ChoiceStatus(self.policy.state, self.policy.trials.table(),
                            self.policy.take_note())
