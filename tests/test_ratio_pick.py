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
)
from commd.compression.topk import parse_compression
from commd.coordinator.compression_policy import CompressionPolicy, reachable_steps
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
    policy.trials.latest = {Candidate("allgather", r): s for r, s in latest.items()}
    policy.trials.epoch = 1  # a new epoch: the ratio is solved again
    return policy


def test_a_slow_trial_of_a_small_ratio_does_not_push_the_pick_to_the_largest() -> None:
    """The DDP run at 1 Gbit/s: explored 0.01 (41.7 ms) and 0.1 (63.5 ms) one group each,
    then 0.0129's trial ran 10 groups at 70 ms; solved again, the ratio went to 0.1 (59 ms a
    step where the other streams ran 0.03 at 46)."""
    cost, elements = LinearCost(1e-4, 8e-9), [3_170_000]
    clean, _ = policy_after_exploring({0.01: 0.0417, 0.1: 0.0635})._choose_ratio(cost, elements)
    slow, why = policy_after_exploring({0.01: 0.0417, 0.0129: 0.070, 0.1: 0.0635}
                                       )._choose_ratio(cost, elements)
    assert 0.02 < clean < 0.08
    assert slow == pytest.approx(clean), why


def policy_on_a_gain_miss(dense_s: float) -> tuple[CompressionPolicy, Candidate]:
    """A `topk:auto` policy solved at 0.02 (model gain 0.75) whose epoch measured dense at
    ``dense_s``, now running allgather@0.02; its previous round's gain was 0.22."""
    policy = policy_after_exploring({0.01: 0.040, 0.1: 0.048})
    running = Candidate("allgather", 0.02)
    policy.ratio, policy.running = 0.02, running
    policy._solved_gain, policy._last_gain = 0.75, 0.22
    policy.trials.measured = {DENSE: dense_s}
    return policy, running


def gain_round(step_s: float) -> list[PeerProfile]:
    return [PeerProfile(job="j", round=9, iteration=90, gains=[[0.02, 0.21]], plan=5,
                        step_s=step_s) for _ in range(2)]


def test_a_gain_miss_reopens_the_trials_unless_dense_measured_faster() -> None:
    """Loopback: dense measured 46 ms this epoch, allgather@0.02 runs 48; a larger ratio
    cannot beat dense, so the miss does not start the trials again (they ran on into the
    measured steps); where dense measured slower it does."""
    policy, running = policy_on_a_gain_miss(dense_s=0.046)
    assert policy.observe(gain_round(0.048), whole_round=True) == ""
    assert policy.trials.measured[running] == pytest.approx(0.048)
    assert policy.trials.epoch == 1 and policy.ratio == 0.02

    slower, _ = policy_on_a_gain_miss(dense_s=0.060)
    why = slower.observe(gain_round(0.048), whole_round=True)
    assert "gain at ratio 0.02 measured 0.210" in why and slower.trials.epoch == 2


def test_a_gain_miss_let_pass_keeps_the_re_solve_for_later() -> None:
    """The miss that dense's faster step let pass did not spend the job's one re-solve: once
    the compressed candidate runs faster than dense measured, the next miss re-solves."""
    policy, _ = policy_on_a_gain_miss(dense_s=0.046)
    assert policy.observe(gain_round(0.048), whole_round=True) == ""
    why = policy.observe(gain_round(0.040), whole_round=True)
    assert "gain at ratio 0.02 measured 0.210" in why and policy.trials.epoch == 2
