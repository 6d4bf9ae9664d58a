"""Frames that used to stop a message loop for good: each gets a typed error or is dropped,
and both loops go on serving. The daemon runs in-process; clients and peers are raw sockets."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from typing import Any

import msgpack
import pytest
import zmq
import zmq.asyncio

from commd.daemon import sdnotify
from commd.daemon.server import Daemon
from commd_client.host_buffer import HostBuffer
from commd_protocol import PROTOCOL_VERSION

from inprocess import RawClient, hello, peer_dealer, register_job, still_serving
from polling import until

# ~1 kB frames nested 1000 deep: a bare array, and one inside a message's field.
NESTED = [b"\x91" * 1000 + b"\xc0", b"\x82\xa4type\xa5hello\xa3job" + b"\x91" * 1000 + b"\xc0"]


class RawPeer:
    """A peer daemon's DEALER, speaking raw MessagePack to the daemon's peer port."""

    def __init__(self, context: zmq.asyncio.Context, daemon: Daemon) -> None:
        self.socket = peer_dealer(context, daemon)  # with the daemon's key

    async def send(self, message: dict[str, Any] | bytes) -> None:
        await self.socket.send(message if isinstance(message, bytes) else msgpack.packb(message))

    async def receive(self) -> dict[str, Any]:
        """The coordinator's next message but its every-2-s ``peer_status``."""
        while True:
            reply: dict[str, Any] = msgpack.unpackb(
                await asyncio.wait_for(self.socket.recv(), 10))
            if reply["type"] != "peer_status":
                return reply


@pytest.fixture
async def peer(daemon: Daemon) -> AsyncIterator[RawPeer]:
    context = zmq.asyncio.Context()
    raw = RawPeer(context, daemon)
    yield raw
    raw.socket.close(linger=0)
    context.term()


def join(job: str = "pj", **fields: Any) -> dict[str, Any]:
    return {"type": "peer_join", "protocol": PROTOCOL_VERSION, "job": job, "ranks": [0],
            "world_size": 1, "layers": [{"name": "w", "size": 4}], "dtype": "float32",
            "op": "sum", "planner": "wfbp", "host": "127.0.0.1", **fields}


async def a_job_still_forms(daemon: Daemon, client: RawClient, job: str) -> None:
    """A one-rank job coordinated by this daemon: its join travels through the peer loop."""
    buffer = HostBuffer(f"commd-test-{job}", 16)
    try:
        reply = await register_job(daemon, client, buffer, job, [{"name": "w", "size": 4}])
        assert reply["type"] == "registered", reply
        await client.send({"type": "goodbye"})
    finally:
        buffer.close()


@pytest.mark.parametrize("frame", NESTED, ids=["array", "in-a-field"])
async def test_a_deeply_nested_client_frame_gets_a_typed_error(connect: Any, frame: bytes) -> None:
    client = connect()
    reply = await client.ask(frame)
    assert reply["type"] == "error" and reply["code"] == "malformed", reply
    assert reply["message"] == "commd: message is nested too deeply"
    await still_serving(client)


async def test_bad_peer_frames_are_dropped_and_the_peer_loop_goes_on(
        daemon: Daemon, peer: RawPeer, connect: Any) -> None:
    for frame in [*NESTED, b"\xc1garbage", msgpack.packb({"type": "peer_nonsense"}),
                  msgpack.packb({"type": "peer_leave"})]:
        await peer.send(frame)
    await peer.socket.send_multipart([b"one", b"two"])
    await a_job_still_forms(daemon, connect(), "after-bad-peer-frames")
    counts = daemon._peer_guard.counts
    assert counts["bad peer message (malformed)"] == 4, counts  # 2 nested, garbage, no job
    assert counts["bad peer message (unknown_type)"] == 1, counts
    assert counts["peer message of several frames"] == 1, counts
    assert daemon._loops_alive()


@pytest.mark.parametrize(("fields", "words"), [
    ({"ranks": []}, "at least one rank"),
    ({"ranks": [0, 0], "world_size": 2}, "name a rank twice"),
    ({"ranks": [5]}, "outside world size 1"),
    ({"compression": "zip:9"}, "compression"),
    ({"compression": "topk:auto:momentum=1.5"}, "momentum must be in [0, 1)"),
    ({"planner": "magic"}, "optimal"),
    ({"layers": []}, "at least one layer"),
    ({"layers": [{"name": "w", "size": 0}]}, "must be > 0"),
    ({"layers": [{"name": "w", "size": 1}, {"name": "w", "size": 2}]}, "used twice"),
    ({"dtype": "int8"}, "dtype"),
    ({"job": "bad id!"}, "job id"),
    ({"host": ""}, "engine address"),
    ({"protocol": PROTOCOL_VERSION + 1}, "protocol version"),
], ids=lambda value: str(value)[:30])
async def test_a_bad_join_is_refused_to_its_sender_and_nothing_else_changes(
        daemon: Daemon, peer: RawPeer, connect: Any,
        fields: dict[str, Any], words: str) -> None:
    await peer.send(join(**fields))
    reply = await peer.receive()
    assert reply["type"] == "peer_abort" and reply["code"] == "invalid", reply
    assert "refused this node's join" in reply["message"] and words in reply["message"], reply
    assert daemon.status().coordinating == []
    await a_job_still_forms(daemon, connect(), "after-a-bad-join")


@pytest.mark.parametrize("report", [
    {"comm": [[0, 0, 100]]},
    {"comm": [[0, 0, 100, float("nan")]]},
    {"comm": [[0, 0, 100, 0.1, 7]]},
    {"ready_offsets_s": [0.0, 0.1, 0.2]},
    {"gains": [[0.5]]},
    {"gains": [[2.0, 1.0]]},
    {"gains": [[0.1, 0.5]] * 10_000},  # a flood of rows
    {"step_s": -1.0},
    {"cpu_s_per_element": [1e-9, 1e-9]},
    {"cpu_s_per_element": [float("nan"), 1e-9, 0.0]},
    {"cpu_s_per_element": [-1e-9, 1e-9, 0.0]},
    {"cpu_s_per_element": [1e-9, 5.0, 0.0]},
    {"cpu_s_per_element": [1e-9, 1e-9, 1e9]},
], ids=lambda value: str(value)[:30])
async def test_a_malformed_report_fails_its_job_only(
        daemon: Daemon, peer: RawPeer, connect: Any,
        report: dict[str, Any]) -> None:
    await peer.send(join())
    assert (await peer.receive())["type"] == "peer_setup"
    await peer.send({"type": "peer_profile", "job": "pj", "round": 0, "iteration": -1, **report})
    reply = await peer.receive()
    if reply["type"] != "peer_abort":  # a report of the wrong shape never reaches the job
        pytest.fail(f"expected the job to be aborted, got {reply}")
    assert reply["code"] == "invalid" and "report is refused" in reply["message"], reply
    assert daemon.status().coordinating == []
    await a_job_still_forms(daemon, connect(), "after-a-bad-report")


async def test_a_decode_failure_of_a_report_row_is_a_dropped_frame(
        daemon: Daemon, peer: RawPeer) -> None:
    """Rows of strings do not even decode: the frame is dropped, the job goes on."""
    await peer.send(join())
    assert (await peer.receive())["type"] == "peer_setup"
    await peer.send({"type": "peer_profile", "job": "pj", "round": 0, "iteration": -1,
                     "comm": [["a", "b"]]})
    await peer.send({"type": "peer_profile", "job": "pj", "round": 0, "iteration": -1})
    reply = await peer.receive()
    assert reply["type"] == "peer_plan" and reply["round"] == 0, reply


async def test_an_unexpected_exception_is_logged_and_the_loops_go_on(
        daemon: Daemon, peer: RawPeer, connect: Any,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    coordinator, sessions = daemon._coordinator, daemon._sessions
    real_message, real_frames = coordinator.on_message, sessions.on_frames
    failures = {"peer": 1, "client": 1}

    def flaky_message(node: bytes, message: Any) -> None:
        if failures["peer"]:
            failures["peer"] -= 1
            raise RuntimeError("a bug in the coordinator")
        real_message(node, message)

    def flaky_frames(frames: list[bytes]) -> None:
        if failures["client"]:
            failures["client"] -= 1
            raise RuntimeError("a bug in the sessions")
        real_frames(frames)

    monkeypatch.setattr(coordinator, "on_message", flaky_message)
    monkeypatch.setattr(sessions, "on_frames", flaky_frames)
    client = connect()
    await client.send({"type": "status"})  # lost to the bug
    await peer.send(join())  # lost to the bug
    await still_serving(client)
    # The raw peer's frame must be the one the bug eats: on a loaded machine its connection may
    # come up after the daemon's own link, whose join would then be lost instead.
    await until(lambda: failures["peer"] == 0, "the raw peer's frame lost to the bug",
                timeout_s=20)
    await a_job_still_forms(daemon, client, "after-a-bug")
    assert daemon._client_guard.counts["RuntimeError in a client frame"] == 1
    assert daemon._peer_guard.counts["RuntimeError in handling a frame"] == 1
    assert "a bug in the coordinator" in caplog.text and "Traceback" in caplog.text
    assert daemon._loops_alive()


async def test_the_watchdog_stops_for_good_when_a_loop_has_ended(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify:
        notify.bind(str(tmp_path / "n"))
        notify.setblocking(False)
        monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "n"))
        alive = [True, True, False]  # two pings, then a loop is found dead
        await asyncio.wait_for(
            sdnotify.watchdog_loop(interval=0.02, alive=lambda: alive.pop(0)), timeout=10)
        pings = []
        while True:
            try:
                pings.append(notify.recv(64))
            except BlockingIOError:
                break
        assert pings == [b"WATCHDOG=1", b"WATCHDOG=1"]


async def test_two_ranks_with_one_local_rank_fail_the_forming_job_naming_both(
        connect: Any) -> None:
    first, second = connect(), connect()
    assert (await first.ask(hello(job="twins", world=2, local_world=2)))["type"] == "welcome"
    reply = await second.ask(hello(job="twins", rank=1, world=2, local_world=2, pid=4242))
    assert reply["code"] == "mismatch" and "already connected" in reply["message"], reply
    assert "rank 0" in reply["message"] and "rank 1 (pid 4242)" in reply["message"], reply
    told = await first.receive()  # the rank already here learns at once, not at a timeout
    assert told["type"] == "error" and told["fatal"] and told["message"] == reply["message"]


@pytest.mark.parametrize(("second", "words"), [
    ({"rank": 0, "local": 1}, "check RANK"),
    ({"rank": 1, "local": 1, "world": 3}, "world_size=3"),
], ids=["same-rank", "world-size"])
async def test_a_contradicting_rank_fails_the_forming_job_at_once(
        connect: Any, second: dict[str, Any], words: str) -> None:
    first, other = connect(), connect()
    assert (await first.ask(hello(job="pair", world=2, local_world=2)))["type"] == "welcome"
    fields = {"world": 2, "local_world": 2, **second}
    reply = await other.ask(hello(job="pair", **fields))
    assert reply["code"] == "mismatch" and words in reply["message"], reply
    assert (await first.receive())["message"] == reply["message"]
