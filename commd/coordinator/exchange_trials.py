"""Which exchange a compressed job runs: the cost model proposes, measured rounds decide.

The cost model (wire by Table I, CPU per element as measured by the nodes) predicts each
candidate's seconds per iteration: ``dense`` (no compression at all), ``allgather@R`` and
``allreduce@R``. Models miss on real machines (the CPU side, shared cores, noisy fits of a
compressed group's few collectives), so each candidate that might win is run for one report
round and its measured step time decides:

1. The model's best candidate runs first.
2. Then, cheapest prediction first, each candidate whose *prediction* is below the best
   *measured step* of a candidate so far. A measured step contains the compute and every
   cost the model misses, so a candidate predicted slower than that cannot win unless the
   model overrates it; those are left out (``predicted`` in status), the rest are measured.
   The rounds of the ratios ``topk:auto`` explored are no candidates: on loopback the
   explored 0.01's one-group round (33–50 ms) ran below dense's prediction (36–63) in 5
   of 6 jobs, dense went unmeasured and the job ended compressed at 0.045–0.08, where
   dense ran as fast.
3. The measured fastest is chosen; dense stays while it is within ``HYSTERESIS`` of it
   (compression costs accuracy: it must pay off by more than noise), else the one chosen
   before does, so noise does not make the job flap.
4. While the choice runs, its step time is watched: ``RETRIAL_ROUNDS`` rounds in a row more
   than ``RETRIAL_CHANGE`` away from its reference (what it measured when chosen, refined by
   the rounds since) — the network or the load changed — and every candidate is measured
   again. So they are, once per epoch, when it runs ``BEHIND`` slower than the runner-up's
   trial that many rounds in a row: its own trial was a lucky round. The runner-up is one of
   the candidates of now (not an explored ratio's round); where it measured its searched
   plan, that is what it would run, so it is chosen at once instead (on loopback a replay
   round let ``allgather@0.012`` past dense's searched 54 ms; it then ran 64, and the new
   epoch's trials ran on through the measured steps of the benchmark).
5. Trials run the model's plan of each candidate, and the chosen one's plan is then searched
   (``PlanSearch``), which can take a third off its step. So when that search ends
   (``replanned``), every other candidate whose trial measured less than ``SEARCH_GAIN``
   above the searched step runs one more round, planned as the search found best, and the
   choice is made again: on loopback dense's 6-group trial ran 60-80 ms where its searched
   one or two groups run 45-55, and ``allgather@0.1`` won on the unequal comparison. In a
   later epoch a best candidate whose search is done has run its searched plan in its trial:
   its close rivals get the same round before it is chosen.

Pure: no I/O, no clock; ``CompressedChoice`` feeds it rounds and runs what it returns.
"""

from __future__ import annotations

from collections.abc import Mapping, Set
from dataclasses import dataclass, field

HYSTERESIS = 0.05  # the chosen candidate stays while within 5 % of the measured best
RETRIAL_CHANGE = 0.50  # its step time moved this much …
RETRIAL_ROUNDS = 3  # … this many rounds in a row: measure every candidate again
REFERENCE_WEIGHT = 0.3  # rounds within the band refine the reference step (a running mean)
# The chosen candidate runs this much slower than the runner-up's trial, RETRIAL_ROUNDS
# rounds in a row: its own trial was a lucky round. Measured again, once per epoch. Kept
# tighter than the noise of one trial round, so that a tie won by luck is caught while the
# two candidates' real steps still differ by little (docs/compression.md, exchange trials).
BEHIND = 0.10
# A candidate whose model-plan trial measured less than this much above the chosen one's
# searched step might win with a searched plan too: about the most a plan search takes off
# a step (a model plan's many groups merged into a few on a latency-bound link).
SEARCH_GAIN = 0.6


@dataclass(frozen=True, order=True)
class Candidate:
    """One exchange a compressed job may run: ``dense``, or top-k at ``ratio`` by allgather or
    allreduce. Its ``str`` is the name status shows (``allgather@0.01``)."""

    exchange: str  # "dense", "allgather" or "allreduce"
    ratio: float = 0.0  # top-k ratio (0: dense)

    def __str__(self) -> str:
        return "dense" if self.exchange == "dense" else f"{self.exchange}@{self.ratio:.4g}"


DENSE = Candidate("dense")


@dataclass
class ExchangeTrials:
    """One compressed job's trials of its candidates (the steps above): the step each measured
    and the model's prediction, the candidate chosen and the reference step its watch compares
    with, and the epochs in which every candidate was measured anew."""

    measured: dict[Candidate, float] = field(default_factory=dict)  # step seconds, this epoch
    # the latest step each candidate measured in any epoch (never cleared): `topk:auto`'s
    # time against the ratio keeps the explored ratios' steps when an epoch starts anew
    latest: dict[Candidate, float] = field(default_factory=dict)
    predicted: dict[Candidate, float] = field(default_factory=dict)  # seconds, the latest model
    chosen: Candidate | None = None  # None: still measuring
    reference_s: float = 0.0  # the chosen candidate's step time when it was chosen
    epoch: int = 0  # how many times every candidate was measured anew
    # the latest epoch started because the step time moved (the network or the load may
    # have changed), not only for `topk:auto`'s ratio
    network_epoch: int = 0
    _drifted: int = 0  # rounds in a row the chosen candidate's step time was off
    _behind: int = 0  # rounds in a row it ran BEHIND slower than the runner-up's trial
    _rechecked: bool = False  # this epoch already measured again for being behind
    _previous: Candidate | None = None  # the choice before this epoch's measurements
    searched: set[Candidate] = field(default_factory=set)  # their plan search finished
    # finalists to measure once more with the searched plan of ``_lender`` (``replanned``)
    _replays: list[Candidate] = field(default_factory=list)
    _replayed: set[Candidate] = field(default_factory=set)  # this epoch
    _lender: Candidate | None = None
    _switched: str = ""  # why ``observe`` chose the runner-up, for ``next`` to say once

    @property
    def state(self) -> str:
        return "measuring" if self.chosen is None else "measured"

    def observe(self, ran: Candidate, step_s: float) -> str:
        """A whole round ran ``ran`` and measured ``step_s`` per iteration. Returns why every
        candidate is to be measured again ("" if not)."""
        if step_s <= 0:
            return ""
        self.latest[ran] = step_s
        if self.chosen is None or ran != self.chosen:
            if ran in self._replays:  # the best of its model plan and the searched one
                self._replays.remove(ran)
                step_s = min(step_s, self.measured.get(ran, step_s))
            self.measured[ran] = step_s
            return ""
        runner_up, behind = self._behind_runner_up(ran, step_s)
        if runner_up is not None and runner_up in self.searched:
            self._choose_runner_up(ran, step_s, runner_up, behind)
            return ""
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

    def _behind_runner_up(self, ran: Candidate, step_s: float) -> tuple[Candidate | None, str]:
        """The runner-up the chosen candidate runs behind, and why it looks chosen on a lucky
        trial ((None, "") if it does not)."""
        others = {c: s for c, s in self.measured.items() if c != ran and c in self.predicted}
        if self._rechecked or not others:
            return None, ""
        runner_up = min(others, key=lambda c: (others[c], c))
        if step_s <= others[runner_up] * (1 + BEHIND):
            self._behind = 0
            return None, ""
        self._behind += 1
        if self._behind < RETRIAL_ROUNDS:
            return None, ""
        return runner_up, (f"{ran} runs {step_s * 1e3:.1f} ms/step, {runner_up} measured "
                           f"{others[runner_up] * 1e3:.1f}")

    def _choose_runner_up(self, ran: Candidate, step_s: float, runner_up: Candidate,
                          why: str) -> None:
        """``runner_up`` measured its searched plan: run it again, no new trials (once per
        epoch, like the measuring again it replaces)."""
        self.measured[ran] = step_s
        self._previous, self.chosen = ran, runner_up
        self.reference_s = self.measured[runner_up]
        self._drifted = self._behind = 0
        self._rechecked = True
        self._switched = f"{why} on its searched plan: running {runner_up} again"

    def _measure_again(self, ran: Candidate, step_s: float, why: str,
                       recheck: bool = False) -> str:
        """Every candidate is measured again (``ran`` keeps this round's step)."""
        why = self.restart(why, recheck)
        self.network_epoch = self.epoch
        self.measured = {ran: step_s}
        return why

    def restart(self, why: str, recheck: bool = False) -> str:
        """A new epoch: every candidate is measured again (alone, for `topk:auto`'s ratio to
        be solved again: the network's a, b stay current); returns the reason for the log."""
        self.measured = {}
        self._previous, self.chosen = self.chosen, None
        self._drifted = self._behind = 0
        self._rechecked = recheck  # a drift starts a fresh epoch: the check may run again
        self._replays, self._replayed = [], set()
        self._switched = ""
        self.epoch += 1
        return f"{why}: measuring the exchanges again"

    def next(self, predicted: Mapping[Candidate, float],
             must_measure: Set[Candidate] = frozenset()) -> tuple[Candidate, str]:
        """The candidate the next round runs, and why if that is a decision ("" if not).
        ``must_measure``: candidates whose prediction is not to be trusted (stale)."""
        self.predicted = dict(predicted)
        if self.chosen is not None and self.chosen in predicted:
            why, self._switched = self._switched, ""
            return self.chosen, why
        ranked = sorted(predicted, key=lambda c: (predicted[c], c))
        known = {c: s for c, s in self.measured.items() if c in predicted}
        if not known:
            return ranked[0], f"measuring {ranked[0]} (predicted best)"
        replays = [c for c in self._replays if c in predicted]
        if replays:
            return replays[0], f"measuring {replays[0]} again, planned as {self._lender}'s search"
        # The bar is a candidate's measured step, not dense's prediction: a measured round
        # can run below a prediction that the candidate it replaces would still have beaten.
        fastest = min(known.values())
        pending = [c for c in ranked if c not in known
                   and (predicted[c] < fastest or c in must_measure)]
        if pending:
            return pending[0], f"measuring {pending[0]}"
        best = self._best(known)
        if best in self.searched and self._replay_finalists(best, known[best]):
            # a later epoch: the best ran its searched plan already, its rivals their models'
            replay = self._replays[0]
            return replay, f"measuring {replay} again, planned as {best}'s search"
        self.chosen, self.reference_s, self._drifted = best, known[best], 0
        self._replays, self._lender = [], None
        return best, f"{best} measured fastest ({known[best] * 1e3:.1f} ms/step)"

    def _best(self, known: Mapping[Candidate, float]) -> Candidate:
        """The measured fastest, unless dense or else the previous choice is within
        HYSTERESIS of it."""
        best = min(known, key=lambda c: (known[c], c))
        for keep in (DENSE, self._previous):
            if keep is not None and keep in known and \
                    known[keep] <= known[best] * (1 + HYSTERESIS):
                return keep
        return best

    def replanned(self, candidate: Candidate, step_s: float) -> str:
        """The chosen ``candidate``'s plan search ended on a plan that measured ``step_s``:
        the watch compares with that from now on. Returns why other candidates are measured
        once more with that plan ("" if none is close enough to win with it)."""
        if candidate != self.chosen or step_s <= 0:
            return ""
        self.measured[candidate] = self.latest[candidate] = self.reference_s = step_s
        self._drifted = 0
        self.searched.add(candidate)
        finalists = self._replay_finalists(candidate, step_s)
        if not finalists:
            return ""
        self._previous, self.chosen = candidate, None
        names = ", ".join(f"{c} ({self.measured[c] * 1e3:.1f} ms)" for c in finalists)
        return (f"{candidate}'s searched plan measured {step_s * 1e3:.1f} ms/step against "
                f"the model plans of {names}: measuring those again")

    def _replay_finalists(self, lender: Candidate, step_s: float) -> list[Candidate]:
        """The candidates (not searched, not replayed this epoch) whose model-plan step is
        within SEARCH_GAIN of ``lender``'s searched ``step_s``, queued to run once more with
        ``lender``'s plan; [] if none."""
        finalists = sorted((c for c, s in self.measured.items()
                            if c in self.predicted  # a candidate still (not an old ratio)
                            and c not in self.searched and c not in self._replayed
                            and s < step_s * (1 + SEARCH_GAIN)),
                           key=lambda c: (self.measured[c], c))
        if finalists:
            self._replays, self._lender = finalists, lender
            self._replayed.update(finalists)
        return finalists

    def lender(self, candidate: Candidate) -> Candidate | None:
        """Whose searched plan ``candidate`` is to be measured with (None: its own)."""
        return self._lender if candidate in self._replays else None

    def table(self) -> list[tuple[str, float, float]]:
        """(candidate, predicted s, measured s or -1) for status, cheapest prediction first."""
        ranked = sorted(self.predicted, key=lambda c: (self.predicted[c], c))
        return [(str(c), self.predicted[c], self.measured.get(c, -1.0)) for c in ranked]
