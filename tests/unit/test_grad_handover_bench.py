"""bench/grad_handover.py's summary: paired ratios of adjacent steps, and its refusals."""

from __future__ import annotations

import pytest
from bench_scripts import assert_usage_error, load_bench_script

bench = load_bench_script("grad_handover.py", "bench_grad_handover")


def test_the_paired_ratio_is_the_median_of_adjacent_steps_ratios() -> None:
    # a slow spell (the third pair) hits both ways: the pairs' ratios stay 0.9
    fresh, zeroed = [0.9, 0.9, 9.0, 0.9], [1.0, 1.0, 10.0, 1.0]
    assert bench.paired_ratio(fresh, zeroed) == pytest.approx(0.9)
    assert bench.paired_ratio([2.0, 1.0, 1.0], [1.0, 1.0, 1.0]) == pytest.approx(1.0)


@pytest.mark.parametrize(("fresh", "zeroed"), [([], []), ([1.0], [1.0, 2.0])])
def test_the_paired_ratio_refuses_series_that_do_not_pair(fresh: list[float],
                                                           zeroed: list[float]) -> None:
    with pytest.raises(ValueError, match="equally long"):
        bench.paired_ratio(fresh, zeroed)


def test_a_summary_row_pairs_the_shorter_series() -> None:
    result = {"steps": {"fresh": [0.040, 0.050, 0.045], "zeroed": [0.050, 0.050]},
              "backwards": {"fresh": [0.020, 0.020], "zeroed": [0.025, 0.025]}}
    row = bench.summary_row("topk:0.04", result)
    assert row == ["topk:0.04", "45.0", "50.0", "0.900", "20.0", "25.0", "0.800"]


@pytest.mark.parametrize(("argv", "says"), [
    (["--steps", "1"], "--steps must be at least 2"),
    (["--warmup", "-1"], "--warmup must not be negative"),
    (["--compression", "topk:2"], "--compression 'topk:2'"),
    (["--compression", "none,gzip"], "--compression 'gzip'"),
])
def test_bad_options_are_refused_before_anything_starts(
        argv: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert_usage_error(bench.main, argv, says, capsys)
