"""bench/time_to_loss.py run for real: a tiny loopback run of the script (torch DDP and commd
ranks, real daemons) writes every curve and its provenance. Its pure parts are tested in
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
               "--configs", "torch,commd:topk:auto", "--steps", "4", "--eval-every", "2",
               "--repeats", "1", "--batch", "2", "--budget", "600000", "--val-windows", "4",
               "--timeout", "90", "--json", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["provenance"]["command"].endswith("--json " + str(out))
    assert result["provenance"]["commit"] and result["provenance"]["machine"]["cpus"]
    assert result["settings"]["steps"] == 4 and result["settings"]["eval_steps"] == [0, 2, 4]
    loopback = result["rates"]["loopback"]
    assert set(loopback["runs"]) == {"torch DDP", "commd topk:auto"}
    for label, runs in loopback["runs"].items():
        assert runs["errors"] == [], label
        (repeat,) = runs["repeats"]
        assert [point[0] for point in repeat["curve"]] == [0, 2, 4]
        walls = [point[1] for point in repeat["curve"]]
        assert walls[0] == 0.0 and walls == sorted(walls) and walls[-1] > 0
        assert all(math.isfinite(point[2]) for point in repeat["curve"])
        assert len(repeat["step_ms"]) == len(repeat["train_loss"]) == 4
        assert repeat["agree"] is True
    summary = loopback["summary"]
    assert math.isfinite(summary["target_loss"])
    assert set(summary["configs"]) == {"torch DDP", "commd topk:auto"}
    assert commd_segments() <= before
