"""bench/time_to_loss.py: its data split, its configurations, its time-to-loss rule against the
best baseline, its rendering into docs/benchmarks.md and the committed result the docs quote
(tests/system/test_time_to_loss_run.py runs the script)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from bench_scripts import BENCH, assert_usage_error, load_bench_script

bench = load_bench_script("time_to_loss.py", "bench_time_to_loss")
report = load_bench_script("report.py", "bench_report")
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


def test_evaluations_include_the_baselines_last_step_and_the_last() -> None:
    assert bench.eval_steps(9, 3, 6) == [0, 3, 6, 9]
    assert bench.eval_steps(10, 4, 6) == [0, 4, 6, 8, 10]
    assert bench.eval_steps(6, 4) == [0, 4, 6]
    assert bench.steps_of(bench.POWERSGD, 200, 300) == bench.steps_of(bench.FP16, 200, 300) == 200
    for config in (bench.TORCH, bench.SINGLE, bench.Config("commd", "topk:auto", "fp16")):
        assert bench.steps_of(config, 200, 300) == 300


# --- configurations -------------------------------------------------------------------------------


def test_every_form_of_configuration_parses_and_names_itself_back() -> None:
    configs = bench.parse_configs("torch,fp16,powersgd,commd:none,commd:none+fp16,"
                                  "commd:none+powersgd,commd:topk:auto:momentum=0.9,single,"
                                  "pair")
    assert configs == [
        bench.TORCH, bench.Config("torch", hook="fp16"), bench.Config("torch", hook="powersgd"),
        bench.Config("commd"), bench.Config("commd", "none", "fp16"),
        bench.Config("commd", "none", "powersgd"),
        bench.Config("commd", "topk:auto:momentum=0.9"), bench.SINGLE, bench.PAIR]
    assert [c.label for c in configs] == [
        "torch DDP", "torch DDP + fp16 hook", "torch DDP + PowerSGD", "commd dense",
        "commd dense + fp16 hook", "commd dense + PowerSGD hook",
        "commd topk:auto:momentum=0.9", "single process (no DDP)", "two processes (no DDP)"]
    assert [bench.config_of(c.name) for c in configs] == configs
    assert [c.ranks for c in configs] == [2] * 7 + [1, 2]
    assert set(bench.BASELINES) == {configs[1], configs[2]}
    assert all(label in bench.COLOURS for label in (c.label for c in configs))


def test_a_commd_compression_is_whatever_commds_parser_takes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """No list of its own: a value commd's parser learns is a configuration at once, and the
    parser's own message refuses the rest."""
    asked: list[str] = []

    def parser(text: str) -> object:
        asked.append(text)
        if text == "bogus":
            raise ValueError("compression 'bogus' is not understood")
        return None

    monkeypatch.setattr(bench, "parse_compression", parser)
    configs = bench.parse_configs("commd:auto,commd:powersgd:4:start=10+fp16")
    assert configs == [bench.Config("commd", "auto"),
                       bench.Config("commd", "powersgd:4:start=10", "fp16")]
    assert asked == ["auto", "powersgd:4:start=10"]
    assert [c.label for c in configs] == ["commd auto", "commd powersgd:4:start=10 + fp16 hook"]
    with pytest.raises(ValueError, match="--configs 'commd:bogus': compression 'bogus' is not"):
        bench.parse_configs("torch,commd:bogus")


@pytest.mark.parametrize(("text", "says"), [
    ("torch,fp32", "--configs 'fp32': use torch, fp16, powersgd, single"),
    ("commd:none+bf16", "hook 'bf16': use +fp16 or +powersgd"),
    ("commd:+fp16", "name the compression"),
    ("fp16,fp16", "names a configuration twice"),
    ("commd:none,commd:none+fp16,commd:none+fp16", "names a configuration twice"),
])
def test_bad_configurations_are_refused(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says.replace("+", r"\+")):
        bench.parse_configs(text)


def permissive(monkeypatch: pytest.MonkeyPatch) -> None:
    """commd's parser as it will be: every compression taken."""
    monkeypatch.setattr(bench, "parse_compression", lambda text: None)


def checked(argv: list[str]) -> tuple[Any, list[Any]]:
    p = bench.parser()
    args = p.parse_args(argv)
    return args, bench.check(p, args)


def test_the_default_configurations_are_parsed_when_the_bench_runs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    permissive(monkeypatch)
    args, configs = checked([])
    assert [c.name for c in configs] == [
        "torch", "fp16", "powersgd", "commd:none", "commd:none+fp16",
        "commd:powersgd:4:start=10", "commd:auto", "single"]
    assert (args.steps, args.max_steps, args.rates) == (200, 300, "1gbit,100mbit")
    # commd's PowerSGD as torch's: the same rank and start
    _, configs = checked(["--powersgd-rank", "8", "--powersgd-start", "12"])
    assert bench.Config("commd", "powersgd:8:start=12") in configs
    _, configs = checked(["--steps", "10", "--configs", "fp16,commd:none"])
    assert [c.name for c in configs] == ["fp16", "commd:none"]


def test_a_default_configuration_commd_cannot_parse_yet_is_a_usage_error(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def without_auto(text: str) -> None:
        if text == "auto":
            raise ValueError("compression 'auto' is not understood")

    monkeypatch.setattr(bench, "parse_compression", without_auto)
    assert_usage_error(bench.main, [], "--configs 'commd:auto': compression 'auto'", capsys)
    _, configs = checked(["--configs", "fp16,commd:none+fp16"])  # named ones still run
    assert len(configs) == 2


def test_repeats_run_forwards_then_backwards() -> None:
    a, b, c = bench.TORCH, bench.FP16, bench.SINGLE
    assert bench.schedule([a, b, c], 3) == [(0, a), (0, b), (0, c), (1, c), (1, b), (1, a),
                                           (2, a), (2, b), (2, c)]
    assert bench.schedule([a, b], 1) == [(0, a), (0, b)]


# --- in the rank: the hooks and the momentum ------------------------------------------------------


def spec_of(config: Any) -> dict[str, Any]:
    return {"impl": config.impl, "compression": config.compression, "hook": config.hook,
            "powersgd_rank": 3, "powersgd_start": 7}


def test_the_hooks_are_torchs_own() -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    assert bench.comm_hook(spec_of(bench.TORCH)) is None
    assert bench.comm_hook(spec_of(bench.Config("commd", "none", "fp16"))) == \
        (None, default_hooks.fp16_compress_hook)
    hooked = bench.comm_hook(spec_of(bench.Config("commd", "none", "powersgd")))
    assert hooked is not None
    state, hook = hooked
    assert hook is psgd.powerSGD_hook and isinstance(state, psgd.PowerSGDState)
    assert state.process_group is None
    assert (state.matrix_approximation_rank, state.start_powerSGD_iter) == (3, 7)


class RefusingWrapper:
    """commd's wrapper where it refuses a hook: register_comm_hook raises."""

    def __init__(self) -> None:
        self.closed = False

    def register_comm_hook(self, state: object, hook: Callable[..., Any]) -> None:
        from commd_protocol import CommdError

        raise CommdError("commd: the communication hook cannot run in commd's daemon")

    def close(self) -> None:
        self.closed = True


def test_a_hook_the_wrapper_refuses_closes_it_and_fails_the_rank(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from commd_protocol import CommdError

    wrapper = RefusingWrapper()
    monkeypatch.setattr(bench.ddp_compare, "wrap", lambda model, spec: (wrapper, wrapper.close))
    with pytest.raises(CommdError, match="cannot run in commd's daemon"):
        bench.wrap(object(), spec_of(bench.Config("commd", "none", "powersgd")))
    assert wrapper.closed


def test_only_the_daemons_momentum_takes_the_optimizers() -> None:
    assert bench.daemon_momentum(spec_of(bench.Config("commd", "topk:auto:momentum=0.9"))) == 0.9
    assert bench.daemon_momentum(spec_of(bench.Config("commd", "topk:auto"))) == 0.0
    assert bench.daemon_momentum(spec_of(bench.Config("commd"))) == 0.0
    assert bench.daemon_momentum(spec_of(bench.POWERSGD)) == 0.0


# --- the best baseline and the time to its loss ---------------------------------------------------


def outcome(curve: list[list[float]], ms: float, agree: bool | None = True) -> Any:
    return bench.Outcome(repeats=[{"curve": curve, "step_ms": [ms] * 3, "agree": agree,
                                   "ran": "", "train_loss": [4.0] * 3}])


POWERSGD_RUN = [[0, 0.0, 5.0], [10, 2.0, 4.0], [20, 4.0, 3.2]]
FP16_RUN = [[0, 0.0, 5.0], [10, 3.0, 4.0], [20, 6.0, 3.0]]


def test_the_best_baseline_is_the_one_that_ends_lower() -> None:
    powersgd, fp16 = outcome(POWERSGD_RUN, 200.0), outcome(FP16_RUN, 300.0)
    assert bench.best_baseline({bench.POWERSGD: powersgd, bench.FP16: fp16}) == bench.FP16
    lower = outcome([*POWERSGD_RUN[:2], [20, 4.0, 2.9]], 200.0)
    assert bench.best_baseline({bench.POWERSGD: lower, bench.FP16: fp16}) == bench.POWERSGD
    # a tie: the first listed; a baseline that failed or ends in NaN is not one
    tied = outcome([*POWERSGD_RUN[:2], [20, 4.0, 3.0]], 200.0)
    assert bench.best_baseline({bench.FP16: fp16, bench.POWERSGD: tied}) == bench.FP16
    nan = outcome([*POWERSGD_RUN[:2], [20, 4.0, math.nan]], 200.0)
    assert bench.best_baseline({bench.POWERSGD: nan, bench.FP16: fp16}) == bench.FP16
    assert bench.best_baseline({bench.POWERSGD: bench.Outcome(errors=["x"]),
                                bench.FP16: fp16}) == bench.FP16
    # torch DDP dense is a reference, never the target, however low it ends
    assert bench.best_baseline({bench.TORCH: outcome(FP16_RUN, 1.0)}) is None


def sample_outcomes() -> dict[Any, Any]:
    """fp16 ends lower than PowerSGD (3.0 after 20 steps, 6 s): the target. A commd config of
    30 steps gets there in 15 steps; another never does; the single process is the
    compute-only limit; one config failed."""
    return {
        bench.TORCH: outcome([[0, 0.0, 5.0], [10, 4.0, 4.0], [20, 8.0, 3.0],
                              [30, 12.0, 2.8]], 400.0),
        bench.FP16: outcome(FP16_RUN, 300.0),
        bench.POWERSGD: outcome(POWERSGD_RUN, 200.0),
        bench.Config("commd", "auto"): outcome([[0, 0.0, 5.0], [10, 1.0, 3.5],
                                                [20, 2.0, 2.9], [30, 3.0, 2.7]], 100.0),
        bench.Config("commd", "topk:0.01"): outcome([[0, 0.0, 5.0], [10, 1.0, 4.5],
                                                     [20, 2.0, 3.5], [30, 3.0, 3.1]], 100.0),
        bench.Config("commd", "none", "powersgd"): bench.Outcome(errors=[
            "commd dense + PowerSGD hook rank 0 failed (daemon logs in /tmp/x):\nTraceback "
            "(most recent call last):\n  File \"x.py\", line 1\ncommd_protocol.CommdError: "
            "commd: the PowerSGD hook cannot run in commd's daemon\n"]),
        bench.SINGLE: outcome([[0, 0.0, 5.0], [10, 0.6, 4.6], [20, 1.2, 4.2],
                               [30, 1.8, 4.0]], 60.0),
        bench.PAIR: outcome([[0, 0.0, 5.0], [10, 0.9, 4.6], [20, 1.8, 4.2],
                             [30, 2.7, 4.0]], 90.0, agree=None),
    }


def test_the_summary_measures_every_config_against_the_best_baselines_final_loss() -> None:
    summary = bench.summarise(sample_outcomes())
    assert summary["best_baseline"] == "torch DDP + fp16 hook"
    assert (summary["target_loss"], summary["target_step"]) == (3.0, 20)
    assert summary["best_time_s"] == 6.0
    assert summary["compute_limit_x"] == pytest.approx(0.2)  # 60 ms against fp16's 300
    assert summary["shared_cores_limit_x"] == pytest.approx(0.3)  # two side by side: 90 ms
    rows = summary["configs"]
    best = rows["torch DDP + fp16 hook"]
    assert (best["time_to_target_s"], best["time_x_best"], best["step_x_best"]) == (6.0, 1.0, 1.0)
    auto = rows["commd auto"]  # reached between steps 10 and 20: 3.5 → 2.9
    assert auto["time_to_target_s"] == pytest.approx(1.0 + 0.5 / 0.6)
    assert auto["time_x_best"] == pytest.approx((1.0 + 0.5 / 0.6) / 6.0)
    assert auto["steps_to_target"] == pytest.approx(10 + 10 * 0.5 / 0.6)
    assert auto["step_x_best"] == pytest.approx(1 / 3)
    assert auto["loss_at_target_step"] == 2.9  # ends no worse: at step 20, below the target
    assert auto["val_loss"][-1] == [30, 2.7] and auto["config"] == "commd:auto"
    # reached at the baselines' last step, and after it (a config with room to reach it)
    assert rows["torch DDP"]["time_to_target_s"] == 8.0
    assert rows["torch DDP"]["steps_to_target"] == 20.0
    assert rows["torch DDP + PowerSGD"]["time_to_target_s"] is None
    assert rows["commd topk:0.01"]["time_to_target_s"] is None
    assert rows["commd topk:0.01"]["time_x_best"] is None
    failed = rows["commd dense + PowerSGD hook"]
    assert failed["val_loss"] == [] and failed["repeats"] == 0
    assert failed["errors"] == ["commd_protocol.CommdError: commd: the PowerSGD hook cannot "
                                "run in commd's daemon"]
    assert rows["single process (no DDP)"]["step_x_best"] == pytest.approx(0.2)
    # two processes without DDP train apart: nothing to agree on, "-" in the table
    assert rows["two processes (no DDP)"]["agree"] is None
    assert rows["torch DDP + fp16 hook"]["agree"] is True
    (pair_row,) = [line for line in bench.table(summary).splitlines()
                   if line.startswith("| two processes")]
    assert pair_row.rstrip(" |").endswith("-")


def test_a_config_reached_later_than_the_baselines_last_step_counts() -> None:
    outcomes = {bench.FP16: outcome(FP16_RUN, 300.0),
                bench.Config("commd", "none"): outcome(
                    [[0, 0.0, 5.0], [10, 2.0, 4.2], [20, 4.0, 3.4], [30, 6.0, 2.6]], 200.0)}
    row = bench.summarise(outcomes)["configs"]["commd dense"]
    assert row["loss_at_target_step"] == 3.4  # ends worse at step 20 …
    assert row["time_to_target_s"] == pytest.approx(5.0)  # … and gets there by step 30
    assert row["steps_to_target"] == pytest.approx(25.0)
    assert row["time_x_best"] == pytest.approx(5.0 / 6.0)


def test_without_a_baseline_there_is_no_target() -> None:
    summary = bench.summarise({bench.TORCH: outcome(FP16_RUN, 300.0)})
    assert summary["best_baseline"] is None and summary["target_loss"] is None
    assert summary["configs"]["torch DDP"]["time_to_target_s"] is None
    assert "no target" in bench.headline(summary)
    assert "s to the target" in bench.table(summary)


def test_a_failed_jobs_reason_is_its_last_line() -> None:
    assert bench.reason("x failed:\nTraceback\n  File\nValueError: bad\n\n") == "ValueError: bad"
    assert bench.reason("") == "failed"
    assert len(bench.reason("y" * 1000)) == 300


# --- the JSON and its rendering -------------------------------------------------------------------


def test_the_json_reads_back_as_the_same_outcomes() -> None:
    outcomes = sample_outcomes()
    runs = json.loads(json.dumps(bench.to_json(outcomes)))
    assert runs["commd dense + PowerSGD hook"]["config"] == "commd:none+powersgd"
    again = bench.outcomes_from_json(runs)
    assert list(again) == list(outcomes)
    assert bench.summarise(again) == bench.summarise(outcomes)


def test_runs_from_before_the_fp16_hook_read_back_by_their_labels() -> None:
    """Those named torch DDP + PowerSGD's configuration "torch", as torch DDP's."""
    runs = {"torch DDP": {"config": "torch", "repeats": [], "errors": []},
            "torch DDP + PowerSGD": {"config": "torch", "repeats": [], "errors": []},
            "commd topk:auto": {"config": "commd:topk:auto", "repeats": [], "errors": []},
            "single process (no DDP)": {"config": "single", "repeats": [], "errors": []}}
    assert list(bench.outcomes_from_json(runs)) == [
        bench.TORCH, bench.POWERSGD, bench.Config("commd", "topk:auto"), bench.SINGLE]


def test_the_table_gives_the_time_to_the_target_and_what_failed() -> None:
    summary = bench.summarise(sample_outcomes())
    lines = bench.table(summary).splitlines()
    header = [cell.strip() for cell in lines[0].split("|")[1:-1]]
    assert header == ["configuration", "median step ms", "step × best baseline",
                      "val loss @ 20", "last val loss @ step", "s to 3.000",
                      "time × best baseline", "steps to it", "commd ran at the end",
                      "ranks agree"]
    rows = {cells[0]: cells for cells in ([c.strip() for c in line.split("|")[1:-1]]
                                          for line in lines[2:])}
    assert rows["commd auto"][1:] == ["100.0", "0.33", "2.900", "2.700 @ 30", "1.8", "0.31",
                                      "18", "-", "yes"]
    assert rows["torch DDP + fp16 hook"][5:7] == ["6.0", "1.00"]
    assert rows["commd topk:0.01"][5:8] == ["not reached", "-", "-"]
    assert rows["commd dense + PowerSGD hook"][1] == "failed"
    assert bench.failures(summary) == [
        "- commd dense + PowerSGD hook failed: commd_protocol.CommdError: commd: the PowerSGD "
        "hook cannot run in commd's daemon"]
    words = bench.headline(summary)
    assert "the best baseline, torch DDP + fp16 hook, ends its 20 steps at 3.000" in words
    assert "reached after 6.0 s" in words and "0.20× its step" in words
    assert bench.report(summary).splitlines()[-1] == bench.failures(summary)[0]


def test_the_report_renders_each_rate_from_the_runs_not_the_stored_summary() -> None:
    runs = bench.to_json(sample_outcomes())
    data = {"command": ".venv/bin/python bench/time_to_loss.py", "commit": "abc1234",
            "machine": {"cpus": 2}, "rates": {
                "1gbit": {"summary": {"stale": True}, "runs": runs},
                "100mbit": {"summary": {"stale": True}, "runs": runs}}}
    page = report.time_to_loss(data)
    assert page.startswith("**1 Gbit/s** (target: the best baseline, torch DDP + fp16 hook,")
    assert "\n**100 Mbit/s** (target:" in page
    assert "two processes without DDP side by side" in page
    # not reached: PowerSGD, topk:0.01, the single process and the pair, at each rate
    assert page.count("| commd auto ") == 2 and page.count("not reached") == 8
    assert page.count("- commd dense + PowerSGD hook failed: commd_protocol.CommdError") == 2
    assert all(len(line) <= 95 for line in page.splitlines() if not line.startswith("|"))
    assert page.rstrip().endswith("[bench/results/time-to-loss.json]"
                                  "(../bench/results/time-to-loss.json).")


# --- options --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("argv", "says"), [
    (["--configs", "torch,gzip"], "--configs 'gzip'"),
    (["--configs", "commd:topk:2"], "--configs 'commd:topk:2'"),
    (["--configs", "torch,torch"], "names a configuration twice"),
    (["--repeats", "0"], "--repeats must be at least 1"),
    (["--steps", "0"], "--steps must be at least 1"),
    (["--steps", "20", "--max-steps", "19"], "--max-steps must be at least --steps (20)"),
    (["--rates", "fast"], "--rates: rate 'fast'"),
    (["--powersgd-start", "1"], "--powersgd-start must be"),
    (["--powersgd-rank", "0"], "--powersgd-rank must be at least 1"),
])
def test_bad_options_are_refused_before_anything_starts(
        argv: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert_usage_error(bench.main, argv, says, capsys)


# --- the committed result -------------------------------------------------------------------------


def test_the_committed_result_has_what_the_docs_quote() -> None:
    """Summarised again as bench/report.py does: per rate a best baseline and its target, and
    every configuration that ran with its step, curve and time to the target."""
    result = json.loads(COMMITTED.read_text())
    assert {"command", "commit", "machine"} <= set(result["provenance"])
    assert result["settings"]["wall_time"].endswith("evaluation excluded")
    assert {"1gbit", "100mbit"} <= set(result["rates"])
    for rate in ("1gbit", "100mbit"):
        outcomes = bench.outcomes_from_json(result["rates"][rate]["runs"])
        assert bench.SINGLE in outcomes and bench.POWERSGD in outcomes
        summary = bench.summarise(outcomes)
        assert summary["best_baseline"] in ("torch DDP + PowerSGD", "torch DDP + fp16 hook")
        assert math.isfinite(summary["target_loss"]) and summary["compute_limit_x"] > 0
        for label, row in summary["configs"].items():
            if row["errors"]:
                continue  # a configuration commd refused: the page says why
            assert row["median_step_ms"] > 0 and row["step_x_best"] > 0, (rate, label)
            assert row["val_loss"] and len(row["val_loss"]) == len(row["wall_s"]), (rate, label)
            assert row["loss_at_target_step"] is not None, (rate, label)
            assert row["repeats"] == result["settings"]["repeats"], (rate, label)
        for label, runs in result["rates"][rate]["runs"].items():
            for repeat in runs["repeats"]:
                assert all(math.isfinite(p[2]) for p in repeat["curve"]), (rate, label)
