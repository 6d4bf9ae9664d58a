"""Which exchange a compressed job runs: the cost model proposes, measured rounds decide.

The cost model (wire by Table I, CPU per element as measured by the nodes) predicts each
candidate's seconds per iteration: ``dense`` (no compression at all), ``allgather@R`` and
``allreduce@R``. Models miss on real machines (the CPU side, shared cores, noisy fits of a
compressed group's few collectives), so each candidate that might win is run for one report
round and its measured step time decides:

1. The model's best candidate runs first.
2. Then, cheapest prediction first, each candidate whose *prediction* is below the best
   *measured step* so far. A measured step contains the compute and every cost the model
   misses, so a candidate predicted slower than that cannot win unless the model overrates
   it; those are left out (``predicted`` in status), the rest are measured.
3. The measured fastest is chosen; the one chosen before stays while it is within
   ``HYSTERESIS`` of it, so noise does not make the job flap.
4. While the choice runs, its step time is watched: ``RETRIAL_ROUNDS`` rounds in a row more
   than ``RETRIAL_CHANGE`` away from its reference (what it measured when chosen, refined by
   the rounds since) — the network or the load changed — and every candidate is measured
   again. So they are, once per epoch, when it runs ``BEHIND`` slower than the runner-up's
   trial that many rounds in a row: its own trial was a lucky round.

Pure: no I/O, no clock; the ``Replanner`` feeds it rounds and runs what it returns.
"""

from __future__ import annotations

from collections.abc import Mapping, Set
from dataclasses import dataclass, field

HYSTERESIS = 0.05  # the chosen candidate stays while within 5 % of the measured best
RETRIAL_CHANGE = 0.50  # its step time moved this much …
RETRIAL_ROUNDS = 3  # … this many rounds in a row: measure every candidate again
REFERENCE_WEIGHT = 0.3  # rounds within the band refine the reference step (a running mean)
# The chosen candidate runs this much slower than the runner-up's trial, RETRIAL_ROUNDS
# rounds in a row: its own trial was a lucky round. Measured again, once per epoch.
BEHIND = 0.20


@dataclass(frozen=True, order=True)
class Candidate:
    exchange: str  # "dense", "allgather" or "allreduce"
    ratio: float = 0.0  # top-k ratio (0: dense)

    def __str__(self) -> str:
        return "dense" if self.exchange == "dense" else f"{self.exchange}@{self.ratio:.4g}"


DENSE = Candidate("dense")


@dataclass
class ExchangeTrials:
    measured: dict[Candidate, float] = field(default_factory=dict)  # step seconds, this epoch
    predicted: dict[Candidate, float] = field(default_factory=dict)  # seconds, the latest model
    chosen: Candidate | None = None  # None: still measuring
    reference_s: float = 0.0  # the chosen candidate's step time when it was chosen
    epoch: int = 0  # how many times every candidate was measured anew
    _drifted: int = 0  # rounds in a row the chosen candidate's step time was off
    _behind: int = 0  # rounds in a row it ran BEHIND slower than the runner-up's trial
    _rechecked: bool = False  # this epoch already measured again for being behind
    _previous: Candidate | None = None  # the choice before this epoch's measurements

    @property
    def state(self) -> str:
        return "measuring" if self.chosen is None else "measured"

    def observe(self, ran: Candidate, step_s: float) -> str:
        """A whole round ran ``ran`` and measured ``step_s`` per iteration. Returns why every
        candidate is to be measured again ("" if not)."""
        if step_s <= 0:
            return ""
        if self.chosen is None or ran != self.chosen:
            self.measured[ran] = step_s
            return ""
        behind = self._behind_runner_up(ran, step_s)
        if behind:
            return self._measure_again(ran, step_s, behind, recheck=True)
        off = abs(step_s - self.reference_s) / self.reference_s
        if off <= RETRIAL_CHANGE:
            # One trial round is a small sample: later rounds in the band refine it.
            self.reference_s += REFERENCE_WEIGHT * (step_s - self.reference_s)
            self._drifted = 0
            return ""
        self._drifted += 1
        if self._drifted < RETRIAL_ROUNDS:
            return ""
        return self._measure_again(ran, step_s, f"{ran} step {self.reference_s * 1e3:.1f}→"
                                   f"{step_s * 1e3:.1f} ms")

    def _behind_runner_up(self, ran: Candidate, step_s: float) -> str:
        """Why the chosen candidate looks chosen on a lucky trial ("" if it does not)."""
        others = {c: s for c, s in self.measured.items() if c != ran}
        if self._rechecked or not others:
            return ""
        runner_up = min(others, key=lambda c: (others[c], c))
        if step_s <= others[runner_up] * (1 + BEHIND):
            self._behind = 0
            return ""
        self._behind += 1
        if self._behind < RETRIAL_ROUNDS:
            return ""
        return (f"{ran} runs {step_s * 1e3:.1f} ms/step, {runner_up} measured "
                f"{others[runner_up] * 1e3:.1f}")

    def _measure_again(self, ran: Candidate, step_s: float, why: str,
                       recheck: bool = False) -> str:
        """Every candidate is measured again (``ran`` keeps this round's step)."""
        self.measured = {ran: step_s}
        self._previous, self.chosen = self.chosen, None
        self._drifted = self._behind = 0
        self._rechecked = recheck  # a drift starts a fresh epoch: the check may run again
        self.epoch += 1
        return f"{why}: measuring the exchanges again"

    def next(self, predicted: Mapping[Candidate, float],
             must_measure: Set[Candidate] = frozenset()) -> tuple[Candidate, str]:
        """The candidate the next round runs, and why if that is a decision ("" if not).
        ``must_measure``: candidates whose prediction is not to be trusted (stale)."""
        self.predicted = dict(predicted)
        if self.chosen is not None and self.chosen in predicted:
            return self.chosen, ""
        ranked = sorted(predicted, key=lambda c: (predicted[c], c))
        known = {c: s for c, s in self.measured.items() if c in predicted}
        if not known:
            return ranked[0], f"measuring {ranked[0]} (predicted best)"
        fastest = min(self.measured.values())
        pending = [c for c in ranked if c not in known
                   and (predicted[c] < fastest or c in must_measure)]
        if pending:
            return pending[0], f"measuring {pending[0]}"
        best = min(known, key=lambda c: (known[c], c))
        previous = self._previous
        if previous in known and known[previous] <= known[best] * (1 + HYSTERESIS):
            best = previous
        self.chosen, self.reference_s, self._drifted = best, known[best], 0
        return best, f"{best} measured fastest ({known[best] * 1e3:.1f} ms/step)"

    def replanned(self, candidate: Candidate, step_s: float) -> None:
        """The chosen ``candidate`` runs a new plan (the plan search's) that measured
        ``step_s``: the watch compares with that from now on."""
        if candidate == self.chosen and step_s > 0:
            self.measured[candidate] = self.reference_s = step_s
            self._drifted = 0

    def table(self) -> list[tuple[str, float, float]]:
        """(candidate, predicted s, measured s or -1) for status, cheapest prediction first."""
        ranked = sorted(self.predicted, key=lambda c: (self.predicted[c], c))
        return [(str(c), self.predicted[c], self.measured.get(c, -1.0)) for c in ranked]
