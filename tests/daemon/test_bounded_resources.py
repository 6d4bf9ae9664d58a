"""Everything an outsider can make the daemon hold has a cap and a deadline: jobs that never
form, sessions that never register, forming jobs per coordinator and per peer, layers and
bytes per job, the size of a peer frame."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import msgpack
import pytest
import zmq
import zmq.asyncio

from commd.coordinator import coordinator as coordinator_module
from commd.daemon import shares
from commd.daemon.server import Daemon
from commd_protocol import PROTOCOL_VERSION

from inprocess import RawClient, coordinator_of, hello, peer_dealer, still_serving
from polling import until

DEADLINE_S = 1.0
WAIT_S = 90.0  # a wait on the daemon, inside the test's timeout: a hang is named


@pytest.fixture
def daemon_settings() -> dict[str, Any]:
    """The daemon of this module: every deadline is DEADLINE_S, small limits per job."""
    return {"timeout_s": DEADLINE_S, "max_layers": 3, "max_job_bytes": 64}


@pytest.fixture
async def peer(daemon: Daemon) -> AsyncIterator[zmq.asyncio.Socket]:
    context = zmq.asyncio.Context()
    sock = peer_dealer(context, daemon)  # a peer daemon: it holds the key
    yield sock
    sock.close(linger=0)
    context.term()


def join(job: str, ranks: list[int], world: int) -> bytes:
    return msgpack.packb({"type": "peer_join", "protocol": PROTOCOL_VERSION, "job": job,
                          "ranks": ranks, "world_size": world, "layers": [{"name": "w",
                          "size": 4}], "dtype": "float32", "op": "sum", "planner": "wfbp",
                          "host": "127.0.0.1"})


async def answer(sock: zmq.asyncio.Socket) -> dict[str, Any]:
    """The coordinator's next message but its every-2-s ``peer_status``."""
    while True:
        reply: dict[str, Any] = msgpack.unpackb(await asyncio.wait_for(sock.recv(), 10))
        if reply["type"] != "peer_status":
            return reply


REGISTER = {"type": "register", "dtype": "float32", "op": "sum", "planner": "wfbp"}


async def test_a_job_missing_a_local_rank_fails_in_time_naming_it(
        daemon: Daemon, connect: Any, segments: Any) -> None:
    client = connect()
    await client.ask(hello(world=2, local_world=2, coordinator=coordinator_of(daemon)))
    buffer = await segments(16)
    await client.send({**REGISTER, "layers": [{"name": "w", "size": 4}],
                       "buffer_token": buffer.token})
    reply = await client.receive()  # within the deadline, not the client's timeout
    assert reply["type"] == "error" and reply["code"] == "timeout", reply
    assert "did not form on this node within 1s" in reply["message"]
    assert "local ranks [0] registered" in reply["message"]
    assert "local ranks [1] never connected" in reply["message"]
    await until(lambda: daemon.status().jobs == [], "the job forgotten", WAIT_S)  # once told


async def test_a_session_that_never_registers_is_forgotten(daemon: Daemon,
                                                           connect: Any) -> None:
    client = connect()
    await client.ask(hello(coordinator=coordinator_of(daemon)))
    reply = await client.receive()
    assert reply["code"] == "timeout" and "said hello but did not register" in reply["message"]
    await until(lambda: daemon.status().jobs == [], "the job forgotten", WAIT_S)
    reply = await client.ask({"type": "wait", "iteration": 0})
    assert reply["code"] == "out_of_order" and "before hello" in reply["message"], reply
    await still_serving(client)


async def test_a_job_that_never_forms_on_the_coordinator_is_aborted(
        daemon: Daemon, peer: zmq.asyncio.Socket) -> None:
    await peer.send(join("half", [0], 2))
    reply = await answer(peer)
    assert reply["type"] == "peer_abort" and reply["code"] == "timeout", reply
    assert "did not form within 1s: ranks [0] of 2 joined" in reply["message"]
    assert daemon.status().coordinating == []


async def test_forming_jobs_per_peer_are_capped(daemon: Daemon, peer: zmq.asyncio.Socket,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(coordinator_module, "MAX_FORMING_PER_NODE", 2)
    for index in range(3):
        await peer.send(join(f"flood{index}", [0], 2))
    reply = await answer(peer)
    assert reply["type"] == "peer_abort" and reply["job"] == "flood2", reply
    assert reply["code"] == "limit" and "2 jobs forming" in reply["message"]
    assert sorted(j.job for j in daemon.status().coordinating) == ["flood0", "flood1"]


async def test_jobs_per_daemon_are_capped(daemon: Daemon, connect: Any,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(daemon._sessions.jobs_share, "cap", shares.Cap("jobs", 2, 2, "end some"))
    for index in range(2):
        assert (await connect().ask(hello(job=f"j{index}")))["type"] == "welcome"
    reply = await connect().ask(hello(job="j2"))
    assert reply["code"] == "limit" and "2 jobs" in reply["message"], reply
    assert sorted(j.job for j in daemon.status().jobs) == ["j0", "j1"]


@pytest.mark.parametrize(("layers", "words"), [
    ([{"name": f"l{i}", "size": 1} for i in range(4)], "limit of 3 (max_layers)"),
    ([{"name": "w", "size": 32}], "need 128 bytes, over this daemon's limit of 64"),
], ids=["layers", "bytes"])
async def test_layers_and_bytes_per_job_are_capped(
        daemon: Daemon, connect: Any, segments: Any, layers: list[Any], words: str) -> None:
    client = connect()
    await client.ask(hello(coordinator=coordinator_of(daemon)))
    buffer = await segments(128)
    reply = await client.ask({**REGISTER, "layers": layers, "buffer_token": buffer.token})
    assert reply["code"] == "limit" and words in reply["message"], reply


async def test_a_huge_peer_frame_is_cut_off_before_it_is_held(
        daemon: Daemon, peer: zmq.asyncio.Socket) -> None:
    await peer.send(b"\x00" * (5 << 20))  # over the peer frame cap: the connection drops
    context = zmq.asyncio.Context()
    fresh = peer_dealer(context, daemon)
    try:
        await fresh.send(join("after", [0], 1))
        assert (await answer(fresh))["type"] == "peer_setup"
    finally:
        fresh.close(linger=0)
        context.term()
    assert sum(daemon._peer_guard.counts.values()) == 0  # never decoded, so never refused


async def test_the_client_deadline_comes_from_the_daemon_not_the_client(
        daemon: Daemon, connect: Any) -> None:
    """A RawClient waits far longer than the deadline: what arrives is the daemon's."""
    client: RawClient = connect()
    await client.ask(hello(world=3, local_world=3, coordinator=coordinator_of(daemon)))
    started = asyncio.get_running_loop().time()
    reply = await client.receive()
    waited = asyncio.get_running_loop().time() - started
    assert reply["code"] == "timeout" and waited < 10 * DEADLINE_S, (waited, reply)
