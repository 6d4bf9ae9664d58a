"""The measured plan search: per-group overhead grows (fewer groups) until one group; then
the plan with the fewest groups within TIE of the fastest stays."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from commd.coordinator.exchange_trials import DENSE, Candidate
from commd.coordinator.plan_search import FIRST_OVERHEAD_S, TIE, PlanSearch
from commd.coordinator.replanner import Replanner
from commd.plan import LinearCost
from commd_protocol import PeerProfile


def contiguous(count: int, layers: int = 16) -> list[list[int]]:
    bounds = np.linspace(0, layers, count + 1).astype(int)
    return [list(range(lo, hi)) for lo, hi in itertools.pairwise(bounds)]


def plan_for(overhead_s: float) -> list[list[int]]:
    """A stand-in model: more overhead, fewer groups (16, 8, 4, 2, 1 at 0, 0.2, 0.8, 3.2,
    12.8 ms)."""
    if overhead_s < FIRST_OVERHEAD_S:
        return contiguous(16)
    return contiguous(max(1, int(16 / (4 * overhead_s / FIRST_OVERHEAD_S) ** 0.5)))


def run(search: PlanSearch, step_of_groups) -> list[int]:
    """Feed the search until it stops; the group counts it had measured."""
    tried = []
    for _ in range(20):
        groups = plan_for(search.overhead_s)
        tried.append(len(groups))
        search.observe(groups, step_of_groups(len(groups)), alpha_s=0.0, plan_for=plan_for)
        if search.done:
            break
    return tried


def test_fewer_groups_faster_ends_at_one_group() -> None:
    search = PlanSearch()
    tried = run(search, lambda groups: 0.050 + 0.004 * groups)
    assert tried == [16, 8, 4, 2, 1]
    assert search.done and search.state == "done"
    assert search.best is not None and search.best.groups == 1
    assert plan_for(search.overhead_s) == [list(range(16))]


def test_slower_plans_go_back_to_the_fastest_after_the_sweep() -> None:
    search = PlanSearch()
    tried = run(search, lambda groups: 0.100 if groups >= 8 else 0.130)
    assert tried == [16, 8, 4, 2, 1]  # the whole ladder, once
    best = search.best
    assert best is not None and best.groups == 8  # 16 and 8 tie: fewer groups win
    assert len(plan_for(search.overhead_s)) == 8


def test_worse_before_better_still_finds_one_group() -> None:
    """Merging many small groups partly can be slower than not at all; the sweep goes on."""
    search = PlanSearch()
    steps = {16: 0.080, 8: 0.085, 4: 0.084, 2: 0.060, 1: 0.050}
    assert run(search, steps.__getitem__) == [16, 8, 4, 2, 1]
    assert search.best is not None and search.best.groups == 1


def test_one_slow_trial_does_not_end_the_search() -> None:
    search = PlanSearch()
    steps = {16: 0.100, 8: 0.110, 4: 0.090, 2: 0.095, 1: 0.120}  # 8: a noisy round
    assert run(search, steps.__getitem__) == [16, 8, 4, 2, 1]
    assert search.best is not None and search.best.groups == 4


def test_a_slower_sweep_keeps_the_model_plan() -> None:
    search = PlanSearch()
    reasons = []
    for _ in range(5):
        step = 0.100 if search.overhead_s == 0.0 else 0.100 * (1 + 2 * TIE)
        reasons.append(search.observe(plan_for(search.overhead_s), step, 0.0, plan_for))
    assert search.done and search.overhead_s == 0.0
    assert "keeping overhead 0 µs" in reasons[-1]


def test_overheads_that_do_not_change_the_plan_are_skipped() -> None:
    search = PlanSearch()
    calls = []

    def same_until_3ms(overhead_s: float) -> list[list[int]]:
        calls.append(overhead_s)
        return contiguous(16) if overhead_s < 3e-3 else contiguous(1)

    search.observe(contiguous(16), 0.1, 0.0, same_until_3ms)
    assert search.overhead_s == pytest.approx(FIRST_OVERHEAD_S * 4**2)  # 0.2, 0.8: unchanged
    assert len(calls) == 3


def test_starts_from_the_measured_alpha_and_does_nothing_when_off() -> None:
    search = PlanSearch()
    search.observe(contiguous(16), 0.1, 0.01, plan_for)
    assert search.overhead_s == 0.01
    off = PlanSearch(enabled=False)
    assert off.observe(contiguous(16), 0.1, 0.0, plan_for) == "" and off.state == "off"
    assert off.overhead_s == 0.0


def test_a_search_started_from_a_measured_plan_goes_up_from_there() -> None:
    from commd.coordinator.plan_search import MAX_OVERHEAD_S

    at_one_group = PlanSearch(overhead_s=MAX_OVERHEAD_S)
    assert at_one_group.observe(contiguous(1), 0.05, 0.0, plan_for) == ""
    assert at_one_group.done and at_one_group.overhead_s == MAX_OVERHEAD_S
    middle = PlanSearch(overhead_s=4 * FIRST_OVERHEAD_S)
    tried = run(middle, lambda groups: 0.05 + 0.001 * groups)
    assert tried[0] == 4 and max(tried) == 4 and middle.done, tried  # never below its start
    assert middle.best is not None and middle.best.groups == 1


# --- through the replanner: rounds of reports with the measured step time ------------------


def _report(round_: int, iteration: int, plan: int, step_s: float,
            offsets: list[float], gains: list[list[float]] | None = None) -> PeerProfile:
    lan = LinearCost(alpha_s=100e-6, beta_s_per_byte=1e-9)
    comm = [[iteration, 0, n, float(lan(n))] for n in (1 << 16, 1 << 20, 4 << 20)]
    return PeerProfile(job="j", round=round_, iteration=iteration, ready_offsets_s=offsets,
                       comm=comm, plan=plan, step_s=step_s, gains=gains or [])


def drive(replanner: Replanner, step_of_groups, rounds: int = 12) -> list[int]:
    """Every round runs the last decision's plan; its step time depends on its groups."""
    sizes = len(replanner.sizes_bytes)
    offsets = [0.002 * (sizes - 1 - i) for i in range(sizes)]  # 2 ms of backward per layer
    decision = replanner.decide([_report(0, -1, 0, 0.0, [])] * 2)
    counts = []
    for number in range(1, rounds):
        step = step_of_groups(len(decision.groups))
        decision = replanner.decide(
            [_report(number, 10 * number - 1, decision.version, step, offsets)] * 2)
        counts.append(len(decision.groups))
    return counts


def test_replanner_search_finds_fewer_groups_when_they_are_faster() -> None:
    replanner = Replanner("optimal", [1 << 20] * 16, nodes=2)
    counts = drive(replanner, lambda groups: 0.040 + 0.003 * groups)
    assert counts[0] > 1  # the model's plan overlaps: several groups
    assert counts[-1] < counts[0]
    assert replanner.search.state == "done" and replanner.search.overhead_s > 0


def _backward_moving_after(moves_after: int, number: int, sizes: int) -> list[float]:
    """Ready offsets of round ``number``: 2 ms of backward per layer, 20 % faster (below
    DRIFT) after round ``moves_after``."""
    per_layer = 0.002 if number <= moves_after else 0.0016
    return [per_layer * (sizes - 1 - i) for i in range(sizes)]


def test_the_kept_trial_runs_as_measured_when_the_profile_moved_since() -> None:
    """The search keeps a trial's groups, not its overhead alone: the model's plan for the
    kept overhead moves with the backward profile (a 4-group trial measured 51.9 ms came
    back as 7 groups that ran 60-64 ms)."""
    replanner = Replanner("optimal", [1 << 20] * 16, nodes=2)
    sizes = len(replanner.sizes_bytes)
    decision = replanner.decide([_report(0, -1, 0, 0.0, [])] * 2)
    counts = []
    for number in range(1, 10):
        offsets = _backward_moving_after(3, number, sizes)
        step = 0.040 + 0.003 * abs(len(decision.groups) - 6)  # six groups run fastest
        decision = replanner.decide(
            [_report(number, 10 * number - 1, decision.version, step, offsets)] * 2)
        counts.append(len(decision.groups))
    best = replanner.search.best
    assert replanner.search.state == "done" and best is not None and best.groups == 6
    assert replanner.cost is not None
    model = replanner._plan(replanner.cost, replanner.backward_s, best.overhead_s)[0]
    assert len(model) != 6  # the model alone would now run another plan
    assert decision.groups == [list(group) for group in best.plan], counts
    assert counts[-1] == 6


def test_replanner_search_keeps_the_model_plan_when_it_is_fastest() -> None:
    replanner = Replanner("optimal", [1 << 20] * 16, nodes=2)
    counts = drive(replanner, lambda groups: 0.040 + 0.004 * (16 - groups))  # overlap pays
    assert replanner.search.state == "done" and replanner.search.overhead_s == 0.0
    assert counts[-1] == counts[0] > 1  # back to the model's plan


def test_no_search_for_fixed_planners_one_node_or_a_compressed_start() -> None:
    assert Replanner("syncea", [1 << 20] * 4, nodes=2).search.state == "off"
    assert Replanner("optimal", [1 << 20] * 4, nodes=1).search.state == "off"
    assert Replanner("optimal", [1 << 20] * 4, nodes=2,
                     compression="topk:0.01").search.state == "off"
    assert Replanner("optimal", [1 << 20] * 4, nodes=2).search.state == "measuring"


def drive_compressed(replanner: Replanner, step_of, rounds: int) -> list[tuple[str, int, str]]:
    """Like ``drive`` for a compressed job: ``step_of(exchange, groups)``; returns (exchange,
    groups, search state) per round."""
    sizes = len(replanner.sizes_bytes)
    offsets = [0.002 * (sizes - 1 - i) for i in range(sizes)]
    decision = replanner.decide([_report(0, -1, 0, 0.0, [])] * 2)
    ran = []
    for number in range(1, rounds):
        kind = decision.exchanges[0]
        step = step_of(kind, len(decision.groups))
        ran.append((kind, len(decision.groups), decision.search))
        decision = replanner.decide(
            [_report(number, 10 * number - 1, decision.version, step, offsets, GAINS)] * 2)
    return ran


GAINS = [[0.1, 0.6], [0.01, 0.15], [0.001, 0.038]]  # what the nodes report for topk:auto
# (slope 0.6: steeper than ASSUMED_SLOPE, so the first solve is final and these trials run
# undisturbed by a re-solve)


def test_a_compressed_job_that_chose_dense_searches_its_plan_like_a_dense_job() -> None:
    """On loopback a compressed job measures dense fastest; its dense plan must then be as
    fast as a job without compression would make it: the same measured search."""
    replanner = Replanner("optimal", [1 << 20] * 16, nodes=2, compression="topk:0.01")

    def step_of(kind: str, groups: int) -> float:
        # Compressed slower; dense: fewer groups faster, and the search's middle plans are
        # more than RETRIAL_CHANGE slower than the plan dense was chosen with.
        return 0.2 if kind != "dense" else 0.040 + (0.050 if 1 < groups < 12 else 0.0) \
            + 0.001 * groups

    ran = drive_compressed(replanner, step_of, 16)
    chosen = 1 + max(i for i, (kind, _, _) in enumerate(ran) if kind != "dense")
    assert ran[chosen][2] == "off"  # the round that chose dense: no search yet
    assert chosen < 4 and all(kind == "dense" for kind, _, _ in ran[chosen:]), ran
    assert "measuring" in {state for _, _, state in ran}
    assert replanner.search.state == "done" and ran[-1][1] == 1, ran
    trials = replanner.choice.policy.trials if replanner.choice.policy else None
    assert trials is not None and trials.reference_s == pytest.approx(step_of("dense", 1))


def test_a_compressed_job_searches_the_plan_of_the_compressed_candidate_it_chose() -> None:
    """At 1 Gbit/s the model's multi-group plan for allgather@0.01 ran 90-100 ms where one
    group ran 74: the chosen compressed candidate's plan is searched like a dense job's."""
    replanner = Replanner("optimal", [1 << 20] * 16, nodes=2, compression="topk:0.01")

    def step_of(kind: str, groups: int) -> float:
        # Dense slower; compressed: fewer groups faster, the middle plans >50 % slower than
        # the plan the candidate was chosen with (the watch must not re-measure then).
        return 0.2 if kind == "dense" else 0.050 + (0.040 if 1 < groups < 12 else 0.0) \
            + 0.001 * groups

    ran = drive_compressed(replanner, step_of, 16)
    trial = next(i for i, (kind, _, _) in enumerate(ran) if kind == "allgather")
    assert ran[trial][2] == "off" and ran[trial][1] > 1  # its trial: the model's plan
    assert "measuring" in {state for _, _, state in ran}
    assert replanner.search.state == "done" and ran[-1] == ("allgather", 1, "done"), ran
    assert [kind for kind, _, _ in ran].count("dense") <= 1  # measured once, never again
    trials = replanner.choice.policy.trials if replanner.choice.policy else None
    assert trials is not None and trials.epoch == 0
    assert trials.reference_s == pytest.approx(step_of("allgather", 1))


def test_dense_measured_with_the_searched_plan_wins_back_on_loopback() -> None:
    """Loopback, ``topk:auto``: dense's trial runs the model's many groups (68 ms) and loses
    to ``allgather@0.1``'s (60 ms); the allgather's search finds one group at 52 ms. Dense
    then runs a round planned as that search found best (one group, 48 ms) and wins; its own
    search starts from there (one group: nothing above it) and ends at once."""
    replanner = Replanner("optimal", [1 << 20] * 16, nodes=2, compression="topk:auto")

    def step_of(kind: str, groups: int) -> float:
        one_group = {"dense": 0.048, "allgather": 0.052}[kind]
        return one_group if groups == 1 else one_group + 0.020 - 0.012 * (kind != "dense")

    ran = drive_compressed(replanner, step_of, 24)
    kinds = [kind for kind, _, _ in ran]
    first_dense = kinds.index("dense")
    assert ran[first_dense][1] > 1 and ran[first_dense][2] == "off", ran  # the model's plan
    searched = kinds.index("allgather", first_dense)
    assert ("allgather", 1, "measuring") in ran[searched:], ran
    replay = kinds.index("dense", searched)
    assert ran[replay] == ("dense", 1, "off"), ran  # the allgather's searched plan
    assert ran[replay + 1:] == [("dense", 1, "done")] * (len(ran) - replay - 1), ran
    policy = replanner.choice.policy
    assert policy is not None and policy.trials.chosen == DENSE and policy.trials.epoch == 0
    assert replanner.search is replanner.choice.searches[DENSE]


def test_a_finalist_slower_on_the_searched_plan_leaves_the_compressed_choice() -> None:
    """The same, but dense gains nothing from one group: one round of it, then the searched
    allgather runs on, and its search is not started again."""
    replanner = Replanner("optimal", [1 << 20] * 16, nodes=2, compression="topk:auto")

    def step_of(kind: str, groups: int) -> float:
        if kind == "dense":
            return 0.068
        return 0.052 if groups == 1 else 0.060

    ran = drive_compressed(replanner, step_of, 24)
    kinds = [kind for kind, _, _ in ran]
    assert kinds.count("dense") == 2, ran  # the trial and the round on the searched plan
    assert ran[-8:] == [("allgather", 1, "done")] * 8, ran
    policy = replanner.choice.policy
    chosen = policy.trials.chosen if policy is not None else None
    assert chosen is not None and chosen.exchange == "allgather", chosen


def test_each_chosen_candidate_has_its_own_search() -> None:
    replanner = Replanner("optimal", [1 << 20] * 16, nodes=2, compression="topk:0.01")
    drive_compressed(replanner, lambda kind, g: 0.2 if kind == "dense" else 0.05 + 0.001 * g,
                     16)
    policy = replanner.choice.policy
    assert policy is not None and policy.trials.chosen is not None
    searched = replanner.choice.searches[policy.trials.chosen]
    assert searched is replanner.search and searched.done
    assert searched.overhead_s == replanner.choice.overhead_of(policy.trials.chosen) > 0
    assert replanner.choice.overhead_of(DENSE) == 0.0  # never chosen: planned as the model says


def test_a_long_job_keeps_a_bounded_number_of_searches() -> None:
    """Every re-measuring may settle on a new ratio, so a new candidate: a job that runs
    for weeks must not keep a search for each."""
    from commd.coordinator.compressed_choice import MAX_SEARCHES
    from commd.coordinator.exchange_trials import Candidate

    replanner = Replanner("optimal", [1 << 20] * 16, nodes=2, compression="topk:0.01")
    policy = replanner.choice.policy
    assert policy is not None
    for number in range(3 * MAX_SEARCHES):
        candidate = Candidate("allgather", 0.01 + number * 1e-4)
        policy.trials.chosen = policy.running = replanner.choice.next = candidate
        replanner.search = replanner.choice.search(replanner.search)
        assert replanner.search is replanner.choice.searches[candidate]
    assert len(replanner.choice.searches) == MAX_SEARCHES
    assert Candidate("allgather", 0.01) not in replanner.choice.searches  # the oldest went first


def test_a_forced_exchange_searches_once_its_ratio_is_settled() -> None:
    replanner = Replanner("optimal", [1 << 20] * 16, nodes=2,
                          compression="topk:auto:allgather")
    ran = drive_compressed(replanner, lambda kind, g: 0.05 + 0.002 * g, 24)
    assert {kind for kind, _, _ in ran} == {"allgather"}  # never measured against dense
    assert ran[1][2] == "off"  # exploring ratios: no search
    assert replanner.search.state == "done" and ran[-1][1] == 1, ran
    policy = replanner.choice.policy
    assert policy is not None and policy.settled == policy.running


def test_the_explored_ratios_run_one_group_each_then_the_chosen_plan_is_searched() -> None:
    """`topk:auto` compares its explored ratios by their steps: on the same plan (one group,
    the first plan's), not the model's many groups for one and one group for the other."""
    replanner = Replanner("optimal", [1 << 20] * 16, nodes=2,
                          compression="topk:auto:allgather")
    policy = replanner.choice.policy
    assert policy is not None
    sizes = len(replanner.sizes_bytes)
    offsets = [0.002 * (sizes - 1 - i) for i in range(sizes)]
    decision = replanner.decide([_report(0, -1, 0, 0.0, [])] * 2)
    explored = []
    for number in range(1, 12):
        if policy.exploring:
            explored.append((policy.ratio, len(decision.groups)))
        decision = replanner.decide([_report(number, 10 * number - 1, decision.version,
                                             0.05, offsets, GAINS)] * 2)
        if not policy.exploring and len(decision.groups) > 1:
            break
    assert {ratio for ratio, _ in explored} == {0.1}  # the smaller ratios' gains come with it
    assert all(groups == 1 for _, groups in explored), explored
    assert not policy.exploring and len(decision.groups) > 1  # the model's plan, to search


def test_a_new_ratio_starts_from_the_nearest_searched_plan() -> None:
    """The per-group overhead a search measured belongs to the node and the job more than to
    the ratio: a re-solved ratio's trial and search start from the nearest compressed
    candidate's fastest plan (the same exchange first), where from the model's plan a job
    searched again after every re-solve. Dense lends and borrows nothing."""
    replanner = Replanner("optimal", [1 << 20] * 16, nodes=3, compression="topk:auto")
    choice = replanner.choice
    policy = choice.policy
    assert policy is not None and policy.exploring
    policy._timed.update({0.1, 0.01})  # exploration over
    policy._gained.update({0.1, 0.01, 0.001})
    assert not policy.exploring

    def searched(overheads_steps: list[tuple[float, float]]) -> PlanSearch:
        search = PlanSearch()
        for overhead, step in overheads_steps:
            search.overhead_s = overhead
            search.observe([[0], [1], [2]], step, 1e-4, lambda o: [[0, 1, 2]])
        return search

    choice.searches = {
        Candidate("allgather", 0.025): searched([(0.0, 0.070), (0.004, 0.060), (0.016, 0.065)]),
        Candidate("allreduce", 0.05): searched([(0.0, 0.050), (0.064, 0.080)]),
        DENSE: searched([(0.0, 0.040)]),
    }
    assert choice.overhead_of(Candidate("allgather", 0.05)) == 0.004  # its fastest so far
    assert choice.overhead_of(Candidate("allreduce", 0.01)) == 0.0  # allreduce's fastest
    choice.searches.pop(Candidate("allreduce", 0.05))
    assert choice.overhead_of(Candidate("allreduce", 0.01)) == 0.004  # the nearest other
    choice.searches[DENSE] = searched([(0.0, 0.050), (0.016, 0.040)])
    assert choice.overhead_of(DENSE) == choice.searches[DENSE].overhead_s  # its own
    choice.searches.pop(Candidate("allgather", 0.025))
    assert choice.overhead_of(Candidate("allgather", 0.05)) == 0.0  # not dense's


def test_drift_replans_switch_only_for_a_predicted_gain() -> None:
    from commd.plan import evaluate

    sizes = [1 << 20] * 16
    replanner = Replanner("optimal", sizes, nodes=1)
    offsets = [0.002 * (15 - i) for i in range(16)]
    replanner.decide([_report(0, -1, 0, 0.0, [])])
    best = replanner.decide([_report(1, 9, 1, 0.0, offsets)]).groups
    assert len(best) > 1
    # The same plan with one boundary moved by a layer: about as good, not worth a switch.
    nudged = [list(g) for g in best]
    if len(nudged[0]) > 1:
        nudged[1].insert(0, nudged[0].pop())
    else:
        nudged[0].append(nudged[1].pop(0))
    nudged = [sorted(g) for g in nudged if g]
    assert replanner.planning_cost is not None
    timings = [evaluate(g, sizes, replanner.backward_s, replanner.planning_cost).iteration_s
               for g in (best, nudged)]
    assert abs(timings[0] - timings[1]) < 0.01 * timings[0]
    replanner.groups = nudged
    assert not replanner._worth_switching(best)
    replanner.groups = [list(range(16))]  # one group: no overlap at all
    assert replanner._worth_switching(best)


def test_search_waits_while_the_model_plans_one_group_and_remembers_it() -> None:
    search = PlanSearch()
    one = [list(range(16))]
    assert search.observe(one, 0.050, 0.0, plan_for) == "" and search.state == "measuring"
    assert search.observe(one, 0.048, 0.0, plan_for) == ""  # the newest replaces it
    assert [t.step_s for t in search.trials] == [0.048]
    # A drift re-plan made it 16 groups (overhead still 0): now the search runs.
    assert search.observe(plan_for(0.0), 0.070, 0.0, plan_for).startswith("plan search: try")
    while not search.done:  # 8, 4, 2 groups: all slower than the one group measured first
        search.observe(plan_for(search.overhead_s), 0.065, 0.0, plan_for)
    # One group measured fastest: an overhead that gives one group whatever a is fitted.
    assert search.best is not None and search.best.groups == 1
    assert len(plan_for(search.overhead_s)) == 1


def test_a_finalist_runs_the_lenders_kept_groups_and_the_lender_its_own_again() -> None:
    """Dense chosen, its search keeps four groups; the allgather's trial was close, so it
    runs a round "planned as dense's search": dense's kept groups as they ran, not the
    model's plan of a compressed candidate for dense's overhead (three groups here); it
    loses, and dense runs its kept groups again (on loopback dense came back as the model's
    10 groups at 63 ms where its search had kept 4 at 48)."""
    replanner = Replanner("optimal", [1 << 20] * 16, nodes=2, compression="topk:0.01")
    sizes = len(replanner.sizes_bytes)
    decision = replanner.decide([_report(0, -1, 0, 0.0, [])] * 2)
    ran = []
    for number in range(1, 16):
        offsets = _backward_moving_after(4, number, sizes)
        kind, groups = decision.exchanges[0], len(decision.groups)
        # dense: four groups run fastest; the allgather, close by its trial, loses
        step = (0.040 + 0.003 * abs(groups - 4) if kind == "dense"
                else 0.050 if groups == 4 else 0.060)
        ran.append((kind, decision.groups))
        decision = replanner.decide(
            [_report(number, 10 * number - 1, decision.version, step, offsets, GAINS)] * 2)
    best = replanner.choice.searches[DENSE].best
    assert best is not None and best.groups == 4, ran
    kept = [list(group) for group in best.plan]
    finalist = [groups for kind, groups in ran if kind == "allgather"]
    assert len(finalist) == 2 and finalist[1] == kept, ran  # its trial, then dense's groups
    assert replanner.choice.policy is not None and replanner.choice.policy.trials.chosen == DENSE
    after = ran[[kind for kind, _ in ran].index("allgather", 2) + 1:]
    assert after and all(run == ("dense", kept) for run in after), after
