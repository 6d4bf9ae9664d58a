"""One version, stated once (commd_protocol.__version__) and reported the same everywhere:
the three packages, the installed distribution, `commd --version` and a running daemon's
`commd status`. A second literal anywhere would drift at the next release."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import commd
import commd_client
import commd_protocol

from daemons import DaemonProcess

REPO = Path(__file__).resolve().parents[2]
SOURCE = "protocol/commd_protocol/__init__.py"
# `__version__ = "…"` or pyproject's `version = "…"`: a statement of the version, not a use.
STATED = re.compile(r"""^\s*(__version__|version)\s*(:\s*str\s*)?=\s*["']""", re.MULTILINE)


def cli(*argv: str) -> str:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("COMMD_")}
    done = subprocess.run([sys.executable, "-m", "commd.cli", *argv], capture_output=True,
                          text=True, timeout=60, cwd=REPO, env=environ, check=True)
    return done.stdout


def test_the_version_is_stated_in_one_file() -> None:
    files = [REPO / "pyproject.toml", REPO / "setup.py"]
    for folder in ("commd", "client", "protocol"):
        files += (REPO / folder).rglob("*.py")
    stating = sorted(str(path.relative_to(REPO)) for path in files
                     if path.is_file() and STATED.search(path.read_text()))
    assert stating == [SOURCE]


def test_packages_and_the_installed_metadata_agree() -> None:
    version = commd_protocol.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+", version)
    assert commd.__version__ == version
    assert commd_client.__version__ == version
    # The editable install's metadata is written at install time: after a version change,
    # `make install` (the Makefile's stamp depends on the source file) brings it up to date.
    assert importlib.metadata.version("commd") == version


def test_the_cli_and_a_running_daemon_report_it(
        start_daemon: Callable[..., DaemonProcess]) -> None:
    assert cli("--version").strip() == f"commd {commd_protocol.__version__}"
    daemon = start_daemon()
    status = json.loads(cli("status", "--json", "--socket", daemon.socket))
    assert status["version"] == commd_protocol.__version__
    table = cli("status", "--socket", daemon.socket)
    assert table.startswith(f"commd {commd_protocol.__version__} ")
