"""A bench's results written with the command, commit and machine that made them, and
docs/benchmarks.md checked by the command its header names, as a process of its own."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from commd.testing.results import write_results

ROOT = Path(__file__).resolve().parents[2]


def test_report_check_passes_on_the_committed_page() -> None:
    done = subprocess.run([sys.executable, "bench/report.py", "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_write_results_adds_command_commit_and_machine(tmp_path: Path) -> None:
    path = write_results("x", {"rows": [1, 2]}, tmp_path / "x.json",
                         argv=["bench/x.py", "--fast"])
    assert path is not None
    data = json.loads(path.read_text())
    assert data["command"] == ".venv/bin/python bench/x.py --fast"
    assert data["rows"] == [1, 2] and data["machine"]["cpus"] >= 1
    assert data["commit"]  # this is a git checkout
    assert write_results("x", {"rows": []}, "") is None  # --results '': nowhere
    with pytest.raises(ValueError, match="commit"):
        write_results("x", {"commit": "mine"}, tmp_path / "y.json")
