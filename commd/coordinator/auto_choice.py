"""``compression="auto"``: dense, float16 on the wire, or PowerSGD, as the running job
measures.

The choice is made on the running job, from what its own rounds measure, in three steps:

1. **Is the network the bottleneck, and how much?** The first report round runs dense. Its
   nodes measure the step and the communication the backward pass did not hide
   (``measured_comm_s``). On one node nothing crosses a network, and where the exposed
   communication is under ``NETWORK_SHARE`` of the step there is little to save: the job
   stays dense for good. Up to ``HALF_SHARE`` half the bytes hide most of it: float16 on the
   wire (torch's fp16 hook's arithmetic, nothing held back). Above, PowerSGD at ``AUTO_RANK``
   (error feedback, warm start; all-reduce compatible, so the plan stays the job's
   planner's), or float16 where few layers are matrices. Those numbers separate a fast link
   from a slow one by a wide margin (loopback: a few per cent; 1 Gbit/s for a 3 M parameter
   model: a third or more), so the same command decides the same way.
2. **Measured against dense.** The candidate runs ``WATCH_ROUNDS`` rounds; unless their
   median step is under ``PAYS`` × dense's, the job goes back to dense for good (what
   PowerSGD held back is sent with the next dense groups). Step 1 decided that compression
   pays; this only undoes a candidate that does not, so ``PAYS`` is 1: a bar below it sits
   where noise moves the ratio (0.76–0.88 × between runs at 1 Gbit/s on 2 shared cores),
   and the same command would decide differently run to run.
3. **The loss is watched.** Each low-rank round reports how much of the nodes' input the
   approximation carried (1 − ‖E‖²/‖M‖²). PowerSGD's error feedback delivers the rest later;
   where the approximation carries under ``GAIN_FLOOR`` for ``GAIN_ROUNDS`` rounds in a row
   the error memory grows faster than it drains, the updates fall behind dense's, and the
   job goes back to dense.

Every step says why, with its numbers, in the plan's reason (the daemon's log) and its
``choice`` (``commd status``, also a finished job's last record), and in the candidates'
table.

Top-k is not among ``auto``'s candidates: at the same bytes on the wire it loses loss where
PowerSGD does not (docs/compression.md); ``topk:auto`` stays for those who want it.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from commd.compression.lowrank import LOW_RANK
from commd.compression.spec import AUTO_RANK, HALF, LowRankSpec
from commd.coordinator.choice import ChoiceStatus, DenseChoice, Planned, RoundPlanner
from commd.coordinator.lowrank_choice import HalfChoice, LowRankChoice
from commd.coordinator.plan_search import PlanSearch
from commd.plan import LinearCost
from commd_protocol import PeerProfile

DENSE = "dense"
NETWORK_SHARE = 0.15  # exposed communication / step from which compression may pay
HALF_SHARE = 0.30  # ... up to which half the bytes (float16) hide most of it
MAX_WIRE_SHARE = 0.5  # a low-rank exchange sending more than this of the dense bytes: no gain
WATCH_ROUNDS = 2  # rounds of the candidate measured before the comparison with dense
PAYS = 1.0  # the candidate's median step must be under this × dense's (see step 2)
GAIN_FLOOR = 0.05  # the approximation carrying less than this of the input ...
GAIN_ROUNDS = 3  # ... this many rounds in a row: back to dense
WORDS = {HALF: "float16 on the wire", LOW_RANK: f"low-rank (PowerSGD rank {AUTO_RANK})",
         DENSE: "dense"}


@dataclass
class AutoChoice:
    """The ``PlanChoice`` of a ``compression="auto"`` job (the steps above): what the plan in force
    and the next one run, dense's measured step and exposed communication, each candidate's
    rounds, the loss guard's count, and the verdict status shows."""

    nodes: int
    sizes: Sequence[int]  # elements per layer, forward order
    rows: Sequence[int]  # matrix rows per layer (0: a vector)
    low_rank: LowRankChoice = field(init=False)
    half: HalfChoice = field(default_factory=HalfChoice)
    running: str = DENSE  # what the plan in force runs
    next: str = DENSE  # what the plan being made runs
    settled: bool = False  # the choice is final (only the loss guard may still undo it)
    dense_step_s: float = 0.0  # measured, the dense round
    dense_comm_s: float = 0.0  # exposed communication of that round
    steps: dict[str, list[float]] = field(default_factory=dict)  # candidate -> its rounds
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
        return self._observe_trial(step_s, reports)

    def _observe_dense(self, step_s: float, comm_s: float) -> str:
        """The network's share of the dense step picks the candidate (or dense, for good)."""
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
        if share < HALF_SHARE:
            return self._decide(HALF, f"auto: {WORDS[HALF]}: {measured}, under "
                                      f"{HALF_SHARE:.0%}: half the bytes hide most of it")
        if wire > MAX_WIRE_SHARE:
            return self._decide(HALF, f"auto: {WORDS[HALF]}: {measured}; rank {AUTO_RANK} "
                                      f"would send {wire:.0%} of the bytes (few layers are "
                                      "matrices)")
        return self._decide(LOW_RANK, f"auto: {WORDS[LOW_RANK]}, {wire:.1%} of the bytes: "
                                      f"{measured}")

    def _observe_trial(self, step_s: float, reports: Sequence[PeerProfile]) -> str:
        """A round of the candidate in force: its step against dense's, and PowerSGD's gain."""
        running = self.running
        self.steps.setdefault(running, []).append(step_s)
        first = self.verdict.removeprefix("auto: ")
        if running == LOW_RANK:
            gains = [row[1] for r in reports for row in r.gains if len(row) >= 2]
            self.last_gain = statistics.fmean(gains) if gains else 1.0
            self.low_gain_rounds = (self.low_gain_rounds + 1 if self.last_gain < GAIN_FLOOR
                                    else 0)
            if self.low_gain_rounds >= GAIN_ROUNDS:
                self.settled = True
                return self._decide(DENSE, (
                    f"auto: back to dense: the low-rank sums carried {self.last_gain:.1%} of "
                    f"the input (under {GAIN_FLOOR:.0%}) {GAIN_ROUNDS} rounds in a row; tried "
                    f"{first}"))
        if self.settled or len(self.steps[running]) < WATCH_ROUNDS:
            return ""
        self.settled = True
        step = statistics.median(self.steps[running])
        versus = (f"{WORDS[running]} {step * 1e3:.1f} ms a step against dense "
                  f"{self.dense_step_s * 1e3:.1f} ms")
        if step >= PAYS * self.dense_step_s:
            return self._decide(DENSE, f"auto: back to dense: {versus}, not under "
                                       f"{PAYS:g}×; tried {first}")
        self._settle(f"auto: keeps {WORDS[running]}: {versus} "
                     f"({step / self.dense_step_s:.2f}×); {first}")
        return ""

    def _decide(self, exchange: str, why: str) -> str:
        self.next = exchange
        self.verdict = why
        return why

    def _settle(self, why: str) -> None:
        """The choice in force is final (the loss guard aside): said once, kept for status."""
        self.settled = True
        self._note = self.verdict = why

    def _choice(self, exchange: str) -> DenseChoice:
        """The plan maker of ``exchange``."""
        return {LOW_RANK: self.low_rank, HALF: self.half}.get(exchange, DENSE_PLANS)

    def _predict(self, cost: LinearCost, planner: RoundPlanner) -> None:
        """The model's step for each candidate, for the candidates' table."""
        for name in CANDIDATES:
            planned = self._choice(name).plan(cost, 0.0, planner)
            self.predicted[name] = planner.seconds(planned.groups, planned.line)

    def search(self, current: PlanSearch) -> PlanSearch:
        """One plan search per exchange, once its choice is final: the comparison with dense
        measures the model's plans, not a search's trials."""
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
        return self._choice(self.next).plan(measured, overhead_s, planner)

    def applied(self, overhead_s: float) -> None:
        self.running = self.next

    def status(self) -> ChoiceStatus:
        measured = {name: (statistics.median(self.steps[name]) if self.steps.get(name)
                           else -1.0) for name in CANDIDATES}
        measured[DENSE] = self.dense_step_s or -1.0
        candidates = [(candidate_name(name), self.predicted.get(name, -1.0), measured[name])
                      for name in CANDIDATES]
        note, self._note = self._note, ""
        return ChoiceStatus("measured" if self.settled else "measuring", candidates, note,
                            self.verdict or "auto: dense until the first round is measured")


CANDIDATES = (DENSE, HALF, LOW_RANK)
DENSE_PLANS = DenseChoice()


def candidate_name(exchange: str) -> str:
    """As the candidates' table shows it: ``lowrank:4`` says the rank."""
    return f"{LOW_RANK}:{AUTO_RANK}" if exchange == LOW_RANK else exchange
