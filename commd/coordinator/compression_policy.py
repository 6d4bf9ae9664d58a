"""A compressed job's choices, round by round: the top-k ratio and what to exchange.

* **Ratio** (``topk:auto``): the first round runs 0.1, measuring its step; the nodes report
  its gain and those of 0.01 and 0.001 (worked out from its selections, so they need not
  run: a round at a sparser ratio would leave a backlog in the residuals that the larger
  ratio picked next, or dense, sends in a few steps). Then the ratio is picked on the
  Pareto front of (time, 1/gain) — the time from the cost model (wire and CPU), shifted to
  meet the steps measured so far. The first solve comes before error feedback's residuals
  have built up, when every ratio's gain is near 1: where the gains it sees are flatter than
  ``ASSUMED_SLOPE`` it assumes that slope, and solves again once the gains' slope has
  settled (keeping the ratio where the new pick is within ``RESOLVE_KEEP`` of it, so the
  trials and the plan search already run for it stand). Otherwise it is solved again only
  when the exchanges are measured anew (a changed network) or the gain misses the model by
  ``GAIN_MISS``, so noisy fits do not make it wander.
* **Exchange**: with ``auto`` the candidates are dense, the allgather and (from three nodes)
  the AR-compatible exchange at the ratio; ``ExchangeTrials`` measures them and keeps the
  fastest. A forced exchange is never changed and never measured against the others.

Pure: ``CompressedChoice`` feeds it the nodes' reports and plans with what it returns.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from commd.compression.planning import (
    DEFAULT_CPU,
    EXPLORE_RATIOS,
    TIMED_RATIOS,
    CpuCost,
    GainModel,
    compressed_cost,
    fit_gain,
    link_cost,
    mean_gain_per_ratio,
    pick_ratio,
    steeper_than,
)
from commd.compression.topk import CompressionSpec
from commd.coordinator.exchange_trials import DENSE, Candidate, ExchangeTrials
from commd.plan import LinearCost
from commd_protocol import PeerProfile

GAIN_MEMORY = 200  # (ratio, gain) observations kept for the gain model
# Error feedback's residual builds up over the first rounds: gains measured then are near 1
# for every ratio (E is little more than the gradient), so the first solve sees a flat gain
# curve. When the gain at the solved ratio has settled (a round within GAIN_SETTLED of the
# one before) this far below the model's (relative), the ratio is solved again from the
# newest gains, once per job. Solved while they still fall, the curve is still too flat; a
# gain that rises is the residual held at a smaller ratio going out after a change.
GAIN_MISS = 0.3
GAIN_SETTLED = 0.1
GAIN_RESOLVES = 1
# The least slope s (gain ∝ ratio^s) a solve assumes before the gains have settled: the
# build-up flattens the early curve (0.05 in the exploration rounds of our DDP task, then
# 0.12-0.16, 0.23-0.30, 0.19-0.37, 0.30-0.46 over rounds 3-6, settled at 0.30-0.53; a
# Gaussian E gives 0.72 between 0.01 and 0.1), and solved on it the first pick was
# 0.011-0.016, whose trials and plan search were all spent when the settled re-solve moved
# the ratio to 0.036-0.052 (searches ran into step 112-132).
ASSUMED_SLOPE = 0.5
# Slopes within this fraction of the previous round's, twice in a row, have settled (on our
# DDP task rounds 3-6 gave 0.12-0.16, 0.23-0.30, 0.19-0.37, 0.30-0.46, and 0.30-0.53 later;
# the pick moves ~8 % per 0.05 of slope).
SLOPE_SETTLED = 0.15
# A re-solve whose pick lies within this much of the ratio running keeps it: its trials and
# plan search stand (a new ratio measures every exchange and searches its plan again).
RESOLVE_KEEP = 0.25
CPU_SMOOTHING = 0.5  # weight of the newest round in the CPU cost
COMPRESSED = ("allgather", "allreduce")
EXPLORE_TRIES = 2  # rounds an exploration ratio runs at most waiting for a whole round

Predict = Callable[[Candidate], float]  # seconds per iteration the model expects


@dataclass
class CompressionPolicy:
    """One top-k job's choices (the module's docstring): the ratio and the gains it is solved
    from, the CPU cost the nodes measured, the ``ExchangeTrials``, and the candidate the plan
    in force runs."""

    spec: CompressionSpec
    nodes: int
    itemsize: int = 4
    ratio: float = 0.0
    cpu: CpuCost = DEFAULT_CPU
    cpu_measured: bool = False
    gains: list[tuple[float, float]] = field(default_factory=list)  # (ratio, gain)
    trials: ExchangeTrials = field(default_factory=ExchangeTrials)
    running: Candidate | None = None  # what the plan in force runs
    _ratio_epoch: int = -1  # the trials' epoch the ratio was last solved in
    # ratios with a gain observed / a whole compressed round measured, ever (the gains
    # themselves are a sliding window: exploration must not start again when they slide)
    _gained: set[float] = field(default_factory=set)
    _timed: set[float] = field(default_factory=set)
    _tries: dict[float, int] = field(default_factory=dict)  # rounds run per ratio
    # the newest round's gains of two ratios or more, per ratio (the same residuals: their
    # slope is the gain curve's now, where the whole window mixes early and late rounds)
    _spread: list[tuple[float, float]] = field(default_factory=list)
    _solved_gain: float = 0.0  # the model's gain at the ratio when it was solved
    _last_gain: float = 0.0  # the previous round's gain at the ratio (0: none)
    _gain_resolves: int = 0
    # the gains have settled: the gain at the solved ratio held within GAIN_SETTLED of the
    # round before, or (solved with ASSUMED_SLOPE) their slope did (``_slope_settled``)
    _settled: bool = False
    _assumed: bool = False  # the ratio was solved with ASSUMED_SLOPE in place of the gains'
    _resolve_due: str = ""  # why ``choose`` is to solve the ratio again ("": it is not)
    _slopes: list[float] = field(default_factory=list)  # the gains' slopes, while assumed
    _note: str = ""  # a decision that changes no plan, for the log (``take_note``)

    @property
    def state(self) -> str:
        """For status: "forced", "exploring", "measuring" or "measured"."""
        if self.spec.exchange != "auto":
            return "forced"
        if self.exploring:
            return "exploring"
        return self.trials.state

    @property
    def exploring(self) -> bool:
        """Whether ``topk:auto`` still runs ratios to learn their steps and gains."""
        return self.spec.ratio is None and self._exploring() is not None

    @property
    def settled(self) -> Candidate | None:
        """What the job runs until something changes (None: it is still exploring or
        measuring): the trials' choice, or a forced exchange at its ratio."""
        if self.exploring:
            return None
        if self.spec.exchange != "auto":
            return Candidate(self.spec.exchange, self.ratio)
        return self.trials.chosen

    def observe(self, reports: Sequence[PeerProfile], whole_round: bool) -> str:
        """A round's reports; ``whole_round``: every node ran the plan in force all round.
        Returns why every exchange is to be measured again ("" if not)."""
        for report in reports:
            self.gains.extend((r, g) for r, g in report.gains)
        self.gains = self.gains[-GAIN_MEMORY:]
        spread = mean_gain_per_ratio((r, g) for report in reports for r, g in report.gains)
        if len(spread) >= 2:
            self._spread = spread
        self._gained.update(r for report in reports for r, _ in report.gains
                            if r in EXPLORE_RATIOS)  # all it asks of them: bounded
        self._observe_cpu([r.cpu_s_per_element for r in reports if r.cpu_s_per_element])
        running = self.running
        if running is not None and running.exchange != "dense":
            self._tries[running.ratio] = tries = self._tries.get(running.ratio, 0) + 1
            if whole_round or tries >= EXPLORE_TRIES:  # a round that moves on is no hang
                self._timed.add(running.ratio)
        steps = [r.step_s for r in reports]
        step_s = float(np.mean(steps)) if whole_round and min(steps) > 0 else 0.0
        self._resolve_due = self._gain_missed(spread,
                                              can_act=not self._dense_beats(running, step_s))
        if not step_s or running is None:
            return ""
        return self.trials.observe(running, step_s)

    def _dense_beats(self, running: Candidate | None, step_s: float) -> bool:
        """Whether dense measured, this epoch, no slower than ``running`` at the solved ratio
        ran this round. Then a larger ratio, which only runs slower (``reachable_steps``),
        cannot win either: a gain miss does not re-open the trials (on loopback it did, three
        rounds before the end of the warm-up, and the trials ran on into the measured steps)."""
        dense = self.trials.measured.get(DENSE)
        return (dense is not None and running is not None and running.exchange != "dense"
                and 0 < dense <= step_s)

    def _gain_missed(self, gains: list[tuple[float, float]], can_act: bool = True) -> str:
        """Why the ratio is to be solved again ("" if not): the ratio was solved with
        ASSUMED_SLOPE and the gains' slope has settled (``_slope_settled``), or the gain this
        round measured at the solved ratio has settled GAIN_MISS below what the model
        predicted. ``can_act`` False (dense measured faster): it is let pass without
        spending the job's re-solves on it."""
        if self.spec.ratio is not None or self.exploring or self._solved_gain <= 0:
            return ""
        resolves_left = self._gain_resolves < GAIN_RESOLVES
        if self._assumed:
            return self._slope_settled(gains, can_act) if resolves_left else ""
        observed = next((g for r, g in gains if math.isclose(r, self.ratio, rel_tol=1e-9)),
                        None)
        if observed is None:
            return ""
        previous, self._last_gain = self._last_gain, observed
        if previous <= 0 or observed < (1 - GAIN_SETTLED) * previous:  # still falling
            return ""
        self._settled = True  # later solves take the gains' slope as it is
        if (not resolves_left or observed >= (1 - GAIN_MISS) * self._solved_gain
                or not can_act):
            return ""
        predicted, self._solved_gain = self._solved_gain, 0.0
        self._gain_resolves += 1
        return (f"gain at ratio {self.ratio:.4g} measured {observed:.3f}, the model "
                f"predicted {predicted:.3f}")

    def _slope_settled(self, gains: list[tuple[float, float]], can_act: bool) -> str:
        """Why a ratio solved with ASSUMED_SLOPE is to be solved again ("" if not): this
        round's gains (of two ratios or more) have a slope within SLOPE_SETTLED of the
        previous such round's (relative), as that one had of the round's before (a single
        pair is no sign: 0.158, 0.300, 0.278, 0.360, … 0.525 in a DDP run). The pick depends
        on the slope, which settles rounds before the gains' level does (it falls while the
        residuals still grow)."""
        model = fit_gain(gains)
        if model is None:
            return ""
        self._slopes = [*self._slopes[-2:], model.slope]
        if len(self._slopes) < 3 or any(
                abs(now - before) > SLOPE_SETTLED * before
                for before, now in itertools.pairwise(self._slopes)):
            return ""
        self._settled = True
        if not can_act:
            return ""
        self._gain_resolves += 1
        return (f"gains' slope settled at {model.slope:.2f}: the ratio {self.ratio:.4g} was "
                f"solved with {ASSUMED_SLOPE:g} assumed")

    def _resolve(self, cost: LinearCost, elements: Sequence[int]) -> str:
        """The re-solve ``observe`` found due: every exchange is measured again at the new
        pick, unless it lies within RESOLVE_KEEP of the ratio running, which then stays
        with the settled model's gain. Returns why the trials start again ("" if not)."""
        why, self._resolve_due = self._resolve_due, ""
        if not why or self._ratio_epoch != self.trials.epoch:
            return ""  # (a new epoch solves the ratio anyway)
        # as the new epoch would solve it: its trials have measured nothing yet
        ratio, model, _ = self._solve(cost, elements, new_epoch=True)
        if abs(math.log(ratio / self.ratio)) <= math.log(1 + RESOLVE_KEEP):
            self._solved_gain, self._assumed = float(model.gain(self.ratio)), False
            self._note = (f"{why}: solved again to {ratio:.4g}, within {RESOLVE_KEEP:.0%} of "
                          f"{self.ratio:.4g}: keeping it")
            return ""
        return self.trials.restart(why)

    def take_note(self) -> str:
        """What was decided without changing the plan (a re-solve that kept the ratio), once,
        for the log ("" if nothing)."""
        note, self._note = self._note, ""
        return note

    def _observe_cpu(self, rows: list[list[float]]) -> None:
        """The slowest node's CPU costs gate the iteration. The overhead per group is the
        least any node saw: a node's also holds its wait for the others (the leader's
        selection before the indices' broadcast), already counted as CPU."""
        if not rows:
            return
        selects = [row[0] for row in rows if row[0] > 0]
        select = max(selects) if selects else self.cpu.select_s_per_element
        update = max(row[1] for row in rows)
        per_group = min(row[2] for row in rows)
        if self.cpu_measured:
            w, old = CPU_SMOOTHING, self.cpu
            select = w * select + (1 - w) * old.select_s_per_element
            update = w * update + (1 - w) * old.update_s_per_element
            per_group = w * per_group + (1 - w) * old.per_group_s
        self.cpu, self.cpu_measured = CpuCost(select, update, per_group), True

    def choose(self, cost: LinearCost, elements: Sequence[int], predict: Predict,
               measure_dense: bool = False) -> tuple[Candidate, str]:
        """What the next plan runs, and why if that changed. ``elements``: the dense
        elements of the current groups (for the ratio's time model); ``predict``: the
        planner's seconds per iteration for a candidate; ``measure_dense``: measure dense
        whatever its prediction (the network's a, b are stale)."""
        resolved = self._resolve(cost, elements)
        ratio, why_ratio = self._choose_ratio(cost, elements)
        why_ratio = ", ".join(x for x in (resolved, why_ratio) if x)
        self.ratio = ratio
        if self.spec.exchange != "auto":
            return Candidate(self.spec.exchange, ratio), why_ratio
        compressed = [Candidate(exchange, ratio) for exchange in self._exchanges()]
        if self.exploring:
            # Exploring: the gain model needs compressed rounds, at the model's exchange.
            predicted = {c: predict(c) for c in compressed}
            self.trials.predicted = predicted
            return min(compressed, key=lambda c: (predicted[c], c)), why_ratio
        candidate, why = self.trials.next({c: predict(c) for c in (DENSE, *compressed)},
                                          {DENSE} if measure_dense else set())
        return candidate, ", ".join(x for x in (why_ratio, why) if x)

    # --- the ratio ---------------------------------------------------------------------------

    def _exploring(self) -> float | None:
        """The ratio the next exploration round runs (None: exploration is over): each of
        TIMED_RATIOS until a whole round of it is measured, then any explored ratio whose
        gain no node has reported (they usually come from larger ratios' rounds)."""
        return next((r for r in EXPLORE_RATIOS
                     if r not in self._gained or (r in TIMED_RATIOS and r not in self._timed)),
                    None)

    def _choose_ratio(self, cost: LinearCost, elements: Sequence[int]) -> tuple[float, str]:
        if self.spec.ratio is not None:
            return self.spec.ratio, ""
        exploring = self._exploring()
        if exploring is not None:
            return exploring, ("" if exploring == self.ratio
                               else f"exploring ratio {exploring:g}")
        if self._ratio_epoch == self.trials.epoch:
            return self.ratio, ""
        self._ratio_epoch = self.trials.epoch
        ratio, model, why = self._solve(cost, elements)
        self._assumed = model.assumed
        self._solved_gain, self._last_gain = float(model.gain(ratio)), 0.0
        return ratio, f"ratio {self.ratio:g}→{ratio:.4g} ({why})"

    def _solve(self, cost: LinearCost, elements: Sequence[int], new_epoch: bool = False
               ) -> tuple[float, GainModel, str]:
        """The ratio picked on the Pareto front now (``new_epoch``: as a new epoch of the
        trials would pick it), the gain model it was picked with, and what it was picked
        from, for the log: the step at each end, the gains."""
        model = fit_gain(self._spread) or fit_gain(self.gains)
        assert model is not None  # three ratios tried
        if not self._settled:
            model = steeper_than(model, ASSUMED_SLOPE)
        time_of = self._time_of(cost, elements, new_epoch)
        ratio, _front = pick_ratio(time_of, model)
        ends = ", ".join(f"{r:g}: {time_of(r) * 1e3:.1f} ms, gain {float(model.gain(r)):.3f}"
                         for r in (0.01, 0.1))
        assumed = f"slope {ASSUMED_SLOPE:g} assumed, " if model.assumed else ""
        return ratio, model, f"Pareto/ASF; {assumed}{ends}"

    def _exchanges(self) -> tuple[str, ...]:
        """The compressed exchanges ``auto`` measures. With two nodes only the allgather: its
        wire is never dearer (α + 2Mβ against STAR's 3α + 2Mβ), it sends both nodes' top-k
        where STAR sends the leader's only, and STAR's one saving, the other node's selection,
        runs in parallel with the leader's anyway. In our DDP runs the jobs that ended on STAR
        finished 18–30 % above dense's loss, the allgather ones 0.5–8 % (docs/compression.md)."""
        if self.spec.exchange != "auto":
            return (self.spec.exchange,)
        return ("allgather",) if self.nodes == 2 else COMPRESSED

    def model_s(self, candidate: Candidate, cost: LinearCost, elements: Sequence[int]) -> float:
        """The cost model's seconds per iteration of ``elements`` groups (no overlap)."""
        if candidate.exchange == "dense":
            return 0.0 if self.nodes < 2 else sum(cost(n * self.itemsize) for n in elements)
        line = compressed_cost(candidate.exchange, self.nodes, link_cost(cost, self.nodes),
                               candidate.ratio, self.itemsize, self.cpu)
        return sum(line(n * self.itemsize) for n in elements)

    def _time_of(self, cost: LinearCost, elements: Sequence[int], new_epoch: bool = False
                 ) -> Callable[[float], float]:
        """Seconds per iteration against the ratio: between the ratios measured (in this
        epoch unless ``new_epoch``, else their latest step), the measured steps
        (interpolated over log ratio); beyond them the cost model, shifted to meet the
        nearest measurement (the model misses the compute and what it cannot see)."""
        def model(ratio: float) -> float:
            return min(self.model_s(Candidate(e, ratio), cost, elements)
                       for e in self._exchanges())

        # Ratios not measured in this epoch keep their latest step: the cost model alone
        # misses the compute, so a new epoch would see a flat time and pick the largest gain.
        this_epoch = {} if new_epoch else self.trials.measured
        fastest = reachable_steps({**_fastest_per_ratio(self.trials.latest),
                                   **_fastest_per_ratio(this_epoch)})
        if not fastest:
            return model
        xs = [math.log(r) for r in sorted(fastest)]
        ys = [fastest[r] for r in sorted(fastest)]
        low, high = min(fastest), max(fastest)

        def time_of(ratio: float) -> float:
            if ratio < low:
                return model(ratio) + ys[0] - model(low)
            if ratio > high:
                return model(ratio) + ys[-1] - model(high)
            return float(np.interp(math.log(ratio), xs, ys))

        return time_of


def reachable_steps(steps: Mapping[float, float]) -> dict[float, float]:
    """ratio -> step, without the ratios that measured slower than a larger one. A smaller
    ratio selects and sends less, so with the larger ratio's plan it runs no slower: a step
    above a larger ratio's measured the plan it ran, not the ratio. In the time against the
    ratio such a point made every ratio between them look slower than the larger one: after
    the explored 0.01 (41.7 ms) and 0.1 (63.5 ms), one group each, the picked 0.0129's trial ran
    the model's 10 groups, slower than 0.1, and the ratio was solved again to 0.1."""
    kept: dict[float, float] = {}
    fastest_above = math.inf
    for ratio in sorted(steps, reverse=True):
        if steps[ratio] <= fastest_above:
            kept[ratio] = steps[ratio]
            fastest_above = steps[ratio]
    return dict(sorted(kept.items()))


def _fastest_per_ratio(steps: Mapping[Candidate, float]) -> dict[float, float]:
    """ratio -> the fastest step a compressed candidate of that ratio measured."""
    fastest: dict[float, float] = {}
    for candidate, step in steps.items():
        if candidate.exchange != "dense":
            fastest[candidate.ratio] = min(step, fastest.get(candidate.ratio, math.inf))
    return fastest
