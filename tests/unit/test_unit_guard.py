"""The unit tier's guard (tests/unit_guard.py, on for every test here): a process is refused,
and so is binding, connecting or sending a datagram on a network or Unix socket; what asyncio
and in-process ZeroMQ need is not; a refusal that the code under test swallows is still held
against the test."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import zmq
from unit_guard import UnitTierViolation, guarded, refused, violations


def test_a_process_is_refused() -> None:
    with refused():
        subprocess.run([sys.executable, "-c", "pass"], check=False)
    with refused():
        os.system("true")
    with refused():
        os.fork()


@pytest.mark.parametrize("family", [socket.AF_INET, socket.AF_INET6])
def test_a_network_socket_is_refused(family: socket.AddressFamily) -> None:
    with socket.socket(family, socket.SOCK_STREAM) as sock, refused():
        sock.bind(("localhost", 0))
    with socket.socket(family, socket.SOCK_DGRAM) as sock, refused():
        sock.connect(("localhost", 9))
    with socket.socket(family, socket.SOCK_STREAM) as sock, refused():
        sock.connect_ex(("localhost", 9))


def test_a_unix_socket_is_refused(tmp_path: Path) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock, refused():
        sock.bind(str(tmp_path / "s.sock"))
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock, refused():
        sock.connect(str(tmp_path / "s.sock"))
    assert not (tmp_path / "s.sock").exists()


@pytest.mark.parametrize(("family", "address"), [
    (socket.AF_INET, ("127.0.0.1", 9)), (socket.AF_UNIX, "/nonexistent-commd-dir/notify"),
])
def test_a_datagram_is_refused(family: socket.AddressFamily, address: tuple[str, int] | str
                              ) -> None:
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        with refused():
            sock.sendto(b"x", address)
        with refused():
            sock.sendto(b"x", 0, address)


def test_zeromq_is_refused_but_inproc() -> None:
    context = zmq.Context()
    try:
        with context.socket(zmq.PAIR) as server, context.socket(zmq.PAIR) as client:
            for address in ("tcp://127.0.0.1:0", "ipc:///tmp/commd-unit-guard.ipc"):
                with refused():
                    server.bind(address)
                with refused():
                    client.connect(address)
            server.bind("inproc://guard")
            client.connect("inproc://guard")
            client.send(b"in-process")
            assert server.recv() == b"in-process"
    finally:
        context.term()


def test_asyncio_and_socketpair_are_allowed() -> None:
    left, right = socket.socketpair()
    with left, right:
        left.sendall(b"x")
        assert right.recv(1) == b"x"

    async def twice(value: int) -> int:
        await asyncio.sleep(0)
        return 2 * value

    assert asyncio.run(twice(21)) == 42


async def test_an_asyncio_test_runs() -> None:
    await asyncio.sleep(0)


def test_a_swallowed_refusal_is_recorded() -> None:
    with contextlib.suppress(Exception):  # a careless caller: the record still fails the test
        subprocess.run(["true"], check=False)
    assert violations and violations[-1].startswith("starts a process")
    violations.clear()  # forgiven: this test means it


def test_the_guard_restores_what_it_patched() -> None:
    # Nested, as the conftest's is around this test: leaving the inner block keeps the outer on.
    with guarded():
        pass
    with pytest.raises(UnitTierViolation):
        subprocess.run(["true"], check=False)
    violations.clear()
