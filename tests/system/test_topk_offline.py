"""bench/topk_offline.py: each variant's bookkeeping loses nothing when it sends everything,
the warm-up runs dense, and bad options are refused with a clear error."""

from __future__ import annotations

import pytest
from bench_scripts import assert_usage_error, load_bench_script

STEPS = 3  # the loss of a short run is the mean over its steps: every update counts

offline = load_bench_script("topk_offline.py", "bench_topk_offline")


@pytest.fixture(scope="module")
def dense_loss() -> float:
    return float(offline.train("dense", 1.0, 0, STEPS))


@pytest.mark.parametrize("variant", ["mc", "layer", "global", "ef21"])
def test_top_k_of_everything_trains_as_dense(variant: str, dense_loss: float) -> None:
    """k = every element: residuals, velocities and estimates must hand on the whole
    gradient, so the run is dense momentum SGD (float rounding apart)."""
    assert offline.train(variant, 1.0, 0, STEPS) == pytest.approx(dense_loss, rel=1e-5)


def test_momentum_masking_at_k_everything_drops_the_momentum(dense_loss: float) -> None:
    # DGC's masking clears the velocity wherever it sent: at k = all, SGD without momentum.
    assert offline.train("mask", 1.0, 0, STEPS) != pytest.approx(dense_loss, rel=1e-5)


@pytest.mark.parametrize("variant", offline.VARIANTS)
def test_warm_up_steps_run_dense(variant: str, dense_loss: float) -> None:
    assert offline.train(variant, 0.001, 0, STEPS, dense_steps=STEPS) == pytest.approx(
        dense_loss, rel=1e-5)


def test_a_small_ratio_changes_the_training(dense_loss: float) -> None:
    warmed = offline.train("mc", 0.001, 0, STEPS, dense_steps=1)
    assert warmed != pytest.approx(dense_loss, rel=1e-5)


@pytest.mark.parametrize("argv, complaint", [
    (["--variants", "mc,nope"], "unknown variants ['nope']"),
    (["--ratios", "0.1,abc"], "--ratios: not a list of numbers"),
    (["--ratios", "0"], "ratios in (0, 1]"),
    (["--ratios", "1.5"], "ratios in (0, 1]"),
    (["--ratios", ","], "ratios in (0, 1]"),
    (["--dense-steps", "150"], "--dense-steps < --steps"),
    (["--dense-steps", "-1"], "0 ≤ --dense-steps"),
    (["--steps", "5"], "--steps ≥ 10"),
    (["--streams", "0"], "--streams ≥ 1"),
])
def test_bad_options_are_refused_before_any_training(
        argv: list[str], complaint: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert_usage_error(offline.main, argv, complaint, capsys)
