"""The adaptive ratio's pick on the Pareto front (commd.compression.planning.pick_ratio)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import pytest

from commd.compression.planning import (
    EXPLORE_RATIOS,
    TIMED_RATIOS,
    GainModel,
    fit_gain,
    pick_ratio,
    steeper_than,
)
from commd.compression.topk import parse_compression
from commd.coordinator.compression_policy import (
    ASSUMED_SLOPE,
    RESOLVE_KEEP,
    CompressionPolicy,
    reachable_steps,
)
from commd.coordinator.exchange_trials import DENSE, Candidate
from commd.plan import LinearCost
from commd_protocol import PeerProfile

# Gains top-k had on bench/ddp_compare.py's task with momentum correction (steps 30-150,
# top-k of E over the whole model): a thousandth sends a hundredth of E, a tenth a third.
DDP_GAINS = [(0.1, 0.36), (0.01, 0.06), (0.001, 0.01)]


def measured(at_001: float, at_01: float) -> Callable[[float], float]:
    """Steps measured at 0.01 and 0.1, interpolated over log ratio (flat below 0.01)."""
    def time_of(ratio: float) -> float:
        share = (math.log(ratio) - math.log(0.01)) / (math.log(0.1) - math.log(0.01))
        return at_001 + (at_01 - at_001) * max(0.0, share)

    return time_of


def ddp_model() -> GainModel:
    model = fit_gain(DDP_GAINS)
    assert model is not None
    return model


def test_a_small_slowdown_buys_the_gain_of_a_large_ratio() -> None:
    """1 Gbit/s: 0.1 measured 50 ms a step against 0.01's 37 ms, three times 0.03's gain.
    Normalised over the front, 1/gain's scale came from 0.001 (1/gain 100) and the pick
    sat at 0.029, where top-k cost the most loss; as a relative shortfall it is ~0.065."""
    ratio, front = pick_ratio(measured(0.037, 0.050), ddp_model())
    assert 0.05 <= ratio < 0.1
    assert front and all(r1 < r2 for (r1, _, _), (r2, _, _) in itertools.pairwise(front))


def test_a_large_slowdown_keeps_the_ratio_small() -> None:
    """100 Mbit/s-like: 0.1 costs six times 0.01's step; the pick stays low."""
    ratio, _ = pick_ratio(measured(0.050, 0.300), ddp_model())
    assert 0.01 <= ratio < 0.03


def test_when_the_ratio_costs_no_time_the_largest_gain_wins() -> None:
    ratio, front = pick_ratio(measured(0.060, 0.060), ddp_model())
    assert ratio == pytest.approx(0.1) and len(front) == 1


@pytest.mark.parametrize("scale", [1.0, 3.0, 10.0])  # gains below 1: uncapped
def test_the_pick_does_not_depend_on_the_units(scale: float) -> None:
    """Both objectives are relative: seconds or milliseconds, any gain scale, one pick."""
    base, _ = pick_ratio(measured(0.037, 0.050), ddp_model())
    model = ddp_model()
    scaled = GainModel(model.c0 + math.log(scale), model.c1)  # 1/gain times ``scale``
    ratio, _ = pick_ratio(lambda r: 1000 * measured(0.037, 0.050)(r), scaled)
    assert ratio == pytest.approx(base)


def test_a_ratio_measured_slower_than_a_larger_one_is_left_out_of_the_time_curve() -> None:
    steps = {0.01: 0.0417, 0.0129: 0.070, 0.05: 0.060, 0.1: 0.0635}
    # 0.0129 ran slower than 0.1 (its plan, not its ratio); 0.05 below 0.1 is kept
    assert reachable_steps(steps) == {0.01: 0.0417, 0.05: 0.060, 0.1: 0.0635}
    assert reachable_steps({0.01: 0.05, 0.1: 0.04}) == {0.1: 0.04}
    assert reachable_steps({}) == {}


def policy_after_exploring(latest: dict[float, float]) -> CompressionPolicy:
    """A 2-node `topk:auto` policy whose exploration is over, its trials' latest steps."""
    spec = parse_compression("topk:auto")
    assert spec is not None
    policy = CompressionPolicy(spec, nodes=2)
    policy._gained, policy._timed = set(EXPLORE_RATIOS), set(TIMED_RATIOS)
    policy.gains = policy._spread = [(0.01, 0.145), (0.1, 0.377)]  # settled gains (DDP run)
    policy._settled = True
    policy.trials.latest = {Candidate("allgather", r): s for r, s in latest.items()}
    policy.trials.epoch = 1  # a new epoch: the ratio is solved again
    return policy


# a DDP-sized group on a 1 Gbit/s-like link, for the ratio's time model
COST, ELEMENTS = LinearCost(1e-4, 8e-9), [3_170_000]
# gains measured before error feedback's residuals build up: near 1 for every ratio
EARLY_GAINS = [(0.001, 0.93), (0.01, 0.95), (0.1, 0.97)]


def policy_on_early_gains(settled: bool = False) -> CompressionPolicy:
    """A policy about to solve on EARLY_GAINS; ``settled``: as if the gains had settled."""
    policy = policy_after_exploring({0.01: 0.040, 0.1: 0.060})
    policy._settled = settled
    policy.gains = policy._spread = EARLY_GAINS
    return policy


def policy_running_an_assumed_ratio() -> CompressionPolicy:
    """A policy that solved on EARLY_GAINS (the slope assumed) and runs that ratio."""
    policy = policy_on_early_gains()
    policy.ratio, _ = policy._choose_ratio(COST, ELEMENTS)
    policy.running = Candidate("allgather", policy.ratio)
    return policy


def test_a_slow_trial_of_a_small_ratio_does_not_push_the_pick_to_the_largest() -> None:
    """The DDP run at 1 Gbit/s: explored 0.01 (41.7 ms) and 0.1 (63.5 ms) one group each,
    then 0.0129's trial ran 10 groups at 70 ms; solved again, the ratio went to 0.1 (59 ms a
    step where the other streams ran 0.03 at 46)."""
    clean, _ = policy_after_exploring({0.01: 0.0417, 0.1: 0.0635})._choose_ratio(COST, ELEMENTS)
    slow, why = policy_after_exploring({0.01: 0.0417, 0.0129: 0.070, 0.1: 0.0635}
                                       )._choose_ratio(COST, ELEMENTS)
    assert 0.02 < clean < 0.08
    assert slow == pytest.approx(clean), why


def policy_on_a_gain_miss(dense_s: float) -> tuple[CompressionPolicy, Candidate]:
    """A `topk:auto` policy solved at 0.02 (model gain 0.75) whose epoch measured dense at
    ``dense_s``, now running allgather@0.02; its previous round's gain was 0.22."""
    policy = policy_after_exploring({0.01: 0.040, 0.1: 0.048})
    running = Candidate("allgather", 0.02)
    policy.ratio, policy.running = 0.02, running
    policy._solved_gain, policy._last_gain = 0.75, 0.22
    policy._ratio_epoch = policy.trials.epoch
    policy.trials.measured = {DENSE: dense_s}
    return policy, running


def gain_round(step_s: float, gain: float = 0.21) -> list[PeerProfile]:
    return [PeerProfile(job="j", round=9, iteration=90, gains=[[0.02, gain]], plan=5,
                        step_s=step_s) for _ in range(2)]


def observe_and_choose(policy: CompressionPolicy, reports: list[PeerProfile]) -> str:
    """One round as the Replanner feeds it: observed, then the next candidate chosen (where
    a re-solve found due acts); the reasons of both."""
    retrial = policy.observe(reports, whole_round=True)
    _, why = policy.choose(COST, ELEMENTS, lambda c: 0.05)
    return ", ".join(x for x in (retrial, why) if x)


def test_a_gain_miss_reopens_the_trials_unless_dense_measured_faster() -> None:
    """Loopback: dense measured 46 ms this epoch, allgather@0.02 runs 48; a larger ratio
    cannot beat dense, so the miss does not start the trials again (they ran on into the
    measured steps); where dense measured slower it does."""
    policy, running = policy_on_a_gain_miss(dense_s=0.046)
    assert "gain at ratio" not in observe_and_choose(policy, gain_round(0.048))
    assert policy.trials.measured[running] == pytest.approx(0.048)
    assert policy.trials.epoch == 1 and policy.ratio == 0.02

    slower, _ = policy_on_a_gain_miss(dense_s=0.060)
    why = observe_and_choose(slower, gain_round(0.048))
    assert "gain at ratio 0.02 measured 0.210" in why and slower.trials.epoch == 2
    assert slower.ratio > 0.02 * (1 + RESOLVE_KEEP), why


def test_a_gain_miss_let_pass_keeps_the_re_solve_for_later() -> None:
    """The miss that dense's faster step let pass did not spend the job's one re-solve: once
    the compressed candidate runs faster than dense measured, the next miss re-solves."""
    policy, _ = policy_on_a_gain_miss(dense_s=0.046)
    assert "gain at ratio" not in observe_and_choose(policy, gain_round(0.048))
    why = observe_and_choose(policy, gain_round(0.040))
    assert "gain at ratio 0.02 measured 0.210" in why and policy.trials.epoch == 2


def test_a_gain_model_flatter_than_the_assumed_slope_is_replaced() -> None:
    """A steeper fit stands; a flatter one gives way to the assumed slope, its gain 1 at the
    top of the range (the early level says nothing: every gain is near 1)."""
    steep = ddp_model()  # slope ~0.77
    assert steeper_than(steep, ASSUMED_SLOPE) is steep and not steep.assumed
    flat = fit_gain([(0.001, 0.93), (0.01, 0.95), (0.1, 0.97)])
    assert flat is not None and flat.slope < 0.05
    assumed = steeper_than(flat, ASSUMED_SLOPE)
    assert assumed.assumed and assumed.slope == pytest.approx(ASSUMED_SLOPE)
    assert float(assumed.gain(0.1)) == pytest.approx(1.0)
    assert float(assumed.gain(0.01)) == pytest.approx(0.1**ASSUMED_SLOPE)


def test_a_first_solve_on_the_early_flat_gains_assumes_the_slope() -> None:
    """On our DDP task the first solve saw gains near 1 for every ratio and picked
    0.011-0.016, where the settled gains pick 0.036-0.052. Before the gains have settled it
    picks with ASSUMED_SLOPE; once settled, with the gains' own slope, flat or not."""
    first = policy_on_early_gains()
    ratio, why = first._choose_ratio(COST, ELEMENTS)
    assert f"slope {ASSUMED_SLOPE:g} assumed" in why and first._assumed
    time_of = first._time_of(COST, ELEMENTS)
    assert ratio == pytest.approx(pick_ratio(time_of, GainModel(0.0, -ASSUMED_SLOPE))[0])

    settled = policy_on_early_gains(settled=True)
    flat_ratio, why = settled._choose_ratio(COST, ELEMENTS)
    assert "assumed" not in why and not settled._assumed
    assert flat_ratio < ratio / 2


def slope_round(slope: float) -> list[PeerProfile]:
    """A round whose gains (at 0.001 and 0.01) have ``slope``."""
    gains = [[0.001, 0.05], [0.01, 0.05 * 10**slope]]
    return [PeerProfile(job="j", round=5, iteration=50, gains=gains, plan=5, step_s=0.05)
            for _ in range(2)]


def test_an_assumed_slope_is_solved_again_once_the_gains_slope_has_settled() -> None:
    """A DDP run's slopes after the first solve: 0.158, 0.300, 0.278, 0.360 (still rising,
    0.525 later); one pair within SLOPE_SETTLED (0.300, 0.278) is no sign: the re-solve it
    set off went to 0.031 on a flat 0.278. Two pairs in a row are."""
    policy = policy_running_an_assumed_ratio()
    assert policy._assumed
    ratio, epoch = policy.ratio, policy.trials.epoch
    for slope in (0.158, 0.300, 0.278, 0.360, 0.45, 0.47):
        observe_and_choose(policy, slope_round(slope))
        assert policy._gain_resolves == 0, slope
    observe_and_choose(policy, slope_round(0.46))  # 0.45, 0.47, 0.46: settled
    assert policy._gain_resolves == 1 and policy._settled and not policy._assumed
    # solved with 0.46 where 0.5 was assumed: within RESOLVE_KEEP, the ratio and its
    # trials stand
    assert policy.ratio == ratio and policy.trials.epoch == epoch
    assert "keeping it" in policy.take_note() and policy.take_note() == ""  # said once


def test_a_settled_slope_while_dense_measured_faster_keeps_the_re_solve() -> None:
    """As for a gain miss: while dense measured, this epoch, no slower than the ratio's
    candidate runs, a settled slope opens no trials and spends no re-solve; the gains count
    as settled (later solves take their slope)."""
    policy = policy_running_an_assumed_ratio()
    policy.trials.measured = {DENSE: 0.030}  # dense beats the 0.05 s rounds below
    for slope in (0.2, 0.2, 0.2):
        observe_and_choose(policy, slope_round(slope))
    assert policy._settled and policy._assumed and policy._gain_resolves == 0
    assert policy.trials.epoch == 1
