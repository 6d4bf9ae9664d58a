"""The systemd unit, its example config, and sd_notify through a real datagram socket."""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from commd.daemon import sdnotify

SYSTEMD_DIR = Path(__file__).resolve().parents[2] / "systemd"
UNIT = SYSTEMD_DIR / "commd.service"
CONFIG = SYSTEMD_DIR / "commd.toml"
ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze is not installed")


# --- the unit file -------------------------------------------------------------------------


def unit_settings(text: str) -> dict[str, list[str]]:
    """``"Section.Key" -> values`` in order; enough of systemd's syntax for our own unit."""
    settings: dict[str, list[str]] = {}
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        settings.setdefault(f"{section}.{key.strip()}", []).append(value.strip())
    return settings


def one(settings: dict[str, list[str]], key: str) -> str:
    values = settings.get(key)
    assert values, f"{key} is not set"
    return values[-1]


def test_unit_is_a_notify_service_with_watchdog_and_runtime_dir() -> None:
    s = unit_settings(UNIT.read_text())
    assert one(s, "Service.Type") == "notify"
    assert one(s, "Service.NotifyAccess") == "main"
    assert one(s, "Service.Restart") == "on-failure"
    assert one(s, "Service.RuntimeDirectory") == "commd"
    watchdog = one(s, "Service.WatchdogSec")
    assert watchdog.endswith("s") and 10 <= int(watchdog[:-1]) <= 120
    exec_start = one(s, "Service.ExecStart").split()
    assert exec_start[1:] == ["run", "--config", "/etc/commd/commd.toml"]
    assert one(s, "Install.WantedBy") == "multi-user.target"


def test_unit_hardening_leaves_gpus_and_shared_memory_reachable() -> None:
    s = unit_settings(UNIT.read_text())
    # Each of these hides /dev/nvidia* (a device allow-list) or the trainers' segments.
    for key in ("PrivateDevices", "DevicePolicy", "DeviceAllow", "ProtectClock", "PrivateIPC"):
        assert f"Service.{key}" not in s, f"{key}= would cut the daemon off GPUs or /dev/shm"
    assert "/dev/shm" in " ".join(s.get("Service.ReadWritePaths", []))
    for key in ("InaccessiblePaths", "TemporaryFileSystem"):
        assert "/dev" not in " ".join(s.get(f"Service.{key}", []))
    families = one(s, "Service.RestrictAddressFamilies").split()
    assert {"AF_UNIX", "AF_INET", "AF_INET6"} <= set(families)


def test_unit_grants_no_capability() -> None:
    """Buffers come as file descriptors: the daemon needs no right over others' files."""
    s = unit_settings(UNIT.read_text())
    assert one(s, "Service.CapabilityBoundingSet") == ""
    assert "Service.AmbientCapabilities" not in s
    assert one(s, "Service.User") != "root" and one(s, "Service.NoNewPrivileges") == "yes"


def test_example_config_matches_the_unit() -> None:
    config = tomllib.loads(CONFIG.read_text())
    assert set(config) == {"socket", "listen", "cluster_key", "backend", "timeout_s",
                           "log_level"}
    unit = unit_settings(UNIT.read_text())
    runtime_dir = one(unit, "Service.RuntimeDirectory")
    assert config["socket"] == f"/run/{runtime_dir}/commd.sock"
    # The drain must end before systemd gives up on the stop and sends SIGKILL.
    stop = one(unit, "Service.TimeoutStopSec")
    assert stop.endswith("s") and config["timeout_s"] < int(stop[:-1])
    assert config["listen"].rsplit(":", 1)[1] == "29600"
    assert config["backend"] in {"auto", "gloo", "nccl"}
    assert isinstance(config["timeout_s"], float) and config["timeout_s"] > 0
    assert config["log_level"] in {"debug", "info", "warning", "error"}


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


def test_noop_outside_systemd(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert sdnotify.notify("READY=1") is False
    assert sdnotify.ready("x") is False
    assert sdnotify.status("x") is False
    assert sdnotify.stopping() is False


@pytest.mark.parametrize("value", ["", "vsock:2:1234", "relative/path", "@"])
def test_unusable_notify_socket_values_are_ignored(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", value)
    assert sdnotify.notify("READY=1") is False


def test_send_failure_returns_false(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", "/nonexistent-commd-dir/notify")
    assert sdnotify.ready() is False


@pytest.mark.parametrize(
    ("usec", "pid", "expected"),
    [
        (None, None, None),
        ("30000000", None, 30.0),
        ("30000000", "self", 30.0),
        ("30000000", "other", None),
        ("30000000", "junk", None),
        ("20000", None, 0.02),
        ("0", None, None),
        ("junk", None, None),
    ],
)
def test_watchdog_interval(
    monkeypatch: pytest.MonkeyPatch, usec: str | None, pid: str | None, expected: float | None
) -> None:
    for name, value in (("WATCHDOG_USEC", usec), ("WATCHDOG_PID", pid)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            own = os.getpid()
            value = {"self": str(own), "other": str(own + 1)}.get(value, value)
            monkeypatch.setenv(name, value)
    assert sdnotify.watchdog_interval() == expected


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
