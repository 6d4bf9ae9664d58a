"""The client against a missing daemon (in a fresh process) and against a real `commd run`:
without cupy, and refusing bad arguments before creating anything (the checks themselves are in
tests/unit/test_client_arguments.py): the failures a rank sees first, each one line saying
what to do."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from commd.testing.processes import finish
from commd_client import Client, CommdError

from daemons import commd_segments

REPO = Path(__file__).resolve().parents[2]

_CONNECT = """
import json, sys, time
from commd_client import Client, CommdError
started = time.monotonic()
try:
    Client(job="unit", rank=0, world_size=1, local_rank=0, local_world_size=1,
           coordinator="127.0.0.1:1", socket=sys.argv[1], timeout=0.5)
except CommdError as exc:
    print(json.dumps({"kind": type(exc).__name__, "message": str(exc),
                      "timeout": isinstance(exc, TimeoutError),
                      "elapsed": time.monotonic() - started}))
else:
    print(json.dumps({"kind": None}))
"""


def dead_socket(path: Path) -> Path:
    """A socket file that exists but that nothing listens on."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.close()
    return path


def segments() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("commd-*")}


def test_client_without_a_daemon_fails_fast(tmp_path: Path) -> None:
    before = segments()
    paths = [tmp_path / "absent.sock", dead_socket(tmp_path / "dead.sock")]
    started = time.monotonic()
    runs = [subprocess.Popen([sys.executable, "-c", _CONNECT, str(p)], stdout=subprocess.PIPE,
                             text=True, cwd=REPO) for p in paths]
    try:
        left = max(0.1, 2.5 - (time.monotonic() - started))
        outputs = [done.stdout for done in finish(runs, left)]
    except subprocess.TimeoutExpired:
        pytest.fail("Client() without a daemon did not return within 2.5 s (timeout=0.5)")
    for output in outputs:
        result = json.loads(output)
        assert result["kind"] in ("CommdError", "CommdTimeout")
        assert result["message"].startswith("commd: ")
        assert result["elapsed"] < 2.0
    assert segments() - before == set()


def test_register_on_a_device_without_cupy(monkeypatch: pytest.MonkeyPatch,
                                           start_daemon: Any) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)
    daemon = start_daemon("--backend", "gloo")
    with Client(job="nocupy", rank=0, world_size=1, local_rank=0, local_world_size=1,
                coordinator=daemon.address, socket=daemon.socket, timeout=10) as client:
        with pytest.raises(CommdError, match="device buffers need cupy"):
            client.register([("w", 4)], device="cuda")
        with pytest.raises(CommdError, match="device must be"):
            client.register([("w", 4)], device="tpu")
        views = client.register([("w", 4)], op="sum")  # the host path still works
        views[0][:] = 2
        with pytest.raises(CommdError, match=r"ready\(stream=\) is for device buffers"):
            client.ready(0, stream=5)
        client.ready(0)
        client.wait()
        assert views[0].tolist() == [2, 2, 2, 2]


def test_a_client_refuses_before_creating_anything(start_daemon: Any) -> None:
    daemon = start_daemon()
    before = commd_segments()
    with Client(job="args", rank=0, world_size=1, local_rank=0, local_world_size=1,
                coordinator=daemon.address, socket=daemon.socket, timeout=30) as client:
        for layers in ([("w", 2**63)], [("w", -1)], [("w", 4), ("w", 4)], [("w", 1.5)]):
            with pytest.raises(CommdError, match="register"):
                client.register(layers)
            assert commd_segments() == before  # no segment leaked or left behind
        with pytest.raises(CommdError, match="before register"):
            client.ready(0)
        grads = client.register([("w", 4), ("b", 2)], op="sum")
        for bad in (True, 1.5, "0", 2):
            with pytest.raises(CommdError, match="ready"):
                client.ready(bad)
        grads[0][:] = 1.0
        grads[1][:] = 2.0
        client.ready([1, 0])
        client.wait()  # the refused calls changed nothing: the iteration runs
        assert grads[0].tolist() == [1.0] * 4 and grads[1].tolist() == [2.0] * 2
