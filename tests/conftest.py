from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from daemons import DaemonProcess, commd_segments


@pytest.fixture(autouse=True)
def no_leaked_segments() -> Iterator[None]:
    """Every test leaves /dev/shm as it found it."""
    before = commd_segments()
    yield
    leaked = commd_segments() - before
    for name in leaked:  # clean up so one failure does not cascade
        Path("/dev/shm", name).unlink(missing_ok=True)
    assert not leaked, f"leaked shared-memory segments: {sorted(leaked)}"


@pytest.fixture
def start_daemon(tmp_path: Path) -> Iterator[Callable[..., DaemonProcess]]:
    """Start real `commd run` subprocesses; all are stopped (SIGTERM) after the test."""
    started: list[DaemonProcess] = []

    def start(*extra: str, name: str | None = None, env: dict[str, str] | None = None):
        daemon = DaemonProcess(tmp_path, name or f"d{len(started)}", *extra, env=env)
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:
        daemon.stop()
