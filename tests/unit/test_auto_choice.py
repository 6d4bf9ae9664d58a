"""``compression="auto"``'s decisions, fed report rounds as the coordinator's Replanner feeds
them (pure: no daemon)."""

from __future__ import annotations

from commd.compression.lowrank import LOW_RANK
from commd.compression.spec import HALF, AutoSpec, HalfSpec, parse_compression
from commd.coordinator.auto_choice import (
    DENSE,
    GAIN_ROUNDS,
    HALF_SHARE,
    NETWORK_SHARE,
    PAYS,
    WATCH_ROUNDS,
    AutoChoice,
)
from commd.coordinator.choice import DenseChoice, RoundPlanner
from commd.coordinator.compressed_choice import choice_for
from commd.plan import LinearCost
from commd_protocol import PeerProfile

SIZES = [256 * 512, 512, 512 * 128, 128]  # two matrices, two vectors
ROWS = [256, 0, 512, 0]
PLANNER = RoundPlanner("wfbp", [s * 4 for s in SIZES], [2e-3] * 4)
COST = LinearCost(1e-4, 1e-8)


def rounds(step_s: float, comm_s: float, round_number: int, gain: float = 1.0,
           nodes: int = 2) -> list[PeerProfile]:
    return [PeerProfile(job="j", round=round_number, iteration=10 * round_number - 1,
                        step_s=step_s, measured_comm_s=comm_s, gains=[[1.0, gain]])
            for _ in range(nodes)]


def feed(choice: AutoChoice, reports: list[PeerProfile]) -> str:
    """One round, as the Replanner runs it: observe, then plan and apply on a reason."""
    why = choice.observe(reports, True, [[0, 1, 2, 3]], COST, PLANNER)
    if why:
        planned = choice.plan(COST, 0.0, PLANNER)
        assert set(planned.exchanges or [DENSE]) == {choice.next}
        choice.applied(0.0)
    return why


def test_auto_parses_and_composes_its_choice() -> None:
    assert parse_compression("auto") == AutoSpec()
    assert parse_compression("fp16") == HalfSpec()
    assert isinstance(choice_for("auto", 2, 4, SIZES, ROWS), AutoChoice)
    assert isinstance(choice_for("auto", 2, 2, SIZES, ROWS), DenseChoice)  # 16-bit: dense


def test_auto_on_a_device_job_runs_dense() -> None:
    assert isinstance(choice_for("auto", 2, 4, SIZES, ROWS, "cuda"), DenseChoice)


def test_topk_auto_on_one_node_runs_dense() -> None:
    assert isinstance(choice_for("topk:auto", 1, 4), DenseChoice)
    assert not isinstance(choice_for("topk:auto", 2, 4), DenseChoice)
    assert not isinstance(choice_for("topk:0.1", 1, 4), DenseChoice)  # a ratio the user chose


def test_one_node_never_compresses_and_says_why() -> None:
    choice = AutoChoice(1, SIZES, ROWS)
    for number in range(1, 5):
        assert feed(choice, rounds(0.1, 0.09, number, nodes=1)) == ""
    assert choice.running == DENSE and choice.settled
    assert "one node" in choice.status().why


def test_a_fast_network_stays_dense_for_good() -> None:
    choice = AutoChoice(2, SIZES, ROWS)
    assert feed(choice, rounds(0.1, 0.1 * NETWORK_SHARE * 0.5, 1)) == ""
    assert choice.settled and choice.running == DENSE
    status = choice.status()
    assert status.selection == "measured" and "8% of the dense step (7.5 of 100.0 ms)" in status.why
    for number in range(2, 6):  # later rounds change nothing
        assert feed(choice, rounds(0.1, 0.09, number)) == ""
    assert choice.running == DENSE


def test_a_slow_network_runs_low_rank_and_keeps_it_when_it_pays() -> None:
    choice = AutoChoice(2, SIZES, ROWS)
    why = feed(choice, rounds(0.2, 0.1, 1))
    assert "low-rank" in why and "50% of the dense step (100.0 of 200.0 ms)" in why
    assert choice.running == LOW_RANK and not choice.settled
    for number in range(2, 2 + WATCH_ROUNDS):
        feed(choice, rounds(0.2 * PAYS * 0.7, 0.01, number, gain=0.4))
    assert choice.settled and choice.running == LOW_RANK
    status = choice.status()
    assert "keeps low-rank" in status.why and "against dense 200.0 ms" in status.why
    table = {name: measured for name, _, measured in status.candidates}
    assert list(table) == [DENSE, HALF, f"{LOW_RANK}:4"]
    assert table[DENSE] > 0 and table[f"{LOW_RANK}:4"] > 0 and table[HALF] == -1.0


def test_low_rank_that_does_not_pay_goes_back_to_dense() -> None:
    choice = AutoChoice(2, SIZES, ROWS)
    feed(choice, rounds(0.2, 0.1, 1))
    whys = [feed(choice, rounds(0.2 * PAYS * 1.05, 0.01, n, gain=0.4))
            for n in range(2, 2 + WATCH_ROUNDS)]
    assert "back to dense" in whys[-1] and choice.running == DENSE and choice.settled
    assert feed(choice, rounds(0.2, 0.1, 9)) == ""  # final: no flapping
    assert choice.running == DENSE


def test_low_rank_whose_sums_carry_too_little_is_undone() -> None:
    choice = AutoChoice(2, SIZES, ROWS)
    feed(choice, rounds(0.2, 0.1, 1))
    feed(choice, rounds(0.1, 0.01, 2, gain=0.4))
    whys = [feed(choice, rounds(0.1, 0.01, n, gain=0.01)) for n in range(3, 3 + GAIN_ROUNDS)]
    assert "carried 1.0% of the input" in whys[-1]
    assert choice.running == DENSE


def test_unmeasured_rounds_decide_nothing() -> None:
    choice = AutoChoice(2, SIZES, ROWS)
    assert choice.observe(rounds(0.2, 0.1, 0), True, [], COST, PLANNER) == ""  # the probe
    assert choice.observe(rounds(0.0, 0.1, 1), True, [], COST, PLANNER) == ""  # no step
    assert choice.observe(rounds(0.2, 0.1, 1), False, [], COST, PLANNER) == ""  # a trial
    assert not choice.settled and "until the first round" in choice.status().why


def test_layers_that_are_no_matrices_go_float16() -> None:
    choice = AutoChoice(2, SIZES, [0, 0, 0, 0])
    why = feed(choice, rounds(0.2, 0.1, 1))
    assert choice.running == HALF and "few layers are matrices" in why


def test_a_middling_network_runs_float16_and_keeps_it_when_it_pays() -> None:
    choice = AutoChoice(2, SIZES, ROWS)
    share = (NETWORK_SHARE + HALF_SHARE) / 2
    why = feed(choice, rounds(0.2, 0.2 * share, 1))
    assert choice.running == HALF and "float16 on the wire" in why and "under 30%" in why
    for number in range(2, 2 + WATCH_ROUNDS):
        feed(choice, rounds(0.2 * PAYS * 0.9, 0.01, number))
    assert choice.settled and choice.running == HALF
    assert "keeps float16 on the wire" in choice.status().why


def test_float16_that_does_not_pay_goes_back_to_dense() -> None:
    choice = AutoChoice(2, SIZES, ROWS)
    feed(choice, rounds(0.2, 0.2 * 0.2, 1))
    whys = [feed(choice, rounds(0.2, 0.01, n)) for n in range(2, 2 + WATCH_ROUNDS)]
    assert "back to dense: float16 on the wire 200.0 ms" in whys[-1]
    assert choice.running == DENSE and choice.settled
