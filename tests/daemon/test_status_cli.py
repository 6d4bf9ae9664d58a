"""`commd status`: failing cleanly without a daemon, and rendering what a daemon reports."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from cli_runs import one_error_line

from commd.cli.main import main
from commd.cli.status import render
from commd_protocol import Done, StatusReply, StatusRequest, encode
from commd_protocol.codec import client_codec
from commd_protocol.status import read_status

REPO = Path(__file__).resolve().parents[2]


def status_cli(*argv: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("COMMD_")}
    return subprocess.run(
        [sys.executable, "-m", "commd.cli", "status", *argv],
        capture_output=True, text=True, timeout=timeout, cwd=REPO, env=environ,
    )


def test_no_socket_file() -> None:
    line = one_error_line(status_cli("--socket", "/nonexistent"), returncode=1)
    assert line == "commd: no daemon socket at /nonexistent; is `commd run` running?"


def test_a_dead_socket_file_is_said_at_once(tmp_path: Path) -> None:
    """The file a killed daemon leaves: nothing listens, said at connect, not after waiting
    for a reply (the timeout is longer than the subprocess's budget)."""
    path = tmp_path / "dead.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.close()  # the file stays; nothing listens
    assert path.exists()
    result = status_cli("--socket", str(path), "--timeout", "600", timeout=30)
    line = one_error_line(result, returncode=1)
    assert line == (f"commd: no daemon listens on {path} (a socket file left by a daemon "
                    "that stopped); is `commd run` running?")


@pytest.fixture
def router(tmp_path: Path) -> Iterator[tuple[str, zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = context.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    path = str(tmp_path / "r.sock")
    sock.bind(f"ipc://{path}")
    try:
        yield path, sock
    finally:
        sock.close(linger=0)


def test_a_daemon_that_never_answers(router: tuple[str, zmq.Socket[bytes]]) -> None:
    path, sock = router
    started = time.monotonic()
    result = status_cli("--socket", path, "--timeout", "0.3", timeout=10)
    elapsed = time.monotonic() - started
    line = one_error_line(result, returncode=1)
    assert line == f"commd: no daemon answered on {path} within 0.3s"
    assert elapsed < 0.3 + 4
    # what it asked was a status request
    assert sock.poll(2000)
    _, frame = sock.recv_multipart()
    assert isinstance(client_codec.decode(frame), StatusRequest)


SAMPLE: dict[str, Any] = {
    "version": "0.1.0",
    "protocol": 1,
    "backend": "gloo",
    "uptime_s": 125.4,
    "pid": 4321,
    "socket": "/run/commd/commd.sock",
    "listen": "0.0.0.0:29600",
    "jobs": [
        {
            "job": "resnet50-run7", "state": "running", "world_size": 8, "local_ranks": [0, 1],
            "nodes": 4, "node_index": 0, "iteration": 1234, "planner": "optimal",
            "groups": [[160, 159], [158], [0, 1, 2]], "layers": 161, "dtype": "float32",
            "op": "avg", "iteration_s": {"last": 0.0131, "mean": 0.0125}, "error": None,
        },
        {
            "job": "bert", "state": "forming", "world_size": 2, "local_ranks": [1],
            "nodes": None, "node_index": None, "iteration": 0, "planner": None, "groups": [],
            "layers": 0, "dtype": None, "op": None, "iteration_s": None, "error": None,
        },
        {
            "job": "vgg", "state": "failed", "world_size": 2, "local_ranks": [0],
            "nodes": 2, "node_index": 1, "iteration": 9, "planner": "mgwfbp",
            "groups": [[1, 0]], "layers": 2, "dtype": "bfloat16", "op": "sum",
            "iteration_s": {"last": 0.5, "mean": 0.25},
            "error": "commd: rank 1 went away; restart the job",
        },
    ],
    "coordinating": [],
}
COLUMNS = ["JOB", "STATE", "RANKS", "NODE", "ITER", "PLANNER", "GROUPS", "ITER_MS"]


def test_render_a_table_of_jobs() -> None:
    text = render(read_status(SAMPLE))
    lines = text.splitlines()
    assert "0.1.0" in lines[0] and "gloo" in lines[0] and "4321" in lines[0]
    assert "125s" in lines[0]
    assert "/run/commd/commd.sock" in lines[1] and "0.0.0.0:29600" in lines[1]
    header = next(line for line in lines if line.startswith("JOB"))
    assert header.split() == COLUMNS
    rows = [line for line in lines if line.startswith(("resnet50-run7 ", "bert ", "vgg "))]
    assert len(rows) == 3
    # columns line up: every cell starts where its header does
    starts = [header.index(name) for name in COLUMNS]
    for row in rows:
        for start in starts[1:]:
            assert row[start - 2 : start] == "  " and row[start] != " "
    cells = {row.split()[0]: row.split() for row in rows}
    assert cells["resnet50-run7"] == ["resnet50-run7", "running", "0,1", "of", "8", "0/4", "1234",
                                      "optimal", "3", "12.5"]
    assert cells["bert"] == ["bert", "forming", "1", "of", "2", "-", "0", "-", "0", "-"]
    assert cells["vgg"][1] == "failed" and cells["vgg"][5] == "1/2"
    assert "vgg: commd: rank 1 went away; restart the job" in lines
    assert "no jobs" not in text


def test_render_no_jobs() -> None:
    empty = {**SAMPLE, "jobs": []}
    text = render(read_status(empty))
    assert text.splitlines()[-1] == "no jobs"
    assert "JOB" not in text
    assert render(read_status({k: v for k, v in SAMPLE.items() if k != "jobs"})).endswith(
        "no jobs")


def test_render_names_the_compression_loops() -> None:
    loops = {**SAMPLE, "compression_loops": "compiled, AVX-512"}
    assert "compression loops compiled, AVX-512" in render(read_status(loops)).splitlines()
    assert "compression loops" not in render(read_status(SAMPLE))  # an older daemon


def test_render_a_status_that_travelled_the_wire() -> None:
    reply = msgspec.msgpack.decode(encode(StatusReply(status=SAMPLE)), type=StatusReply)
    assert render(read_status(reply.status)) == render(read_status(SAMPLE))


@pytest.fixture
def answering(router: tuple[str, zmq.Socket[bytes]]) -> Iterator[Callable[[bytes], str]]:
    """A fake daemon that answers the first request with the given frame."""
    path, sock = router
    threads: list[threading.Thread] = []

    def serve(reply: bytes) -> str:
        def once() -> None:
            if sock.poll(10_000):
                identity, _ = sock.recv_multipart()
                sock.send_multipart([identity, reply])

        thread = threading.Thread(target=once, daemon=True)
        thread.start()
        threads.append(thread)
        return path

    yield serve
    for thread in threads:
        thread.join(timeout=15)


def test_status_prints_the_table(answering: Callable[[bytes], str]) -> None:
    path = answering(encode(StatusReply(status=SAMPLE)))
    result = status_cli("--socket", path, "--timeout", "5")
    assert result.returncode == 0, result.stderr
    assert result.stdout.rstrip("\n") == render(read_status(SAMPLE))


def test_status_json(
    answering: Callable[[bytes], str], capsys: pytest.CaptureFixture[str]
) -> None:
    path = answering(encode(StatusReply(status=SAMPLE)))
    assert main(["status", "--socket", path, "--json", "--timeout", "5"]) == 0
    assert json.loads(capsys.readouterr().out) == SAMPLE


@pytest.mark.parametrize(
    ("reply", "expected"),
    [(encode(Done(iteration=1)), "unexpected reply Done"), (b"\xc1", "unreadable reply")],
    ids=["wrong-type", "garbage"],
)
def test_status_with_a_bad_reply(
    answering: Callable[[bytes], str],
    capsys: pytest.CaptureFixture[str],
    reply: bytes,
    expected: str,
) -> None:
    path = answering(reply)
    assert main(["status", "--socket", path, "--timeout", "5"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("commd: ")
    assert expected in lines[0] and path in lines[0]
