"""PowerSGD's pieces: the spec, which layers compress, the orthogonalisation against torch's,
the coordinator's plan and the node's check of a plan's exchanges."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

from commd.compression.lowrank import (
    LOW_RANK,
    form_group,
    initial_q,
    layer_wire_elements,
    orthogonalize,
    should_compress,
)
from commd.compression.spec import HALF, LowRankSpec, parse_compression
from commd.coordinator.choice import DenseChoice, RoundPlanner
from commd.coordinator.compressed_choice import choice_for
from commd.coordinator.lowrank_choice import CPU_S_PER_BYTE, GROUP_S, HalfChoice, LowRankChoice
from commd.job.half import scaled_from_half, scaled_to_half
from commd.job.validation import plan_problem
from commd.plan import LinearCost
from commd_protocol import PeerPlan
from commd_protocol.layout import backward_offsets


def test_the_spec_reads_torchs_settings() -> None:
    assert parse_compression("powersgd:4") == LowRankSpec(4)
    spec = parse_compression("powersgd:2:start=100:min_rate=3:feedback=0:warm=0:epsilon=1e-8"
                             ":seed=7")
    assert spec == LowRankSpec(2, 100, 3.0, False, False, 1e-8, 7)
    assert parse_compression(str(spec)) == spec  # what the DDP wrapper registers reads back
    assert parse_compression("powersgd:1:start=0:feedback=0:warm=0") == LowRankSpec(
        1, 0, feedback=False, warm=False)


@pytest.mark.parametrize(("text", "says"), [
    ("powersgd", "not understood"),
    ("powersgd:", "not understood"),
    ("powersgd:0", "rank must be in 1..64"),
    ("powersgd:65", "rank must be in 1..64"),
    ("powersgd:-1", "not understood"),
    ("powersgd:2.5", "not understood"),
    ("powersgd:4:start=1", "start must be ≥ 2"),
    ("powersgd:4:start=99999999999", "start must be in"),
    ("powersgd:4:start=1e3", "not a whole number"),
    ("powersgd:4:rank=3", "option 'rank' is not known"),
    ("powersgd:4:start=3:start=4", "given twice"),
    ("powersgd:4:min_rate=0.5", "min_rate must be ≥ 1"),
    ("powersgd:4:min_rate=inf", "not understood"),
    ("powersgd:4:min_rate=1e999", "finite"),
    ("powersgd:4:feedback=2", "0 or 1"),
    ("powersgd:4:epsilon=1", "epsilon must be in"),
    ("powersgd:4:epsilon=nan", "not understood"),
    ("powersgd:4:seed=4294967296", "seed must be in"),
    ("powersgd:4:START=3", "not understood"),
    ("powersgd:4::start=3", "not understood"),
    ("powersgd:4:start=3" + ":warm=1" * 30, "not understood"),  # oversized
])
def test_bad_specs_are_refused_naming_what_is_wrong(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_compression(text)


def test_which_layers_compress_is_torchs_rule() -> None:
    assert should_compress(12, 7, 2, 2.0)  # (12 + 7)·2·2 = 76 < 84
    assert not should_compress(8, 5, 2, 2.0)  # 52 ≥ 40
    spec = LowRankSpec(2)
    assert layer_wire_elements(84, 12, spec) == 38
    assert layer_wire_elements(40, 8, spec) == 40
    assert layer_wire_elements(7, 0, spec) == 7
    assert layer_wire_elements(10, 3, spec) == 10  # rows that do not divide: never compressed


def test_a_group_lays_out_vectors_first_then_each_p_and_q() -> None:
    sizes = [84, 1, 40, 144, 7]
    rows = [12, 0, 8, 16, 0]
    offsets = backward_offsets(sizes)
    form = form_group([0, 1, 2, 3, 4], sizes, rows, offsets, 0, LowRankSpec(2))
    assert [m.layer for m in form.matrices] == sorted([0, 3], key=lambda i: offsets[i])
    assert form.vector_elements == 1 + 40 + 7
    assert form.first_elements == 48 + 12 * 2 + 16 * 2
    assert form.second_elements == 7 * 2 + 9 * 2
    ends = [start + size for start, size in form.vectors]
    assert ends == sorted(ends) and all(size > 0 for _, size in form.vectors)
    # one group of a later plan starts mid-buffer: offsets are relative to its span
    alone = form_group([1], sizes, rows, offsets, offsets[1], LowRankSpec(2))
    assert alone.vectors == ((0, 1),) and not alone.matrices


@pytest.mark.parametrize("rank", [1, 2, 4])
def test_orthogonalisation_spans_what_torchs_does(rank: int) -> None:
    rng = np.random.default_rng(rank)
    matrix = rng.standard_normal((30, rank)).astype(np.float32)
    ours = matrix.copy()
    orthogonalize(ours)
    theirs = torch.from_numpy(matrix.copy()).unsqueeze(0)
    powerSGD_hook._orthogonalize(theirs)
    np.testing.assert_allclose(ours.T @ ours, np.eye(rank), atol=1e-5)
    # the same projection (QR's column signs are the library's choice)
    np.testing.assert_allclose(ours @ ours.T, (theirs[0] @ theirs[0].T).numpy(), atol=1e-5)


def test_a_zero_column_stays_zero_where_torchs_turns_to_nan() -> None:
    matrix = np.zeros((5, 2), dtype=np.float32)
    orthogonalize(matrix)
    assert np.all(matrix == 0)


def test_the_first_q_is_the_same_everywhere_and_orthonormal() -> None:
    a, b = initial_q(3, 5, 0, 20, 2, 0.0), initial_q(3, 5, 0, 20, 2, 0.0)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(a.T @ a, np.eye(2), atol=1e-5)
    assert not np.array_equal(a, initial_q(3, 6, 0, 20, 2, 0.0))


def test_the_coordinator_plans_low_rank_groups_for_the_factors_bytes() -> None:
    sizes, rows = [84, 1, 144, 7], [12, 0, 16, 0]
    choice = choice_for("powersgd:2", 2, 4, sizes, rows)
    assert isinstance(choice, LowRankChoice)
    assert choice.wire_share == pytest.approx((38 + 1 + 50 + 7) / 236)
    planner = RoundPlanner("wfbp", [s * 4 for s in sizes], [1e-3] * 4)
    planned = choice.plan(LinearCost(1e-4, 1e-9), 0.0, planner)
    assert planned.exchanges == [LOW_RANK] * len(planned.groups)
    # two all-reduces per group, and the node's own work per group and per byte
    assert planned.line.alpha_s == pytest.approx(2e-4 + GROUP_S)
    assert planned.line.beta_s_per_byte == pytest.approx(1e-9 * choice.wire_share
                                                         + CPU_S_PER_BYTE)


def test_a_node_refuses_exchanges_of_another_compression() -> None:
    plan = _plan([LOW_RANK, LOW_RANK])
    spec = parse_compression("powersgd:2")
    assert plan_problem(plan, 2, spec) == ""
    assert "unknown exchanges ['lowrank']" in plan_problem(plan, 2, None)
    assert "unknown exchanges ['lowrank']" in plan_problem(plan, 2, parse_compression("topk:0.1"))
    topk = _plan(["allgather", "dense"])
    assert "unknown exchanges ['allgather']" in plan_problem(topk, 2, spec)


def _plan(exchanges: list[str]) -> PeerPlan:
    return PeerPlan(job="j", round=1, effective_iteration=12, version=2, groups=[[1], [0]],
                    alpha_s=1e-4, beta_s_per_byte=1e-9, predicted_comm_s=0.01,
                    exchanges=exchanges)


def test_fp16_plans_dense_groups_for_half_the_bytes() -> None:
    choice = choice_for("fp16", 2, 4, [84, 7], [12, 0])
    assert isinstance(choice, HalfChoice)
    planner = RoundPlanner("wfbp", [84 * 4, 7 * 4], [1e-3, 1e-3])
    planned = choice.plan(LinearCost(1e-4, 1e-9), 0.0, planner)
    assert planned.exchanges == [HALF] * len(planned.groups)
    assert planned.line.beta_s_per_byte == pytest.approx(0.5e-9)
    assert isinstance(choice_for("fp16", 2, 2), DenseChoice)  # 16-bit gradients: as they are
    assert plan_problem(_plan([HALF, HALF]), 2, parse_compression("fp16")) == ""
    assert plan_problem(_plan([HALF, LOW_RANK]), 2, parse_compression("auto")) == ""
    assert "unknown exchanges ['lowrank']" in plan_problem(_plan([HALF, LOW_RANK]), 2,
                                                           parse_compression("fp16"))


def test_the_half_wire_divides_before_the_cast_and_multiplies_after() -> None:
    total = np.array([3.0, 65504.0 * 3, 1e-3, -7.25], dtype=np.float32)
    wire = np.empty(4, dtype=np.float16)
    scaled_to_half(total, wire, 1 / 4)
    # 65504 · 3 overflows float16 as a sum, not as a quarter of it (torch divides first)
    assert np.isfinite(wire).all()
    back = np.empty(4, dtype=np.float32)
    scaled_from_half(back, wire, 4.0)
    np.testing.assert_allclose(back, [3.0, 65504.0 * 3, 1e-3, -7.25], rtol=1e-3)
