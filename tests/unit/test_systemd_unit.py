"""The systemd unit and its example config, read as data, and what sd_notify makes of the
environment systemd sets (no socket). sd_notify through a real datagram socket and
systemd-analyze on the unit are in tests/daemon/test_systemd.py."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

import pytest

from commd.daemon import sdnotify

SYSTEMD_DIR = Path(__file__).resolve().parents[2] / "systemd"
UNIT = SYSTEMD_DIR / "commd.service"
CONFIG = SYSTEMD_DIR / "commd.toml"


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


# --- sd_notify: what the environment says -----------------------------------------------------

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
