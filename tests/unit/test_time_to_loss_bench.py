"""bench/time_to_loss.py: its data split, its time-to-loss rule and the committed result the docs
quote (tests/system/test_time_to_loss_run.py runs the script)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from bench_scripts import BENCH, assert_usage_error, load_bench_script

bench = load_bench_script("time_to_loss.py", "bench_time_to_loss")
text_lm = bench.text_lm
COMMITTED = BENCH / "results" / "time-to-loss.json"


# --- the data -------------------------------------------------------------------------------------


def make_tree(root: Path, files: int) -> list[str]:
    """``files`` small modules under ``root`` (some in a package), and a site-packages module
    that must be ignored; returns their relative paths in sorted order."""
    names = [f"pkg/m{i:02d}.py" if i % 3 else f"m{i:02d}.py" for i in range(files)]
    for index, name in enumerate(names):
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(f"# file {index}\nVALUE = {index}\n".encode())
    (root / "site-packages").mkdir()
    (root / "site-packages" / "extra.py").write_text("IGNORED = True\n")
    (root / "notes.txt").write_text("not python\n")
    return sorted(names)


def test_every_twentieth_file_is_held_out_and_never_trained_on(tmp_path: Path) -> None:
    names = make_tree(tmp_path, 45)
    corpus = text_lm.load_corpus(10**6, root=tmp_path)
    assert corpus.held_out_files == (names[19], names[39])
    assert set(corpus.train_files) == set(names) - set(corpus.held_out_files)
    assert corpus.train == b"".join((tmp_path / n).read_bytes() for n in corpus.train_files)
    assert corpus.held_out == b"".join((tmp_path / n).read_bytes()
                                       for n in corpus.held_out_files)
    for name in corpus.held_out_files:  # each file's text is unique: "# file N"
        assert (tmp_path / name).read_bytes() not in corpus.train
    assert b"IGNORED" not in corpus.train + corpus.held_out


def test_the_budget_cuts_the_file_list_in_sorted_order(tmp_path: Path) -> None:
    names = make_tree(tmp_path, 45)
    sizes = [len((tmp_path / n).read_bytes()) for n in names]
    budget = sum(sizes[:25]) - 3  # the 25th file is cut short, the rest never read
    corpus = text_lm.load_corpus(budget, root=tmp_path)
    assert len(corpus.train) + len(corpus.held_out) == budget
    assert corpus.train_files[-1] == names[24] and corpus.held_out_files == (names[19],)


def test_the_stdlib_split_is_deterministic() -> None:
    first, second = text_lm.load_corpus(600_000), text_lm.load_corpus(600_000)
    assert first == second
    assert not set(first.train_files) & set(first.held_out_files)
    assert len(first.train) + len(first.held_out) == 600_000


def test_training_windows_come_from_the_training_text_only() -> None:
    corpus = text_lm.load_corpus(600_000)
    train = text_lm.as_tensor(corpus.train)
    stream = text_lm.Batches(train, 3, rank=1, seed=0)
    again = text_lm.Batches(train, 3, rank=1, seed=0)
    other = text_lm.Batches(train, 3, rank=0, seed=0)
    inputs, targets = stream.next()
    assert inputs.shape == targets.shape == (3, text_lm.CONTEXT)
    assert (inputs[:, 1:] == targets[:, :-1]).all()  # the next byte
    for row in range(3):
        assert bytes(inputs[row].tolist()) in corpus.train
    assert (again.next()[0] == inputs).all() and not (other.next()[0] == inputs).all()


@pytest.mark.parametrize("budget", [0, -5])
def test_a_budget_that_is_not_positive_is_refused(budget: int) -> None:
    with pytest.raises(ValueError, match="budget must be a positive"):
        text_lm.load_corpus(budget)


def test_too_few_files_for_a_held_out_one_are_refused(tmp_path: Path) -> None:
    make_tree(tmp_path, 5)
    with pytest.raises(ValueError, match="no held-out or no training file"):
        text_lm.load_corpus(10**6, root=tmp_path)


# --- time to loss ---------------------------------------------------------------------------------


def test_a_curve_reaches_the_target_at_an_evaluation() -> None:
    curve = [(0.0, 5.0), (10.0, 4.0), (20.0, 3.0), (30.0, 2.5)]
    assert bench.time_to_loss(curve, 3.0) == 20.0
    assert bench.time_to_loss(curve, 6.0) == 0.0  # already there at the start


def test_a_curve_that_never_reaches_the_target_gives_none() -> None:
    assert bench.time_to_loss([(0.0, 5.0), (10.0, 4.0), (20.0, 3.1)], 3.0) is None
    assert bench.time_to_loss([(0.0, 5.0), (10.0, math.nan)], 3.0) is None


def test_between_evaluations_the_time_is_interpolated() -> None:
    curve = [(0.0, 5.0), (10.0, 4.0), (30.0, 2.0)]
    assert bench.time_to_loss(curve, 3.0) == pytest.approx(20.0)
    assert bench.time_to_loss(curve, 3.5) == pytest.approx(15.0)
    # a worse evaluation in between: interpolate from the last finite one before the crossing
    assert bench.time_to_loss([(0.0, 5.0), (10.0, math.nan), (20.0, 3.0)], 4.0) == \
        pytest.approx(10.0)


@pytest.mark.parametrize(("curve", "says"), [
    ([], "empty curve"),
    ([(10.0, 4.0), (5.0, 3.0)], "must not decrease"),
])
def test_bad_curves_are_refused(curve: list[tuple[float, float]], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        bench.time_to_loss(curve, 3.0)


def test_the_summary_measures_against_torch_ddps_final_loss() -> None:
    def outcome(curve: list[list[float]], ms: float) -> Any:
        return bench.Outcome(repeats=[{"curve": curve, "step_ms": [ms] * 3, "agree": True,
                                       "ran": ""}])

    torch = outcome([[0, 0.0, 5.0], [10, 2.0, 4.0], [20, 4.0, 3.0]], 200.0)
    fast = outcome([[0, 0.0, 5.0], [10, 1.0, 3.5], [20, 2.0, 2.5]], 100.0)
    slow = outcome([[0, 0.0, 5.0], [10, 3.0, 4.5], [20, 6.0, 3.5]], 300.0)
    summary = bench.summarise({bench.TORCH: torch, bench.Config("commd", "topk:auto"): fast,
                               bench.Config("torch", "powersgd"): slow})
    assert summary["target_loss"] == 3.0
    rows = summary["configs"]
    assert rows["torch DDP"]["time_x_torch"] == 1.0
    assert rows["commd topk:auto"]["time_to_target_s"] == pytest.approx(1.5)
    assert rows["commd topk:auto"]["time_x_torch"] == pytest.approx(0.375)
    assert rows["commd topk:auto"]["step_x_torch"] == pytest.approx(0.5)
    assert rows["commd topk:auto"]["steps_to_target"] == pytest.approx(15.0)
    assert rows["torch DDP + PowerSGD"]["time_to_target_s"] is None


# --- options --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("argv", "says"), [
    (["--configs", "torch,gzip"], "--configs 'gzip'"),
    (["--configs", "commd:topk:2"], "--configs 'commd:topk:2'"),
    (["--configs", "torch,torch"], "names a configuration twice"),
    (["--repeats", "0"], "--repeats must be at least 1"),
    (["--steps", "0"], "--steps must be at least 1"),
    (["--rates", "fast"], "--rates: rate 'fast'"),
    (["--powersgd-start", "1"], "--powersgd-start must be"),
])
def test_bad_options_are_refused_before_anything_starts(
        argv: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert_usage_error(bench.main, argv, says, capsys)


# --- the committed result -------------------------------------------------------------------------


def test_the_committed_result_has_what_the_docs_quote() -> None:
    result = json.loads(COMMITTED.read_text())
    assert {"command", "commit", "machine"} <= set(result["provenance"])
    assert result["settings"]["wall_time"].endswith("evaluation excluded")
    assert {"1gbit", "100mbit"} <= set(result["rates"])
    for rate in ("1gbit", "100mbit"):
        summary = result["rates"][rate]["summary"]
        assert math.isfinite(summary["target_loss"])
        configs = summary["configs"]
        assert {"torch DDP", "torch DDP + PowerSGD", "commd dense", "commd topk:auto",
                "commd topk:auto:momentum=0.9", "single process (no DDP)"} <= set(configs)
        for label, row in configs.items():
            assert row["median_step_ms"] > 0 and row["step_x_torch"] > 0, (rate, label)
            assert row["val_loss"] and len(row["val_loss"]) == len(row["wall_s"]), (rate, label)
            assert {"time_to_target_s", "time_x_torch", "steps_to_target"} <= set(row), \
                (rate, label)
            assert row["repeats"] == result["settings"]["repeats"], (rate, label)
        for label, runs in result["rates"][rate]["runs"].items():
            for repeat in runs["repeats"]:
                assert all(math.isfinite(p[2]) for p in repeat["curve"]), (rate, label)
