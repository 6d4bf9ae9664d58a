"""Host buffers are handed over as sealed memfds, never named: a rank cannot make the daemon
read, write or unlink anything it could not itself, nor crash it by shrinking its buffer."""

from __future__ import annotations

import asyncio
import fcntl
import os
import socket
from pathlib import Path
from typing import Any

import pytest

from commd.daemon import handover, shares
from commd.daemon.server import Daemon
from commd_client.host_buffer import HostBuffer
from commd_protocol.handover import OK, buffer_socket_path

from inprocess import coordinator_of, hello, still_serving

REGISTER = {"type": "register", "dtype": "float32", "op": "sum", "planner": "wfbp",
            "layers": [{"name": "w", "size": 4}]}


def send(daemon: Daemon, message: bytes, fds: list[int]) -> bytes:
    """One raw hand-over: ``message`` with ``fds``; the daemon's one-message answer."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as link:
        link.settimeout(10)
        link.connect(buffer_socket_path(daemon.settings.socket))
        socket.send_fds(link, [message], fds)
        return link.recv(512)


async def hand(daemon: Daemon, message: bytes, fds: list[int]) -> bytes:
    return await asyncio.to_thread(send, daemon, message, fds)


TOKEN = b"0123456789abcdef0123456789abcdef"


async def test_a_registered_buffer_is_the_memory_the_rank_sees(
        daemon: Daemon, connect: Any, segments: Any) -> None:
    client = connect()
    await client.ask(hello(coordinator=coordinator_of(daemon), pid=424242))  # a false pid
    buffer = await segments(16)
    reply = await client.ask({**REGISTER, "buffer_token": buffer.token})
    assert reply["type"] == "registered", reply
    (session,) = daemon._sessions._sessions.values()
    assert session.member.pid == os.getpid()  # the kernel's word (SO_PEERCRED), not hello's
    assert session.member.segment is not None
    array = session.member.buffer
    array[:] = [1.0, 2.0, 3.0, 4.0]  # written by the daemon's mapping ...
    assert bytes(buffer.buf[:8]) == array[:2].tobytes()  # ... seen in the rank's
    assert not any(name.startswith("commd-") for name in os.listdir("/dev/shm"))


async def test_a_named_file_is_never_opened(daemon: Daemon, connect: Any,
                                            tmp_path: Path) -> None:
    """Protocol 1 named a /dev/shm segment: another job's, or any file the daemon could open."""
    victim = Path("/dev/shm") / f"victim-{os.getpid()}"  # not commd-*: the leak check is not ours
    victim.write_bytes(b"another job's gradients")
    try:
        before = victim.stat()
        client = connect()
        await client.ask(hello(coordinator=coordinator_of(daemon)))
        reply = await client.ask({**REGISTER, "shm_name": victim.name})
        assert reply["code"] == "invalid" and "shm_name is not accepted" in reply["message"]
        await client.send({"type": "goodbye"})
        await still_serving(connect())
        after = victim.stat()
        assert victim.read_bytes() == b"another job's gradients"
        assert (after.st_mtime_ns, after.st_size) == (before.st_mtime_ns, before.st_size)
    finally:
        victim.unlink()


@pytest.mark.parametrize("kind", ["file", "unsealed", "shrinkable"])
async def test_a_buffer_that_could_shrink_is_refused(daemon: Daemon, tmp_path: Path,
                                                     kind: str) -> None:
    if kind == "file":
        path = tmp_path / "plain"
        path.write_bytes(bytes(64))
        fd = os.open(path, os.O_RDWR)
    else:
        fd = os.memfd_create("commd-test", os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, 64)
        if kind == "shrinkable":
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_GROW)
    try:
        reply = await hand(daemon, TOKEN, [fd])
    finally:
        os.close(fd)
    assert b"F_SEAL_SHRINK" in reply, reply
    assert daemon._buffers.refused == 1 and daemon._buffers._pending == {}
    if kind == "file":
        assert (tmp_path / "plain").read_bytes() == bytes(64)


@pytest.mark.parametrize(("message", "count", "words"), [
    (TOKEN, 0, b"exactly one descriptor"),
    (TOKEN, 2, b"exactly one descriptor"),
    (b"short", 1, b"hex characters"),
    (TOKEN.upper(), 1, b"hex characters"),
])
async def test_a_malformed_hand_over_is_refused(daemon: Daemon, message: bytes, count: int,
                                                words: bytes) -> None:
    buffers = [HostBuffer("commd-test", 16) for _ in range(count)]
    try:
        reply = await hand(daemon, message, [b._fd for b in buffers])
    finally:
        for buffer in buffers:
            buffer.close()
    assert words in reply, reply
    assert daemon._buffers._pending == {}


async def test_a_sealed_buffer_cannot_be_truncated_and_other_jobs_go_on(
        daemon: Daemon, connect: Any, segments: Any) -> None:
    clients = [connect(), connect()]
    buffers = []
    for index, client in enumerate(clients):
        await client.ask(hello(job=f"j{index}", coordinator=coordinator_of(daemon)))
        buffers.append(await segments(16))
        reply = await client.ask({**REGISTER, "buffer_token": buffers[-1].token})
        assert reply["type"] == "registered", reply
    with pytest.raises(PermissionError):
        os.ftruncate(buffers[0]._fd, 0)  # the seal: the kernel refuses
    for index, client in enumerate(clients):
        buffer = memoryview(buffers[index].buf).cast("f")
        buffer[0] = 7.0
        await client.send({"type": "ready", "layers": [0]})
        done = await client.ask({"type": "wait", "iteration": 0})
        assert done["type"] == "done", done
        assert buffer[0] == 7.0


async def test_unclaimed_buffers_are_closed_and_capped(daemon: Daemon,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(daemon._buffers.pending_share, "cap",
                        shares.Cap("buffers waiting for their register", 2, 2, "register first"))
    buffers = [HostBuffer("commd-test", 16) for _ in range(3)]
    try:
        replies = [await hand(daemon, f"{index:032x}".encode(), [b._fd])
                   for index, b in enumerate(buffers)]
        assert replies[:2] == [OK, OK] and b"2 buffers waiting for their register" in replies[2]
        monkeypatch.setattr(handover, "CLAIM_S", 0.0)
        fds = [h.fd for h in daemon._buffers._pending.values()]
        assert daemon._buffers.claim("f" * 32) is None  # expires the unclaimed ones
        assert daemon._buffers._pending == {}
        for fd in fds:
            with pytest.raises(OSError):
                os.fstat(fd)  # closed
    finally:
        for buffer in buffers:
            buffer.close()


async def test_a_silent_hand_over_connection_is_closed(daemon: Daemon,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(handover, "CONNECTION_S", 0.05)

    def linger() -> bytes:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as link:
            link.settimeout(10)
            link.connect(buffer_socket_path(daemon.settings.socket))
            return link.recv(512)  # the daemon closes: EOF, not a hang

    assert await asyncio.to_thread(linger) == b""
    assert daemon._buffers._connections == {}


async def test_a_refused_register_keeps_the_buffer_for_a_corrected_one(
        daemon: Daemon, connect: Any, segments: Any) -> None:
    client = connect()
    await client.ask(hello(coordinator=coordinator_of(daemon)))
    buffer = await segments(16)
    reply = await client.ask({**REGISTER, "layers": [{"name": "w", "size": 8}],
                              "buffer_token": buffer.token})
    assert reply["code"] == "invalid" and "need 32 bytes" in reply["message"], reply
    reply = await client.ask({**REGISTER, "buffer_token": buffer.token})
    assert reply["type"] == "registered", reply
