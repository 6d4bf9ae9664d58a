"""One rank's environment inside a test process: none of the launcher's (torchrun's) or
commd's variables that the shell running the tests may have set, and a daemon to talk to."""

from __future__ import annotations

import pytest

from commd.testing.daemons import LocalDaemon

LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "COMMD_JOB",
                      "COMMD_COORDINATOR", "COMMD_SOCKET", "TORCHELASTIC_RUN_ID",
                      "MASTER_ADDR", "MASTER_PORT", "COMMD_FAULT_TOLERANCE",
                      "COMMD_MIN_WORLD_SIZE", "COMMD_NODE_RANK", "COMMD_NNODES")


def clear_launcher_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    """No torchrun or commd variable of the shell running the tests leaks in."""
    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def point_at(daemon: LocalDaemon, monkeypatch: pytest.MonkeyPatch) -> LocalDaemon:
    """A one-rank environment pointing at ``daemon``, with a 20 s timeout."""
    clear_launcher_variables(monkeypatch)
    monkeypatch.setenv("COMMD_SOCKET", daemon.socket)
    monkeypatch.setenv("COMMD_COORDINATOR", daemon.address)
    monkeypatch.setenv("COMMD_TIMEOUT", "20")
    return daemon
