"""The systemd unit checked by systemd-analyze, and sd_notify through a real datagram socket.
The unit and its example config read as data, and sd_notify's reading of the environment, are
in tests/unit/test_systemd_unit.py."""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from commd.daemon import sdnotify

SYSTEMD_DIR = Path(__file__).resolve().parents[2] / "systemd"
UNIT = SYSTEMD_DIR / "commd.service"
CONFIG = SYSTEMD_DIR / "commd.toml"
ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze is not installed")


# --- the unit file, checked by systemd-analyze -----------------------------------------------


@pytest.fixture
def verifiable_unit(tmp_path: Path) -> Path:
    """The unit with ExecStart's binary swapped for one that exists here.

    verify rejects a unit whose binary is missing, and /usr/local/bin/commd is not installed
    on a development machine; everything else in the unit is checked as shipped.
    """
    true = shutil.which("true")
    assert true is not None
    text = UNIT.read_text().replace("ExecStart=/usr/local/bin/commd ", f"ExecStart={true} ")
    assert f"ExecStart={true} run" in text
    copy = tmp_path / "commd.service"
    copy.write_text(text)
    return copy


@needs_analyze
def test_systemd_analyze_verify_is_clean(verifiable_unit: Path) -> None:
    assert ANALYZE is not None
    done = subprocess.run(
        [ANALYZE, "verify", str(verifiable_unit)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    # verify exits 0 on unknown keys and bad values; only empty output means a clean unit.
    report = (done.stdout + done.stderr).strip()
    assert done.returncode == 0, report
    assert "commd" not in report, report


@needs_analyze
def test_systemd_analyze_security_exposure_stays_low(verifiable_unit: Path) -> None:
    assert ANALYZE is not None
    done = subprocess.run(
        [ANALYZE, "security", "--offline=true", "--threshold=50", str(verifiable_unit)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if done.returncode != 0 and "offline" in done.stderr:
        pytest.skip(f"this systemd-analyze has no offline security check: {done.stderr}")
    # --threshold=50 fails above an exposure of 5.0 ("MEDIUM"); the unit scores about 4.
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr


# --- sd_notify -----------------------------------------------------------------------------


@pytest.fixture
def notify_socket(monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    """A bound datagram socket standing in for systemd's, named in NOTIFY_SOCKET."""
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    # A short directory: unix socket paths are limited to 107 bytes, pytest's tmp_path is long.
    with (
        tempfile.TemporaryDirectory(prefix="sdn") as tmp,
        socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock,
    ):
        path = os.path.join(tmp, "notify")
        sock.bind(path)
        sock.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", path)
        yield sock


def test_ready_status_stopping_arrive(notify_socket: socket.socket) -> None:
    assert sdnotify.ready("listening on 0.0.0.0:29600")
    assert notify_socket.recv(4096) == b"READY=1\nSTATUS=listening on 0.0.0.0:29600"
    assert sdnotify.status("2 jobs")
    assert notify_socket.recv(4096) == b"STATUS=2 jobs"
    assert sdnotify.stopping()
    assert notify_socket.recv(4096) == b"STOPPING=1"
    assert sdnotify.stopping("draining 1 job")
    assert notify_socket.recv(4096) == b"STOPPING=1\nSTATUS=draining 1 job"
    assert sdnotify.ready()
    assert notify_socket.recv(4096) == b"READY=1"


def test_notify_joins_fields_into_one_datagram(notify_socket: socket.socket) -> None:
    assert sdnotify.notify("STATUS=a", "ERRNO=0", "X_COMMD=1")
    assert notify_socket.recv(4096) == b"STATUS=a\nERRNO=0\nX_COMMD=1"


def test_status_is_one_line_and_fields_reject_newlines(notify_socket: socket.socket) -> None:
    assert sdnotify.status("two\nlines")
    assert notify_socket.recv(4096) == b"STATUS=two lines"
    with pytest.raises(ValueError, match="newline"):
        sdnotify.notify("STATUS=x\nREADY=1")


def test_abstract_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"commd-test-{secrets.token_hex(6)}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert sdnotify.ready()
        assert sock.recv(4096) == b"READY=1"


def test_send_failure_returns_false(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", "/nonexistent-commd-dir/notify")
    assert sdnotify.ready() is False


async def test_watchdog_loop_returns_at_once_without_watchdog(
    notify_socket: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    await asyncio.wait_for(sdnotify.watchdog_loop(), timeout=5)
    # Another process's watchdog (WATCHDOG_PID not ours) is not ours to feed either.
    monkeypatch.setenv("WATCHDOG_USEC", "20000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))
    await asyncio.wait_for(sdnotify.watchdog_loop(), timeout=5)
    # Nor is there anyone to ping without a notify socket.
    monkeypatch.delenv("WATCHDOG_PID")
    monkeypatch.delenv("NOTIFY_SOCKET")
    await asyncio.wait_for(sdnotify.watchdog_loop(), timeout=5)


async def test_watchdog_loop_pings_at_half_the_interval_until_cancelled(
    notify_socket: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "20000")  # 20 ms: a ping every 10 ms
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    period = 0.010
    notify_socket.setblocking(False)  # loop.sock_recv needs it; wait_for is the timeout
    loop = asyncio.get_running_loop()
    start = loop.time()
    task = asyncio.create_task(sdnotify.watchdog_loop())
    arrivals = []
    for _ in range(3):
        data = await asyncio.wait_for(loop.sock_recv(notify_socket, 4096), timeout=5)
        assert data == b"WATCHDOG=1"
        arrivals.append(loop.time() - start)
    # Ping k is scheduled k periods after the start and asyncio timers never fire early, so
    # arrival k cannot come sooner. The upper bound is loose because a loaded 2-core machine
    # delays wake-ups; the exact period is checked without real time in the next test.
    for k, arrived in enumerate(arrivals):
        assert arrived >= k * period - 1e-3, arrivals
    assert arrivals[2] < 0.5, arrivals

    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    while True:  # drop pings sent before the cancellation landed
        try:
            notify_socket.recv(4096)
        except BlockingIOError:
            break
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(loop.sock_recv(notify_socket, 4096), timeout=10 * period)


async def test_watchdog_loop_sleeps_half_the_interval(
    notify_socket: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    delays: list[float] = []
    real_sleep = asyncio.sleep

    async def recording_sleep(delay: float) -> None:
        delays.append(delay)
        if len(delays) == 3:
            raise asyncio.CancelledError
        await real_sleep(0)

    monkeypatch.setattr(sdnotify.asyncio, "sleep", recording_sleep)
    with pytest.raises(asyncio.CancelledError):
        await sdnotify.watchdog_loop(interval=60.0)  # an explicit interval needs no WATCHDOG_USEC
    # The fake sleep does not let time pass, so each wait reaches one period (30 s) further
    # along a fixed schedule from the start: half the interval, no drift.
    assert delays == pytest.approx([30.0, 60.0, 90.0], abs=0.5)
    for _ in range(3):
        assert notify_socket.recv(4096) == b"WATCHDOG=1"
