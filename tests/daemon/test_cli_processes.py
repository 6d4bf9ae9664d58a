"""The command line and the packages' imports in a real process (a fresh interpreter): what
the in-process tests of tests/unit cannot see (argparse's exit, the first import's modules)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from cli_runs import one_error_line

from commd.daemon.settings import OPTIONS

from gpu_jobs import gpu_present

REPO = Path(__file__).resolve().parents[2]


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def cli(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("COMMD_")}
    environ.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "commd.cli", *argv],
        capture_output=True, text=True, timeout=30, cwd=REPO, env=environ,
    )


@pytest.fixture(scope="module")
def run_help() -> str:
    result = cli("run", "--help")
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_run_help_lists_every_option_and_env_name(run_help: str) -> None:
    text = " ".join(run_help.split())  # undo argparse's line wrapping
    assert "--config FILE" in text
    for option in OPTIONS:
        assert flag(option.name) in text
        assert f"env COMMD_{option.name.upper()}" in text
        assert f"default {option.default!r}" in text
        for choice in option.choices or ():
            assert choice in text


def test_run_help_names_commd_config(run_help: str) -> None:
    assert "COMMD_CONFIG" in run_help


def test_run_with_a_bad_listen_exits_2_with_one_line() -> None:
    result = cli("run", "--listen", "nonsense", "--socket", "/nonexistent/dir/commd.sock")
    assert one_error_line(result, returncode=2).startswith("commd: listen must be HOST:PORT")


def test_top_level_help_lists_the_subcommands() -> None:
    from commd.cli.main import build_parser

    parser = build_parser()
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert len(actions) == 1
    names = list(actions[0].choices)
    assert {"run", "status"} <= set(names)
    result = cli("--help")
    assert result.returncode == 0
    for name in names:
        assert f"    {name} " in result.stdout or f"    {name}\n" in result.stdout


def test_run_with_a_bad_metrics_listen_exits_2_with_one_line() -> None:
    for argv, env in [(("--metrics-listen", "nonsense"), {}),
                      ((), {"COMMD_METRICS_LISTEN": "localhost:http"})]:
        result = cli("run", *argv, "--socket", "/nonexistent/dir/commd.sock", env=env)
        assert one_error_line(result, returncode=2).startswith(
            "commd: metrics_listen must be HOST:PORT, got ")


# --- the other subcommands ----------------------------------------------------------------------


def test_costs_help_has_examples() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "commd.cli", "costs", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0
    assert "examples:" in done.stdout and "commd costs --nodes 8" in done.stdout


@pytest.fixture
def profile_path(tmp_path: Path) -> Path:
    layers = [{"name": "conv1", "bytes": 40_000, "backward_s": 0.010},
              {"name": "fc1", "bytes": 30_000_000, "backward_s": 0.002}]
    path = tmp_path / "toy.json"
    path.write_text(json.dumps({"name": "toy", "forward_s": 0.03, "layers": layers}))
    return path


def test_simulate_command_line(profile_path: Path) -> None:
    argv = ["--profile", str(profile_path), "--network", "100gbe", "--nodes", "8,16", "--json"]
    done = subprocess.run(
        [sys.executable, "-m", "commd.cli", "simulate", *argv],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert [r["nodes"] for r in json.loads(done.stdout)] == [8, 16]
    bad = subprocess.run(
        [sys.executable, "-m", "commd.cli", "simulate", "--profile", str(profile_path),
         "--nodes", "x"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2
    assert bad.stderr.startswith("commd: ") and "Traceback" not in bad.stderr


def test_commd_run_backend_nccl_exits_at_once(tmp_path: Any) -> None:
    if gpu_present():
        pytest.skip("a GPU is present")
    began = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "commd.cli", "run", "--backend", "nccl", "--socket",
         str(tmp_path / "s.sock"), "--listen", "127.0.0.1:0", "--log-level", "error"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("commd: --backend nccl cannot run here: ")
    assert time.monotonic() - began < 30


# --- what an import pulls in --------------------------------------------------------------------


def test_model_sizes_do_not_import_torch() -> None:
    code = (
        "import sys, commd.models, commd.models.sizes as s; "
        "assert 'torch' not in sys.modules, 'torch imported'; "
        "print(len(s.resnet50_layer_sizes()), sum(n for _, n in s.resnet50_layer_sizes()))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["161", "25557032"]


def test_client_import_is_thin() -> None:
    code = (
        "import json, sys, commd_client\n"
        "print(json.dumps(sorted(m for m in ('torch', 'uvloop', 'cupy', 'commd')"
        " if m in sys.modules)))\n"
    )
    environ = {k: v for k, v in os.environ.items() if k != "PYTHONSTARTUP"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=30, cwd=REPO, env=environ, check=True)
    assert json.loads(result.stdout) == []
