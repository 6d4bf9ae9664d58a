"""Talking to an in-process daemon over its real ipc socket with raw MessagePack frames, as
a client in another language would (the fixtures are in conftest.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from commd.daemon.server import Daemon
from commd.testing.peers import connect_peer
from commd_client.host_buffer import HostBuffer
from commd_protocol import PROTOCOL_VERSION
from commd_protocol.handover import buffer_socket_path


class RawClient:
    def __init__(self, context: zmq.asyncio.Context, path: str) -> None:
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(f"ipc://{path}")

    async def send(self, message: dict[str, Any] | bytes) -> None:
        await self.socket.send(message if isinstance(message, bytes) else msgpack.packb(message))

    async def receive(self, progress: bool = False) -> dict[str, Any]:
        """The next message; ``progress`` messages (every 2 s to a waiting rank) are skipped
        unless asked for, as a client does."""
        while True:
            frame = await asyncio.wait_for(self.socket.recv(), 10)
            reply: dict[str, Any] = msgpack.unpackb(frame)
            if progress or reply.get("type") != "progress":
                return reply

    async def ask(self, message: dict[str, Any] | bytes) -> dict[str, Any]:
        await self.send(message)
        return await self.receive()


def hello(job: str = "j", rank: int = 0, world: int = 1, local: int = 0, local_world: int = 1,
          **extra: Any) -> dict[str, Any]:
    return {"type": "hello", "protocol": PROTOCOL_VERSION, "job": job, "rank": rank,
            "world_size": world, "local_rank": local, "local_world_size": local_world,
            "coordinator": extra.pop("coordinator", "127.0.0.1:1"), **extra}


def peer_dealer(context: zmq.asyncio.Context, daemon: Daemon) -> zmq.asyncio.Socket:
    """A DEALER on the in-process daemon's peer port that holds its key (the local key beside
    its socket, or its --cluster-key), as a peer daemon's link to it does."""
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    connect_peer(sock, daemon.peer_port, daemon._links.key)
    return sock


def coordinator_of(daemon: Daemon) -> str:
    return f"127.0.0.1:{daemon.peer_port}"


async def still_serving(client: RawClient) -> None:
    reply = await client.ask({"type": "status"})
    assert reply["type"] == "status_reply" and reply["status"]["backend"] == "gloo"


async def hand_over(daemon: Daemon, buffer: HostBuffer) -> str:
    """``buffer`` handed to the in-process daemon, as a client does it; its token. In a thread:
    the daemon answers on this test's loop."""
    path = buffer_socket_path(daemon.settings.socket)
    return await asyncio.to_thread(buffer.hand_over, path, 10.0)


async def register_job(daemon: Daemon, client: RawClient, buffer: HostBuffer, job: str,
                       layers: list[dict[str, Any]]) -> dict[str, Any]:
    """A one-rank job coordinated by ``daemon`` (its join crosses the peer loop): hello, the
    buffer handed over, register. The reply to register."""
    welcome = await client.ask(hello(job=job, coordinator=coordinator_of(daemon)))
    assert welcome["type"] == "welcome", welcome
    token = await hand_over(daemon, buffer)
    return await client.ask({"type": "register", "dtype": "float32", "op": "sum",
                             "planner": "wfbp", "buffer_token": token, "layers": layers})
