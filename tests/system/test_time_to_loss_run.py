"""bench/time_to_loss.py run for real: a tiny loopback run of the script (torch DDP with the fp16
hook, the baseline, and commd's wrapper with the same hook, ranks and real daemons) writes
every curve and its provenance. Its pure parts are tested in
tests/unit/test_time_to_loss_bench.py."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from bench_scripts import BENCH

from commd.testing.daemons import commd_segments


def test_a_tiny_loopback_run_writes_every_curve_and_its_provenance(tmp_path: Path) -> None:
    before = commd_segments()
    out = tmp_path / "ttl.json"
    command = [sys.executable, str(BENCH / "time_to_loss.py"), "--rates", "loopback",
               "--configs", "fp16,commd:none+fp16", "--steps", "4", "--max-steps", "6",
               "--eval-every", "2", "--repeats", "1", "--batch", "2", "--budget", "600000",
               "--val-windows", "4", "--timeout", "90", "--json", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["provenance"]["command"].endswith("--json " + str(out))
    assert result["provenance"]["commit"] and result["provenance"]["machine"]["cpus"]
    settings = result["settings"]
    assert (settings["steps"], settings["max_steps"]) == (4, 6)
    assert settings["eval_steps"] == [0, 2, 4, 6]
    loopback = result["rates"]["loopback"]
    assert set(loopback["runs"]) == {"torch DDP + fp16 hook", "commd dense + fp16 hook"}
    steps = {"torch DDP + fp16 hook": 4, "commd dense + fp16 hook": 6}  # the baseline: --steps
    for label, runs in loopback["runs"].items():
        assert runs["errors"] == [], label
        (repeat,) = runs["repeats"]
        assert [point[0] for point in repeat["curve"]] == list(range(0, steps[label] + 1, 2))
        walls = [point[1] for point in repeat["curve"]]
        assert walls[0] == 0.0 and walls == sorted(walls) and walls[-1] > 0
        assert all(math.isfinite(point[2]) for point in repeat["curve"])
        assert len(repeat["step_ms"]) == len(repeat["train_loss"]) == steps[label]
        assert repeat["agree"] is True
    summary = loopback["summary"]
    assert summary["best_baseline"] == "torch DDP + fp16 hook"
    assert math.isfinite(summary["target_loss"]) and summary["target_step"] == 4
    assert set(summary["configs"]) == set(steps)
    assert math.isfinite(summary["configs"]["commd dense + fp16 hook"]["loss_at_target_step"])
    assert commd_segments() <= before
