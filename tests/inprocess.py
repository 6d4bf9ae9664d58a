"""Talking to an in-process daemon over its real ipc socket with raw MessagePack frames, as
a client in another language would (the fixtures are in conftest.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from commd.daemon.server import Daemon
from commd_protocol import PROTOCOL_VERSION


class RawClient:
    def __init__(self, context: zmq.asyncio.Context, path: str) -> None:
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(f"ipc://{path}")

    async def send(self, message: dict[str, Any] | bytes) -> None:
        await self.socket.send(message if isinstance(message, bytes) else msgpack.packb(message))

    async def receive(self) -> dict[str, Any]:
        frame = await asyncio.wait_for(self.socket.recv(), 10)
        reply: dict[str, Any] = msgpack.unpackb(frame)
        return reply

    async def ask(self, message: dict[str, Any] | bytes) -> dict[str, Any]:
        await self.send(message)
        return await self.receive()


def hello(job: str = "j", rank: int = 0, world: int = 1, local: int = 0, local_world: int = 1,
          **extra: Any) -> dict[str, Any]:
    return {"type": "hello", "protocol": PROTOCOL_VERSION, "job": job, "rank": rank,
            "world_size": world, "local_rank": local, "local_world_size": local_world,
            "coordinator": extra.pop("coordinator", "127.0.0.1:1"), **extra}


def coordinator_of(daemon: Daemon) -> str:
    return f"127.0.0.1:{daemon.peer_port}"


async def still_serving(client: RawClient) -> None:
    reply = await client.ask({"type": "status"})
    assert reply["type"] == "status_reply" and reply["status"]["backend"] == "gloo"
