"""bench/compression.py's target table: each auto row judged against the right baseline, with
the noise its baselines' repeats showed."""

from __future__ import annotations

from typing import Any

import pytest
from bench_scripts import assert_usage_error, load_bench_script

bench = load_bench_script("compression.py", "bench_compression")


def row(mode: str, repeats: list[float], rate: str = "1gbit") -> dict[str, Any]:
    return {"rate": rate, "mode": mode, "median_ms": sorted(repeats)[len(repeats) // 2],
            "repeat_ms": repeats}


def verdicts(rows: list[dict[str, Any]]) -> dict[str, list[str]]:
    return {cells[1]: cells[2:] for cells in bench.target_rows(rows) if cells[0] == "1gbit"}


def test_auto_within_five_percent_of_the_better_forced_exchange_is_met() -> None:
    got = verdicts([row("none", [120, 120, 120]), row("topk:0.01:allgather", [16, 16, 16]),
                    row("topk:0.01:allreduce", [15, 15, 15]),
                    row("topk:0.01:auto", [15.7, 15.7, 15.7])])
    assert got["topk:0.01:auto"] == ["0.13", "1.05", "0 %", "met"]


def test_a_gap_the_baselines_own_repeats_show_is_within_noise_and_a_wider_one_is_not() -> None:
    baselines = [row("none", [120, 121, 119]), row("topk:0.01:allgather", [16, 16, 16]),
                 row("topk:0.01:allreduce", [14, 15, 16])]  # 14 % apart
    within = verdicts([*baselines, row("topk:0.01:auto", [17, 17, 17])])
    assert within["topk:0.01:auto"][2:] == ["14 %", "within noise"]
    beyond = verdicts([*baselines, row("topk:0.01:auto", [19, 19, 19])])
    assert beyond["topk:0.01:auto"][3] == "NOT met"


def test_topk_auto_is_held_to_dense_not_to_the_forced_ratio() -> None:
    got = verdicts([row("none", [20, 20, 20]), row("topk:0.01:allgather", [15, 15, 15]),
                    row("topk:auto", [20.5, 20.5, 20.5])])
    assert got["topk:auto"] == ["1.02", "1.37", "0 %", "met"]
    slower = verdicts([row("none", [20, 20, 20]), row("topk:auto", [22, 22, 22])])
    assert slower["topk:auto"][3] == "NOT met"


def test_a_rate_without_a_dense_row_has_no_verdict() -> None:
    rows = [row("topk:0.01:allgather", [15]), row("topk:0.01:auto", [15])]
    assert bench.target_rows(rows) == [] and bench._targets(rows) == []


@pytest.mark.parametrize("argv, says", [
    (["--modes", "none,topk:autox"], "compression 'topk:autox' is not understood"),
    (["--live-mode", "topk:2"], "compression ratio must be in (0, 1], got 2"),
    (["--repeats", "0"], "must be at least 1, got 0"),
])
def test_a_bad_option_is_a_usage_error_before_anything_starts(
        argv: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert_usage_error(bench.main, argv, says, capsys)
