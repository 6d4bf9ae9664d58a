"""A daemon that cannot start says why in one line and leaves nothing behind; one that finds
another daemon on its socket leaves that daemon's socket alone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from commd.cli.status import query
from commd.testing.ports import busy_port


def commd_run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "commd.cli", "run", "--backend", "gloo", *argv],
                          capture_output=True, text=True, timeout=30)


def test_a_busy_peer_port_fails_the_start_and_removes_the_socket(tmp_path: Path) -> None:
    path = tmp_path / "d.sock"
    with busy_port() as port:
        done = commd_run("--socket", str(path), "--listen", f"127.0.0.1:{port}")
    assert done.returncode == 1, done.stderr
    assert f"cannot listen for peers on 127.0.0.1:{port}" in done.stderr
    assert not path.exists()  # it had bound the client socket first; it removed it


def test_a_second_daemon_on_the_same_socket_leaves_the_first_alone(start_daemon) -> None:
    first = start_daemon()
    done = commd_run("--socket", first.socket, "--listen", "127.0.0.1:0")
    assert done.returncode == 1 and "another daemon is serving" in done.stderr, done.stderr
    assert os.path.exists(first.socket)
    assert query(first.socket)["pid"] == first.process.pid
