"""The new fields of compressed jobs' reports and plans: happy paths and hostile values."""

from __future__ import annotations

import math

import msgspec
import pytest

from commd.coordinator.validation import profile_problem
from commd.job.validation import plan_problem
from commd_protocol import PeerPlan, PeerProfile


def plan(**fields: object) -> PeerPlan:
    base: dict[str, object] = {
        "job": "j", "round": 1, "effective_iteration": 12, "version": 2, "groups": [[0, 1]],
        "alpha_s": 1e-4, "beta_s_per_byte": 1e-9, "predicted_comm_s": 0.01,
        "exchanges": ["allreduce"], "ratio": 0.01,
    }
    return PeerPlan(**{**base, **fields})  # type: ignore[arg-type]


def test_a_plan_with_its_candidates_is_accepted() -> None:
    good = plan(selection="measured",
                candidates=[("dense", 0.04, 0.046), ("allreduce@0.01", 0.03, -1.0)])
    assert plan_problem(good, 2) == ""
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(good), type=PeerPlan)
    assert wire.candidates == [("dense", 0.04, 0.046), ("allreduce@0.01", 0.03, -1.0)]


@pytest.mark.parametrize("fields, named", [
    ({"selection": "chosen-by-me"}, "selection"),
    ({"selection": "x" * 10_000}, "selection"),
    ({"candidates": [("dense", 0.1, -1.0)] * 9}, "candidates"),
    ({"candidates": [("d" * 41, 0.1, -1.0)]}, "candidates"),
    ({"candidates": [("dense", math.nan, -1.0)]}, "candidates"),
    ({"candidates": [("dense", 0.1, -2.0)]}, "candidates"),
    ({"candidates": [("dense", math.inf, 0.1)]}, "candidates"),
    ({"choice": "auto: " + "x" * 5000}, "choice"),
])
def test_a_hostile_plan_is_refused_naming_the_field(fields: dict[str, object],
                                                     named: str) -> None:
    problem = plan_problem(plan(**fields), 2)
    assert named in problem, problem


def test_candidates_of_the_wrong_shape_do_not_decode() -> None:
    frame = msgspec.msgpack.encode({**msgspec.to_builtins(plan()), "type": "peer_plan",
                                    "candidates": [["dense", "fast", 1]]})
    with pytest.raises(msgspec.ValidationError, match="candidates"):
        msgspec.msgpack.decode(frame, type=PeerPlan)


@pytest.mark.parametrize("cpu, ok", [
    ([], True), ([2e-9, 3e-9, 1e-4], True),
    ([0.0, 3e-9, 0.0], True),  # 0: this node did not select
    ([1e-9, 1e-9], False), ([1e-9, 1e-9, 1e-9, 1e-9], False), ([math.nan, 1e-9, 0.0], False),
    ([-1e-9, 1e-9, 0.0], False), ([1e-9, 1.0, 0.0], False), ([1e-9, 1e-9, -1.0], False),
    ([1e-9, 1e-9, math.inf], False), ([1e-9, 1e-9, 3600.0], False),
])
def test_cpu_costs_in_a_report(cpu: list[float], ok: bool) -> None:
    report = PeerProfile(job="j", round=1, iteration=9, cpu_s_per_element=cpu)
    problem = profile_problem(report, 2)
    assert (problem == "") == ok, problem
    if not ok:
        assert "cpu_s_per_element" in problem


def test_the_status_table_says_which_candidate_was_measured_and_which_predicted() -> None:
    from commd.cli.status import render
    from commd_protocol.status import read_status

    status = read_status({"version": "x", "protocol": 2, "backend": "gloo", "uptime_s": 1.0,
                          "jobs": [{"job": "j", "state": "running", "world_size": 4,
                                    "compression": "topk:0.01", "ratio": 0.01,
                                    "exchanges": ["allreduce"], "selection": "measured",
                                    "candidates": [
                                        {"name": "allreduce@0.01", "predicted_s": 0.0098,
                                         "measured_s": 0.0746},
                                        {"name": "dense", "predicted_s": 1.2,
                                         "measured_s": None}]}]})
    lines = render(status).splitlines()
    assert any(line.endswith("exchange measured") for line in lines), lines
    assert ("j: candidates (ms per iteration): allreduce@0.01 predicted 9.8 measured 74.6, "
            "dense predicted 1200.0") in lines


@pytest.mark.parametrize("gains, named", [
    ([[0.1, 0.4], [0.01, 0.1], [0.001, 0.02]], ""),  # the ratio run and two worked out
    ([[0.1 / (i + 1), 0.5] for i in range(33)], "gains has 33 rows, at most 32"),
    ([[0.0, 0.5]], "gains row"), ([[0.1, math.nan]], "gains row"), ([[0.1]], "gains row"),
])
def test_gains_in_a_report(gains: list[list[float]], named: str) -> None:
    problem = profile_problem(PeerProfile(job="j", round=1, iteration=9, gains=gains), 2)
    assert (problem == "") == (named == "") and named in problem, problem
