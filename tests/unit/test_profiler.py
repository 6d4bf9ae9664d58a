"""Profiling and fitting on synthetic timings; the coordinator's re-plan decisions."""

from __future__ import annotations

import numpy as np
import pytest

from commd.coordinator.replanner import DRIFT, Replanner
from commd.job.measurements import CommSample, IterationRecord, NodeProfiler
from commd.plan import LinearCost, evaluate, optimal
from commd.plan.fitting import backward_from_offsets, combine_comm, fit_cost, profile_drift
from commd_protocol import PeerProfile


def test_fit_recovers_alpha_beta_from_noisy_samples() -> None:
    rng = np.random.default_rng(0)
    truth = LinearCost(alpha_s=150e-6, beta_s_per_byte=0.8e-9)
    sizes = rng.choice([1 << 10, 1 << 14, 1 << 18, 1 << 20, 1 << 22], size=400)
    samples = [(int(n), float(truth(n)) * (1 + 0.05 * rng.standard_normal())) for n in sizes]
    samples += [(1 << 22, 1.0)] * 3  # a few huge outliers are damped by the per-size median
    fitted = fit_cost(samples)
    assert fitted is not None
    assert fitted.alpha_s == pytest.approx(truth.alpha_s, rel=0.2)
    assert fitted.beta_s_per_byte == pytest.approx(truth.beta_s_per_byte, rel=0.05)


def test_fit_needs_two_sizes_and_keeps_terms_non_negative() -> None:
    assert fit_cost([(1024, 1e-3)] * 5) is None
    flat = fit_cost([(1024, 2e-3), (1 << 20, 1e-3)])  # time falls with size: noise
    assert flat is not None and flat.beta_s_per_byte == 0.0 and flat.alpha_s > 0
    through_zero = fit_cost([(1000, 0.5e-6), (1_000_000, 1e-3)])
    assert through_zero is not None and through_zero.alpha_s >= 0


def test_backward_from_offsets_inverts_ready_times() -> None:
    backward = [0.004, 0.001, 0.0, 0.003, 0.002]  # forward order; layer 4 is computed first
    ready = np.cumsum(backward[::-1])[::-1]  # ready(l) = sum of backward[l:]
    offsets = ready - ready[-1]  # measured from the first ready layer
    recovered = backward_from_offsets(offsets)
    # The first computed layer's own time is not observable (it blends with forward).
    np.testing.assert_allclose(recovered[:-1], backward[:-1], atol=1e-12)
    assert recovered[-1] == 0.0
    noisy = backward_from_offsets(np.array([0.010, 0.011, 0.004, 0.0]))  # out of order
    assert min(noisy) >= 0.0


def test_combine_takes_the_shortest_measurement_per_collective() -> None:
    node_a = [[0, 0, 4096, 0.010], [0, 1, 8192, 0.002]]
    node_b = [[0, 0, 4096, 0.001], [0, 1, 8192, 0.003]]  # node b arrived last at group 0
    assert sorted(combine_comm([node_a, node_b])) == [(0, 4096, 0.001), (0, 8192, 0.002)]
    gathered = [[0, 1, 8192, 0.004, 1]]  # a fifth element names the kind (1: allgather)
    assert combine_comm([gathered]) == [(1, 8192, 0.004)]


def test_allgathers_measure_the_same_a_and_b() -> None:
    from commd.plan.fitting import ALLGATHER, ALLREDUCE, allreduce_terms, fit_terms

    nodes, alpha, beta = 4, 50e-6, 0.5e-9  # per message, per byte on a link
    a, b = 2 * (nodes - 1) * alpha, 2 * (nodes - 1) / nodes * beta
    rows = []
    for nbytes in (1 << 12, 1 << 20):
        ca, cb = allreduce_terms(ALLGATHER, nbytes, nodes)
        rows.append((ca, cb, 2 * alpha + (nodes - 1) * nbytes * beta))  # Table I allgather
    fitted = fit_terms(rows)
    assert fitted is not None
    assert fitted.alpha_s == pytest.approx(a) and fitted.beta_s_per_byte == pytest.approx(b)
    assert allreduce_terms(ALLREDUCE, 100, nodes) == (1.0, 100.0)


def test_node_profiler_summarises_with_medians() -> None:
    profiler = NodeProfiler(layers=2)
    for offset in (0.001, 0.002, 0.100):  # one outlier iteration
        profiler.add(IterationRecord(
            iteration=0, ready_offsets_s=np.array([offset, 0.0]),
            comm=[CommSample((0, 0), 64, 0.5e-3)], exposed_comm_s=1e-3, iteration_s=0.01))
    summary = profiler.summary()
    assert summary.ready_offsets_s == [0.002, 0.0]
    assert len(summary.comm) == 3 and summary.exposed_comm_s == pytest.approx(1e-3)
    assert summary.iteration_s == pytest.approx(0.01) and summary.gains == []  # dense
    assert profiler.summary().comm == []  # the window was consumed


def _report(round_: int, iteration: int, offsets: list[float], cost: LinearCost,
            sizes: list[int], plan: int = 0) -> PeerProfile:
    comm = [[iteration, i, n, float(cost(n))] for i, n in enumerate(sizes)]
    return PeerProfile(job="j", round=round_, iteration=iteration, ready_offsets_s=offsets,
                       comm=comm, plan=plan)


def test_replanner_plans_from_the_profile_and_replans_only_on_drift() -> None:
    sizes = [4 << 20] * 4
    backward = [0.01] * 4
    ready = np.cumsum(backward[::-1])[::-1]
    offsets = [float(r - ready[-1]) for r in ready]
    lan = LinearCost(alpha_s=200e-6, beta_s_per_byte=1e-9)
    replanner = Replanner("optimal", sizes)
    probe = replanner.decide([_report(0, -1, [], lan, [1 << 10, 1 << 20, 4 << 20])])
    assert probe.effective_iteration == 0 and probe.version == 1
    assert probe.groups == [[0, 1, 2, 3]]  # nothing measured yet: everything ready at once
    first = replanner.decide([_report(1, 9, offsets, lan, [1 << 20, 4 << 20])] * 2)
    assert first.effective_iteration == 12 and first.version == 2
    measured_backward = backward_from_offsets(np.array(offsets))
    assert first.groups == optimal(sizes, measured_backward, first.cost)
    predicted = evaluate(first.groups, sizes, measured_backward, first.cost).exposed_comm_s
    assert first.predicted_comm_s == pytest.approx(predicted)
    steady = replanner.decide([_report(2, 19, offsets, lan, [1 << 20, 4 << 20])])
    assert steady.version == 2 and steady.reason == "no drift"
    slow = LinearCost(alpha_s=lan.alpha_s, beta_s_per_byte=lan.beta_s_per_byte * (2 + DRIFT))
    changed = replanner.decide([_report(3, 29, offsets, slow, [1 << 20, 4 << 20])])
    assert "b " in changed.reason
    assert changed.cost.beta_s_per_byte == pytest.approx(slow.beta_s_per_byte, rel=1e-6)


def test_profile_drift() -> None:
    assert profile_drift([], []) == 0.0
    assert profile_drift([1.0, 1.0], [1.0, 1.0]) == 0.0
    assert profile_drift([1.0, 1.0], [1.5, 1.0]) == pytest.approx(0.5 / 2.5)


def test_replanner_with_one_group_puts_a_change_on_bandwidth() -> None:
    sizes = [1 << 20, 1 << 20]
    lan = LinearCost(alpha_s=100e-6, beta_s_per_byte=1e-9)
    replanner = Replanner("syncea", sizes)
    replanner.decide([_report(0, -1, [], lan, [1 << 10, 1 << 20])])
    slower = LinearCost(alpha_s=100e-6, beta_s_per_byte=3e-9)
    decision = replanner.decide([_report(1, 9, [0.0, 0.0], slower, [2 << 20])])
    assert decision.cost.alpha_s == pytest.approx(lan.alpha_s, rel=1e-6)
    assert decision.cost.beta_s_per_byte == pytest.approx(3e-9, rel=1e-6)


def test_compressed_exchange_choice_flips_with_alpha_and_beta() -> None:
    sizes = [4 * 1_000_000]  # one layer of a million float32
    high_latency = LinearCost(alpha_s=2 * 7 * 10e-3, beta_s_per_byte=2 * 7 / 8 * 0.08e-9)
    low_bandwidth = LinearCost(alpha_s=2 * 7 * 1e-6, beta_s_per_byte=2 * 7 / 8 * 8e-9)
    choices = []
    for cost in (high_latency, low_bandwidth):
        replanner = Replanner("syncea", sizes, nodes=8, compression="topk:0.01")
        probe = [_report(0, -1, [], cost, [1 << 10, 1 << 20, 4 << 20])]
        choices.append(replanner.decide(probe).exchanges)
    assert choices == [["allgather"], ["allreduce"]]


def test_topk_auto_explores_then_solves_on_the_pareto_front() -> None:
    sizes = [4 * 1_000_000]
    cost = LinearCost(alpha_s=2e-3, beta_s_per_byte=1e-9)
    replanner = Replanner("syncea", sizes, nodes=4, compression="topk:auto")
    decision = replanner.decide([_report(0, -1, [], cost, [1 << 10, 1 << 20, 4 << 20])])
    explored = [decision.ratio]
    for round_ in range(1, 6):
        ratio = decision.ratio
        gain = min(1.0, 4 * ratio**0.5)  # a synthetic gain curve
        report = _report(round_, 10 * round_ - 1, [0.0], cost, [1 << 10, 4 << 20],
                         decision.version)
        report.gains.append([ratio, gain])
        decision = replanner.decide([report])
        explored.append(decision.ratio)
    assert explored[:3] == [0.1, 0.01, 0.001]  # exploration first (gains of the ratio run)
    assert 0.001 <= explored[-1] <= 0.1 and explored[-1] not in (0.1, 0.01, 0.001)
    assert "Pareto" in decision.reason or decision.reason == "no drift"


def test_node_profiler_step_time_counts_only_the_last_plan() -> None:
    profiler = NodeProfiler(layers=1)
    for plan, period in ((1, 0.10), (1, 0.10), (2, 0.50), (2, 0.20), (2, 0.22)):
        profiler.add(IterationRecord(iteration=0, ready_offsets_s=np.zeros(1), comm=[],
                                     exposed_comm_s=0.0, iteration_s=0.0, plan=plan,
                                     period_s=period))
    summary = profiler.summary()
    # 0.50 began under plan 1 (the switch): only the periods wholly under plan 2 count.
    assert summary.plan == 2 and summary.step_s == pytest.approx(0.21)
    profiler.add(IterationRecord(iteration=0, ready_offsets_s=np.zeros(1), comm=[],
                                 exposed_comm_s=0.0, iteration_s=0.0, plan=3, period_s=0.3))
    assert profiler.summary().step_s == 0.0  # one iteration: no whole period under plan 3


def test_lower_gains_join_the_round_gains_by_ratio() -> None:
    """Gains a smaller ratio would have had (worked out from a larger ratio's selection)
    reach the coordinator beside the measured ones, averaged per ratio."""
    profiler = NodeProfiler(layers=1)
    for gain, lower in ((0.8, [(0.001, 0.1), (0.01, 0.4)]), (0.6, [(0.01, 0.2)]), (0.7, [])):
        profiler.add(IterationRecord(iteration=0, ready_offsets_s=np.zeros(1), comm=[],
                                     exposed_comm_s=0.0, iteration_s=0.0, gain=gain,
                                     ratio=0.1, lower_gains=lower))
    gains = profiler.summary().gains
    assert [row[0] for row in gains] == [0.001, 0.01, 0.1]
    assert [row[1] for row in gains] == pytest.approx([0.1, 0.3, 0.7])
