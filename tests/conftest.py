from __future__ import annotations

import asyncio
import os
import re
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq.asyncio

from commd.daemon.server import Daemon
from commd.daemon.settings import Settings
from commd_client.host_buffer import HostBuffer

from daemons import DaemonProcess, commd_segments
from inprocess import RawClient, hand_over

TESTS = Path(__file__).resolve().parent
# A test's tier is its folder: `-m unit` selects what `pytest tests/unit` runs (docs: CONTRIBUTING).
TIERS = ("unit", "daemon", "system")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        path = item.path.resolve()
        if not path.is_relative_to(TESTS):
            continue
        tier = path.relative_to(TESTS).parts[0]
        if tier not in TIERS:
            raise pytest.UsageError(f"{path}: a test file belongs in tests/unit, tests/daemon "
                                    "or tests/system")
        item.add_marker(tier)


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


@pytest.fixture
def daemon_settings() -> dict[str, Any]:
    """What a test module changes in the in-process daemon's settings (override this)."""
    return {}


@pytest.fixture
async def daemon(tmp_path: Path, daemon_settings: dict[str, Any]) -> AsyncIterator[Daemon]:
    """A daemon in this process, on a real ipc socket and a real peer port."""
    settings = Settings(**{"socket": str(tmp_path / "d.sock"), "listen": "127.0.0.1:0",
                           "backend": "gloo", "timeout_s": 20, **daemon_settings})
    instance = Daemon(settings)
    task = asyncio.create_task(instance.run())
    while instance.peer_port == 0 or not os.path.exists(settings.socket):
        await asyncio.sleep(0.01)  # polling a condition, bounded by the test timeout
    yield instance
    instance.stop()
    await asyncio.wait_for(task, 20)
    assert not os.path.exists(settings.socket)


@pytest.fixture
async def connect(daemon: Daemon) -> AsyncIterator[Any]:
    context = zmq.asyncio.Context()
    clients: list[RawClient] = []

    def make() -> RawClient:
        client = RawClient(context, daemon.settings.socket)
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.socket.close(linger=0)
    context.term()


@pytest.fixture
async def segments(daemon: Daemon) -> AsyncIterator[Any]:
    """``await segments(nbytes)``: a host buffer handed over to the in-process daemon, as a
    client does it (in a thread: the daemon answers on this loop); ``.token`` registers it."""
    made: list[HostBuffer] = []

    async def make(nbytes: int) -> HostBuffer:
        buffer = HostBuffer(f"commd-test-{len(made)}", nbytes)
        made.append(buffer)
        buffer.token = await hand_over(daemon, buffer)  # type: ignore[attr-defined]
        return buffer

    yield make
    for buffer in made:
        buffer.close()
