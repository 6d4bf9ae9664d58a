"""``compression="auto"``: dense, or PowerSGD where the measured network pays for it.

The choice is made on the running job, from what its own rounds measure, in three steps:

1. **Is the network the bottleneck?** The first report round runs dense. Its nodes measure
   the step and the communication the backward pass did not hide (``measured_comm_s``). On
   one node nothing crosses a network, and where the exposed communication is under
   ``NETWORK_SHARE`` of the step there is little to save: the job stays dense for good. Those
   two numbers separate a fast link from a slow one by a wide margin (loopback: a few per
   cent; 1 Gbit/s for a 3 M parameter model: about half), so the same command decides the
   same way.
2. **Low-rank, measured against dense.** Otherwise the groups run PowerSGD at ``AUTO_RANK``
   (error feedback, warm start; all-reduce compatible, so the plan stays the job's planner's)
   for ``WATCH_ROUNDS`` rounds. Unless their median step is at most ``PAYS`` × dense's, the
   job goes back to dense for good (what PowerSGD held back is sent with the next dense
   groups).
3. **The loss is watched.** Each low-rank round reports how much of the nodes' input the
   approximation carried (1 − ‖E‖²/‖M‖²). PowerSGD's error feedback delivers the rest later;
   where the approximation carries under ``GAIN_FLOOR`` for ``GAIN_ROUNDS`` rounds in a row
   the error memory grows faster than it drains, the updates fall behind dense's, and the
   job goes back to dense.

Every step says why, with its numbers, in the plan's reason (the daemon's log, ``commd
status`` and a finished job's last record there) and in the candidates' table.

Top-k is not among ``auto``'s candidates: at the same bytes on the wire it loses loss where
PowerSGD does not (docs/compression.md); ``topk:auto`` stays for those who want it.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from commd.compression.lowrank import LOW_RANK
from commd.compression.spec import AUTO_RANK, LowRankSpec
from commd.coordinator.choice import ChoiceStatus, Planned, RoundPlanner, dense_plan
from commd.coordinator.lowrank_choice import LowRankChoice
from commd.coordinator.plan_search import PlanSearch
from commd.plan import LinearCost
from commd_protocol import PeerProfile

DENSE = "dense"
NETWORK_SHARE = 0.15  # exposed communication / step from which compression may pay
MAX_WIRE_SHARE = 0.5  # a low-rank exchange sending more than this of the dense bytes: no gain
WATCH_ROUNDS = 2  # low-rank rounds measured before the comparison with dense
PAYS = 0.9  # low-rank's median step must be at most this × dense's
GAIN_FLOOR = 0.05  # the approximation carrying less than this of the input ...
GAIN_ROUNDS = 3  # ... this many rounds in a row: back to dense


@dataclass
class AutoChoice:
    nodes: int
    sizes: Sequence[int]  # elements per layer, forward order
    rows: Sequence[int]  # matrix rows per layer (0: a vector)
    low_rank: LowRankChoice = field(init=False)
    running: str = DENSE  # what the plan in force runs
    next: str = DENSE  # what the plan being made runs
    settled: bool = False  # the choice is final (only the loss guard may still undo it)
    dense_step_s: float = 0.0  # measured, the dense round
    dense_comm_s: float = 0.0  # exposed communication of that round
    low_rank_steps: list[float] = field(default_factory=list)
    low_gain_rounds: int = 0  # low-rank rounds in a row under GAIN_FLOOR
    last_gain: float = -1.0
    predicted: dict[str, float] = field(default_factory=dict)  # candidate -> model's s
    _network_cost: LinearCost | None = None  # a, b from the probe and rounds that ran dense
    _note: str = ""  # said once, in the round's reason (the log)
    verdict: str = ""  # what runs and why, kept for status
    _searches: dict[str, PlanSearch] = field(default_factory=dict)

    # a, b and the backward profile re-plan the groups of whichever exchange runs
    replans_on_drift = True

    def __post_init__(self) -> None:
        self.low_rank = LowRankChoice(LowRankSpec(AUTO_RANK, start=0), self.sizes, self.rows)

    @property
    def low_rank_name(self) -> str:
        return f"{LOW_RANK}:{AUTO_RANK}"

    def resize(self, nodes: int) -> None:
        self.nodes = nodes
        if nodes <= 1 and self.running != DENSE:
            self._decide(DENSE, "auto: dense: one node left, nothing crosses a network")

    def network(self, fitted: LinearCost | None, reports: Sequence[PeerProfile],
                version: int) -> LinearCost | None:
        """a, b from the start-up probe and from rounds that ran dense only: low-rank
        collectives time the other node's products as much as the wire (``LowRankChoice``)."""
        dense = self.running == DENSE and all(r.plan == version for r in reports)
        if fitted is not None and (reports[0].round == 0 or dense
                                   or self._network_cost is None):
            self._network_cost = fitted
        return self._network_cost

    def observe(self, reports: Sequence[PeerProfile], measurable: bool,
                groups: list[list[int]], cost: LinearCost, planner: RoundPlanner) -> str:
        """Feed the round; returns why the plan changes ("" if not)."""
        self._predict(cost, planner)
        if self.nodes <= 1:
            if not self.settled:
                self._settle("auto: dense: one node, nothing crosses a network")
            return ""
        steps = [r.step_s for r in reports]
        if reports[0].round < 1 or not measurable or min(steps) <= 0:
            return ""
        step_s = statistics.fmean(steps)
        comm_s = statistics.fmean(r.measured_comm_s for r in reports)
        if self.running == DENSE:
            return self._observe_dense(step_s, comm_s)
        return self._observe_low_rank(step_s, reports)

    def _observe_dense(self, step_s: float, comm_s: float) -> str:
        self.dense_step_s, self.dense_comm_s = step_s, comm_s
        if self.settled:
            return ""
        share = comm_s / step_s
        measured = (f"the network held {share:.0%} of the dense step ({comm_s * 1e3:.1f} of "
                    f"{step_s * 1e3:.1f} ms)")
        if share < NETWORK_SHARE:
            self._settle(f"auto: dense: {measured}, under {NETWORK_SHARE:.0%}")
            return ""
        wire = self.low_rank.wire_share
        if wire > MAX_WIRE_SHARE:
            self._settle(f"auto: dense: {measured}, but rank {AUTO_RANK} would send "
                         f"{wire:.0%} of the bytes (few layers are matrices)")
            return ""
        return self._decide(LOW_RANK, f"auto: low-rank (PowerSGD rank {AUTO_RANK}, "
                                      f"{wire:.1%} of the bytes): {measured}")

    def _observe_low_rank(self, step_s: float, reports: Sequence[PeerProfile]) -> str:
        self.low_rank_steps.append(step_s)
        gains = [row[1] for r in reports for row in r.gains if len(row) >= 2]
        self.last_gain = statistics.fmean(gains) if gains else 1.0
        self.low_gain_rounds = self.low_gain_rounds + 1 if self.last_gain < GAIN_FLOOR else 0
        if self.low_gain_rounds >= GAIN_ROUNDS:
            self.settled = True
            return self._decide(DENSE, (
                f"auto: back to dense: the low-rank sums carried {self.last_gain:.1%} of the "
                f"input (under {GAIN_FLOOR:.0%}) {GAIN_ROUNDS} rounds in a row; tried "
                f"{self.verdict.removeprefix('auto: ')}"))
        if self.settled or len(self.low_rank_steps) < WATCH_ROUNDS:
            return ""
        self.settled = True
        low = statistics.median(self.low_rank_steps)
        versus = (f"low-rank {low * 1e3:.1f} ms a step against dense "
                  f"{self.dense_step_s * 1e3:.1f} ms")
        first = self.verdict.removeprefix("auto: ")
        if low > PAYS * self.dense_step_s:
            return self._decide(DENSE, f"auto: back to dense: {versus}, not under "
                                       f"{PAYS:g}×; tried {first}")
        self._settle(f"auto: keeps low-rank: {versus} ({low / self.dense_step_s:.2f}×); "
                     f"{first}")
        return ""

    def _decide(self, exchange: str, why: str) -> str:
        self.next = exchange
        self.verdict = why
        return why

    def _settle(self, why: str) -> None:
        """The choice in force is final (the loss guard aside): said once, kept for status."""
        self.settled = True
        self._note = self.verdict = why

    def _predict(self, cost: LinearCost, planner: RoundPlanner) -> None:
        """The model's step for each candidate, for the candidates' table."""
        dense = dense_plan(planner, cost, 0.0)
        self.predicted[DENSE] = planner.seconds(dense.groups, dense.line)
        low = self.low_rank.plan(cost, 0.0, planner)
        self.predicted[self.low_rank_name] = planner.seconds(low.groups, low.line)

    def search(self, current: PlanSearch) -> PlanSearch:
        """One plan search per exchange, once its choice is final: the comparison of low-rank
        with dense measures the model's plans, not a search's trials."""
        if not self.settled or self.next != self.running:
            return PlanSearch(enabled=False)
        if not self._searches:
            self._searches[DENSE] = current if current.enabled else PlanSearch()
        return self._searches.setdefault(self.running, PlanSearch())

    def searched(self, step_s: float) -> str:
        return ""

    def overhead_s(self, search: PlanSearch, running: bool) -> float:
        exchange = self.running if running else self.next
        kept = self._searches.get(exchange)
        return kept.overhead_s if kept is not None else 0.0

    def plan(self, measured: LinearCost, overhead_s: float, planner: RoundPlanner) -> Planned:
        if self.next == LOW_RANK:
            return self.low_rank.plan(measured, overhead_s, planner)
        return dense_plan(planner, measured, overhead_s)

    def applied(self, overhead_s: float) -> None:
        self.running = self.next

    def status(self) -> ChoiceStatus:
        measured = {DENSE: self.dense_step_s or -1.0,
                    self.low_rank_name: (statistics.median(self.low_rank_steps)
                                         if self.low_rank_steps else -1.0)}
        candidates = [(name, self.predicted.get(name, -1.0), measured[name])
                      for name in (DENSE, self.low_rank_name)]
        note, self._note = self._note, ""
        return ChoiceStatus("measured" if self.settled else "measuring", candidates, note,
                            self.verdict or "auto: dense until the first round is measured")
