"""bench/elastic.py run for real: a tiny run of commd losing a rank mid-step and taking a
replacement (three daemons, three ranks), and the bench's run without torchft. What it
measures from progress logs, the committed result and its refusals are tested in
tests/unit/test_elastic_bench.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from bench_scripts import load_bench_script
from elastic_checks import check_result

bench = load_bench_script("elastic.py", "bench_elastic")
STEPS = 1200


@pytest.mark.timeout(150)
def test_commd_loses_no_step_when_a_rank_dies_mid_step_and_takes_a_replacement(
        tmp_path: Path) -> None:
    out = tmp_path / "elastic.json"
    # the survivors train on for several seconds after the replacement is let in (about
    # 100 steps a second here): its join must complete while they do, and on a busy
    # machine its start alone takes a few seconds
    picture = tmp_path / "timeline.png"
    code = bench.main(["--systems", "commd", "--faults", "rank", "--steps", str(STEPS), "--kill-at",
                       "4", "--rejoin-at", "8", "--repeats", "1", "--timeout", "120",
                       "--json", str(out), "--plot", str(picture)])
    assert code == 0
    assert picture.stat().st_size > 10_000  # a PNG with the panel drawn
    result = json.loads(out.read_text())
    check_result(result)
    [run] = result["runs"]
    assert (run["system"], run["fault"], run["steps_lost"]) == ("commd", "rank", 0)
    assert len(run["per_survivor"]) == 2
    # both survivors and the replacement end in the same world, bit-identical
    assert run["agree"] is True and len(run["finals"]) == 3
    assert all(final["world_size"] == 3 and final["members"] == [0, 1, 2]
               for final in run["finals"])
    assert run["joined_at_step"] >= 8 and run["finals"][-1]["joined_at_step"] >= 8
    assert 0 < run["join_ddp_s"] <= run["join_first_step_s"]
    assert run["join_pause_s"] is not None
    # the daemons saw the loss after the kill
    assert run["detection_s"] is not None and run["detection_s"] >= 0
    # the picture's data: every rank's steps from before the fault to the end
    line = run["timeline"]
    assert sorted(line["ranks"]) == ["0", "1", "2"] and line["replacement_called_s"] > 0
    steps, seconds = bench.points(line["ranks"]["0"])
    assert steps == list(range(STEPS)) and seconds[0] < 0 < seconds[-1]
    replaced = line["ranks"]["2"]  # the victim's steps, then its replacement's
    assert len(replaced) == 2 and replaced[1]["from_step"] >= 8
    assert result["summary"]["commd"]["rank"]["steps_lost"] == 0


def test_without_torchft_the_bench_skips_it_and_says_why(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "torchft", None)  # import torchft raises ImportError
    out = tmp_path / "elastic.json"
    assert bench.main(["--systems", "torchft", "--json", str(out)]) == 0
    assert "torchft skipped: torchft is not installed" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["runs"] == [] and result["summary"] == {}
    assert "pip install" in result["skipped"]["torchft"] or "--help" in result["skipped"]["torchft"]
