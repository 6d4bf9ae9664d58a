"""bench/elastic.py: what a fault costs the survivors (stall, steps lost) from their progress
logs, the committed result read as data, and the bench's refusals. Its real runs are in
tests/system/test_elastic_bench_run.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from bench_scripts import assert_usage_error, load_bench_script
from elastic_checks import check_result

bench = load_bench_script("elastic.py", "bench_elastic")
Record = bench.Record
COMMITTED = Path(__file__).resolve().parents[2] / "bench" / "results" / "elastic.json"


def steps(numbers: list[int], start: float = 0.0, every: float = 0.01,
          committed: bool = True) -> list[Any]:
    return [Record(n, start + i * every, 0.0, committed) for i, n in enumerate(numbers)]


# --- the measure ----------------------------------------------------------------------------------

def test_a_survivor_that_goes_on_loses_nothing_and_stalls_for_the_gap() -> None:
    records = steps(list(range(10))) + steps(list(range(10, 20)), start=0.09 + 2.0)
    cost = bench.measure(records, struck=0.095)
    assert cost["steps_lost"] == 0 and cost["steps_done"] == 20
    assert cost["stall_s"] == pytest.approx(1.99)  # the 2 s gap less the 0.01 s step
    assert cost["to_new_step_s"] == pytest.approx(2.09 - 0.095)


def test_a_hiccup_after_the_first_new_step_is_not_the_faults() -> None:
    records = (steps(list(range(10))) + steps(list(range(10, 15)), start=0.59)
               + steps(list(range(15, 20)), start=0.63 + 0.8))
    cost = bench.measure(records, struck=0.095)
    assert cost["stall_s"] == pytest.approx(0.5 - 0.01)  # not the 0.8 s gap before step 15


def test_a_restart_from_a_checkpoint_counts_its_redone_steps_as_lost() -> None:
    # steps 0-14 done, checkpoint at 10, restart redoes 10-14 and goes on to 19
    records = steps(list(range(15))) + steps(list(range(10, 20)), start=0.14 + 4.0)
    cost = bench.measure(records, struck=0.145)
    assert cost["steps_lost"] == 5
    assert cost["steps_done"] == 20
    # the first new step is 15, the sixth after the restart
    assert cost["to_new_step_s"] == pytest.approx(0.14 + 4.0 + 5 * 0.01 - 0.145)


def test_an_uncommitted_step_is_lost_and_its_redo_is_new() -> None:
    records = (steps([0, 1, 2]) + steps([3], start=0.03, committed=False)
               + steps([3, 4, 5], start=0.5))
    cost = bench.measure(records, struck=0.025)
    assert cost["steps_lost"] == 1 and cost["steps_done"] == 6
    assert cost["to_new_step_s"] == pytest.approx(0.5 - 0.025)


def test_steps_skipped_by_taking_a_peers_state_are_not_lost() -> None:
    cost = bench.measure(steps([0], committed=False) + steps([5, 6, 7], start=0.5), struck=1.0)
    assert cost["steps_lost"] == 1 and cost["steps_done"] == 8  # the uncommitted step 0 only


def test_a_replacements_join_is_measured_apart_from_the_fault() -> None:
    # the fault's 1 s gap before step 10, the join's 3 s gap before step 20
    records = (steps(list(range(10))) + steps(list(range(10, 20)), start=1.09)
               + steps(list(range(20, 30)), start=1.18 + 3.0))
    go = 1.2
    cost = bench.measure(records, struck=0.095, until=go)
    assert cost["stall_s"] == pytest.approx(1.0 - 0.01)
    assert bench.join_pause(records, go) == pytest.approx(3.0 - 0.01)
    final = {"joined_at_step": 20, "ddp_started": go, "ddp_returned": 4.0}
    joined = bench.joined(records, final)
    assert joined == {"joined_at_step": 20, "join_ddp_s": pytest.approx(2.8),
                      "join_first_step_s": pytest.approx(1.18 + 3.0 - go)}


def test_too_few_steps_are_refused() -> None:
    with pytest.raises(ValueError, match="too few"):
        bench.measure(steps([0, 1]), struck=0.0)


def test_the_daemons_first_lines_are_found_in_wall_time() -> None:
    logs = ["2026-12-06 04:17:08,388 WARNING commd.coordinator: job j: epoch 1: node 127.0.0.1 "
            "(ranks [2]) lost: rank 2 exited\n",
            "2026-12-06 04:17:08,100 INFO commd.server: serving\n"
            "2026-12-06 04:17:08,300 WARNING commd.coordinator: job j: epoch 1: a collective "
            "failed on node 127.0.0.1\n"]
    lines = bench.daemon_lines(2)
    detected = bench.first_line_wall(logs, lines["detection_s"])
    declared = bench.first_line_wall(logs, lines["declared_lost_s"])
    assert declared is not None and detected is not None
    assert declared - detected == pytest.approx(0.088)
    assert bench.first_line_wall(["no time here: epoch 1: node x (ranks [2]) lost"],
                                 lines["declared_lost_s"]) is None
    # another rank's loss is not this victim's; lines before the fault are an earlier one's
    assert bench.first_line_wall(logs, bench.daemon_lines(0)["declared_lost_s"]) is None
    assert bench.first_line_wall(logs, lines["detection_s"], after=detected + 0.05) == \
        pytest.approx(declared)


def test_the_coordinators_loss_is_declared_in_its_successors_words() -> None:
    logs = ["2026-12-07 18:02:08,019 WARNING commd.jobs: job j: epoch 1: the coordinator "
            "127.0.0.1:34259 lost; 2 node(s) go on; node 1 of 2, 2 rank(s), from iteration 50\n"]
    lines = bench.daemon_lines(0)
    assert bench.first_line_wall(logs, lines["declared_lost_s"]) is not None
    assert bench.first_line_wall(logs, lines["detection_s"]) is not None


# --- the committed result -------------------------------------------------------------------------

def test_a_failed_run_prints_its_logs_tails_and_keeps_them(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A run that fails on a CI machine leaves nothing to look at afterwards but its output:
    the daemons' and ranks' last lines are printed, and the directory is kept locally."""
    def failing(run: Any) -> dict[str, Any]:
        (run.workdir / "d2.log").write_text("".join(f"line {n}\n" for n in range(100)))
        raise RuntimeError("survivor pid 1 exited 1")

    monkeypatch.setitem(bench.RUNNERS, "commd", failing)
    args = bench.parser().parse_args(["--systems", "commd", "--faults", "rank"])
    outcome = bench.run_one("commd", "rank", args)
    out = capsys.readouterr().out
    assert outcome == {"error": "survivor pid 1 exited 1"}
    assert "--- d2.log (last 40 lines) ---" in out and "line 99" in out and "line 59" not in out
    kept = Path(out.split("logs kept in ")[1].split()[0])
    try:
        assert (kept / "d2.log").exists()
    finally:
        shutil.rmtree(kept)


def test_a_run_that_succeeds_leaves_no_directory(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    seen: list[Path] = []

    def succeeding(run: Any) -> dict[str, Any]:
        seen.append(run.workdir)
        return {"steps_lost": 0}

    monkeypatch.setitem(bench.RUNNERS, "commd", succeeding)
    args = bench.parser().parse_args(["--systems", "commd", "--faults", "rank"])
    assert bench.run_one("commd", "rank", args) == {"steps_lost": 0}
    assert not seen[0].exists() and "logs kept" not in capsys.readouterr().out


def test_the_committed_result() -> None:
    result = json.loads(COMMITTED.read_text())
    check_result(result)
    settings = result["settings"]
    assert (settings["steps"], settings["kill_at"], settings["rejoin_at"]) == (1500, 100, 200)
    summary = result["summary"]
    assert set(summary["commd"]) == set(bench.FAULTS)
    for fault, row in summary["commd"].items():
        assert row["steps_lost"] == 0, fault
    # torchrun restarts every rank from the last checkpoint and redoes the steps since it
    torch = summary["torch"]["rank"]
    assert torch["steps_lost"] == settings["kill_at"] % settings["checkpoint_every"]
    for run in (r for r in result["runs"] if r["system"] == "torch"):
        assert all(final["restarts"] == 1 for final in run["finals"])
    assert summary["commd"]["rank"]["stall_s"] < torch["stall_s"]
    # a silent node costs about the daemons' peer timeout, no less
    assert summary["commd"]["stop"]["declared_lost_s"] >= settings["peer_timeout_s"]
    # a killed process is not a silent one: the coordinator's node and the rank giving a
    # joiner its state cost the survivors well under the peer timeout
    for fault in ("coordinator", "join"):
        assert summary["commd"][fault]["stall_s"] < settings["peer_timeout_s"], fault
    # after every fault a replacement joined, and all replicas ended identical
    for run in (r for r in result["runs"] if r["system"] == "commd"):
        assert run["joined_at_step"] >= settings["rejoin_at"]
        assert run["agree"] is True
        assert run["join_ddp_s"] > 0 and run["join_first_step_s"] >= run["join_ddp_s"]
        if run["fault"] == "join":
            # the giver and the victim are gone: one survivor and the replacement's second
            # start, which came after the first failed, at once, saying to start it again;
            # the fault measured struck after the replacement was let in
            assert len(run["finals"]) == 2
            assert 0 < run["first_start_failed_s"] < settings["peer_timeout_s"]
            assert run["timeline"]["replacement_called_s"] < 0
        else:
            assert len(run["finals"]) == 3
            assert run["timeline"]["replacement_called_s"] > 0
            # the survivors stop for the join itself, not for the replacement's start-up
            assert run["join_pause_s"] < run["join_ddp_s"]
    if "torchft" in result["skipped"]:
        assert "not installed" in result["skipped"]["torchft"]
    else:
        assert set(summary["torchft"]) == set(bench.FAULTS_OF["torchft"])
        assert summary["torchft"]["rank"]["steps_lost"] == 1  # its step in flight
        for run in (r for r in result["runs"] if r["system"] == "torchft"):
            assert run["agree"] is True
            if run["fault"] == "rank":
                # the kill landed inside the survivors' all-reduce of that step: the victim
                # was in the quorum, and the bench's hook returned the local buffer there
                assert all(final["local_buffer_returned_at"] == [settings["kill_at"]]
                           for final in run["finals"][:2])
        # torchft's survivors wait for its timeout when the replica healing a replacement dies
        assert summary["torchft"]["join"]["stall_s"] >= 0.9 * settings["torchft_timeout_s"]


# --- refusals -------------------------------------------------------------------------------------

@pytest.mark.parametrize(("argv", "says"), [
    (["--rejoin-at", "50"], "--rejoin-at must be 0 or between --kill-at and --steps"),
    (["--rejoin-at", "1500"], "--rejoin-at must be 0 or between --kill-at and --steps"),
    (["--faults", "join", "--rejoin-at", "0"], "--faults join needs a replacement"),
    (["--torchft-timeout-s", "0"], "--torchft-timeout-s must be at least 1 and below --timeout"),
    (["--torchft-timeout-s", "200"], "--torchft-timeout-s must be at least 1 and below"),
    (["--rejoin-at", "-5"], "--rejoin-at must be 0 or between"),
    (["--faults", "meteor"], "--faults 'meteor': use rank, daemon, stop"),
    (["--faults", ""], "--faults '': use rank, daemon, stop"),
    (["--systems", "commd,commd"], "names one twice"),
    (["--systems", "horovod"], "--systems 'horovod'"),
    (["--steps", "10", "--kill-at", "9"], "--kill-at must be between 1 and --steps - 2 (8)"),
    (["--kill-at", "0"], "--kill-at must be between 1"),
    (["--steps", "2"], "--steps must be between 3"),
    (["--steps", str(10**12)], "--steps must be between 3"),
    (["--steps", "many"], "invalid int value"),
    (["--repeats", "0"], "must be at least 1"),
    (["--peer-timeout-s", "0"], "--peer-timeout-s must be between"),
    (["--peer-timeout-s", "nan"], "--peer-timeout-s must be between"),
    (["--torchft-heartbeat-timeout-ms", "10"], "--torchft-heartbeat-timeout-ms must be"),
    (["--torchft-join-timeout-ms", "-1"], "--torchft-join-timeout-ms must be"),
    (["--torchft-hook", "mine"], "invalid choice"),
    (["--timeout", "-1"], "--timeout must be positive"),
])
def test_bad_options_are_refused_before_anything_starts(
        argv: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert_usage_error(bench.main, argv, says, capsys)
