"""Where a benchmark's result came from, stored beside it: the command, the commit, the machine.

A figure without these cannot be checked again or compared with a later run (principle 14:
measurements are data)."""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

_REPOSITORY = Path(__file__).resolve().parents[2]


def provenance(argv: list[str] | None = None) -> dict[str, Any]:
    """``command`` (as typed, from the repository root), ``commit`` (HEAD, "+dirty" when the
    tree has changes; "" outside a git checkout) and ``machine`` (cores, Python, platform,
    load average when asked)."""
    args = sys.argv if argv is None else argv
    return {"command": shlex.join([".venv/bin/python", *args]),
            "commit": _commit(), "machine": {
                "cpus": os.cpu_count(), "python": platform.python_version(),
                "platform": platform.platform(), "loadavg": list(os.getloadavg())}}


def _commit() -> str:
    try:
        head = subprocess.run(["git", "-C", str(_REPOSITORY), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10, check=True).stdout
        dirty = subprocess.run(["git", "-C", str(_REPOSITORY), "status", "--porcelain",
                                "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    return head.strip() + ("+dirty" if dirty.strip() else "")
