"""`make demo` shows what it claims: node 0's `commd status` while training, a small JSON
object from node 1 that is complete (never cut off mid-object), four ranks that visibly learn
(the mean loss per 10 steps falls), one line per rank instead of one per step, and checksums
compared, not just printed."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from bench_scripts import load_script

DEMO = Path(__file__).resolve().parents[2] / "examples" / "demo.py"
JSON_HEADER = ("[demo] `commd status --json` on node 1, a few fields of each job "
               "(--json gives them all):")
SUMMARY = re.compile(r"^\[demo\] rank (\d): mean loss per 10 steps ([\d.]+) → ([\d.]+) → ([\d.]+); "
                     r"[\d.]+ ms a step; params checksum (\S+)$")


def load_demo() -> ModuleType:
    return load_script(DEMO, "commd_demo")


@pytest.mark.timeout(300)
def test_the_demo_learns_in_one_line_per_rank() -> None:
    done = subprocess.run([sys.executable, str(DEMO)], capture_output=True, text=True,
                          timeout=280)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    summaries = [m for m in map(SUMMARY.match, lines) if m]
    assert sorted(int(m[1]) for m in summaries) == [0, 1, 2, 3], done.stdout
    for m in summaries:
        first, middle, last = float(m[2]), float(m[3]), float(m[4])
        assert first > 2.0, m[0]  # starts near ln 10: it has not seen the task yet
        assert middle < 0.8 * first and last < 0.5 * middle, m[0]  # and clearly learns it
    checksums = {m[5] for m in summaries}
    assert len(checksums) == 1
    assert f"[demo] all 4 ranks finished with the same parameters (checksum {checksums.pop()})" \
        in lines
    assert not [line for line in lines if line.startswith("rank ")]  # no line per step
    # node 0's human-readable status while training: the job's row in the table
    assert "[demo] `commd status` on node 0 while training:" in lines
    assert any(re.match(r"^demo +running +0,1 of 4 +0/2 ", line) for line in lines), done.stdout
    # node 1's JSON: one complete object on the line after its header, and no other line that
    # starts like JSON and does not parse (a cut-off object)
    shown = json.loads(lines[lines.index(JSON_HEADER) + 1])
    assert [job["job"] for job in shown["jobs"]] == ["demo"]
    assert shown["jobs"][0]["local_ranks"] == [2, 3] and shown["jobs"][0]["node_index"] == 1
    for line in lines:
        if line.lstrip().startswith(("{", "[")) and not line.startswith("[demo]"):
            json.loads(line)
    assert "[demo] stopped 2 daemons; shared-memory segments left: 0" in lines


def test_differing_checksums_fail_the_demo(capsys: pytest.CaptureFixture[str]) -> None:
    demo = load_demo()

    def said(checksum: str) -> list[str]:
        return ["rank 0 step 10/10 loss 2.3000 (mean of steps 1-10)",
                f"rank 0 done: 10 steps, mean step 40.0 ms, final loss 2.2000, "
                f"params checksum {checksum}"]

    assert demo._summarise([said("1.5"), said("1.5")], [0, 0]) == 0
    assert demo._summarise([said("1.5"), said("1.25")], [0, 0]) == 1
    assert "checksums differ: ['1.5', '1.25']" in capsys.readouterr().err
    # a rank that failed: its whole output goes to stderr, where the error is
    assert demo._summarise([said("1.5"), ["Traceback", "commd: boom"]], [0, 1]) == 1
    assert "commd: boom" in capsys.readouterr().err


def test_the_demos_json_is_small_and_complete() -> None:
    demo = load_demo()
    job = {name: 1 for name in demo.BRIEF_FIELDS} | {
        "job": "demo", "groups": [[0, 1], [2]], "candidates": [{"name": "dense"}] * 50,
        "plan_history": ["x" * 200] * 20, "membership_changes": ["epoch 1: y" * 100] * 10}
    status = {"version": "0.1.0", "backend": "gloo", "jobs": [job, job | {"job": "other"}],
              "ended": [{"status": job}] * 8, "shares": [{"kind": "ranks"}] * 5}
    text = json.dumps(demo.brief(status))
    assert json.loads(text) == {
        "version": "0.1.0", "backend": "gloo",
        "jobs": [{name: job[name] for name in demo.BRIEF_FIELDS},
                 {name: job[name] for name in demo.BRIEF_FIELDS} | {"job": "other"}]}
    assert len(text) < 500
