from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from daemons import DaemonProcess, commd_segments


def mapped_segments() -> set[str]:
    mapped = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:  # the process exited meanwhile
            continue
        mapped.update(m.group(1) for m in re.finditer(r"/dev/shm/(commd-\S+)", text))
    return mapped


@pytest.fixture(autouse=True)
def no_leaked_segments() -> Iterator[None]:
    """Every test leaves /dev/shm as it found it."""
    before = commd_segments()
    yield
    # By now every process this test started is stopped; a segment still mapped by a live
    # process belongs to someone else on this machine (a benchmark, another test run).
    leaked = commd_segments() - before - mapped_segments()
    for name in leaked:  # clean up so one failure does not cascade
        Path("/dev/shm", name).unlink(missing_ok=True)
    assert not leaked, f"leaked shared-memory segments: {sorted(leaked)}"


@pytest.fixture
def start_daemon(tmp_path: Path) -> Iterator[Callable[..., DaemonProcess]]:
    """Start real `commd run` subprocesses; all are stopped (SIGTERM) after the test."""
    started: list[DaemonProcess] = []

    def start(*extra: str, name: str | None = None, env: dict[str, str] | None = None):
        # The CPU tests mean Gloo: on a GPU machine `auto` would pick NCCL.
        backend = () if "--backend" in extra else ("--backend", "gloo")
        daemon = DaemonProcess(tmp_path, name or f"d{len(started)}", *backend, *extra, env=env)
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:
        daemon.stop()
