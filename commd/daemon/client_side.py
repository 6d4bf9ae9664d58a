"""The training processes' side of the daemon: the ipc ROUTER socket, its receive loop into
the client sessions (``sessions``), and the replies back."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable
from typing import Protocol

import msgspec
import zmq
import zmq.asyncio

from commd.daemon.guard import Guard, serve
from commd.daemon.sockets import bind_clients
from commd_protocol import Error, encode

__all__ = ["ClientSide", "ignore_result"]

_DRAIN_BATCH = 1024  # messages handled per wake-up before yielding to the loop


class FrameHandler(Protocol):
    """Where the clients' messages go (``ClientSessions``)."""

    def on_frames(self, frames: list[zmq.Frame]) -> None: ...


class ClientSide:
    """The clients' socket: bound at ``path``, frames handed to the sessions, replies sent."""

    def __init__(self, guard: Guard) -> None:
        self.guard = guard
        self.socket: zmq.asyncio.Socket | None = None
        self._path = ""
        # Every Error sent to a client, by code (the metrics count them; None: off).
        self.on_error: Callable[[str], None] | None = None

    def bind(self, context: zmq.asyncio.Context, path: str) -> None:
        self.socket = bind_clients(context, path)
        self._path = path

    async def serve(self, sessions: FrameHandler) -> None:
        """Receive until cancelled, each message handed to ``sessions.on_frames`` (looked up
        per message: whatever handles frames now)."""
        clients = self.socket
        assert clients is not None
        # A blocking view of the same socket: after each awaited receive, what is already
        # queued (161 ready notifications of a backward pass) is handled without an await
        # per message (~60 µs each).
        queued: zmq.Socket[bytes] = zmq.Socket.shadow(clients.underlying)

        # Frames, not bytes (copy=False): a frame's Peer-Address is the kernel's word on the
        # sender's uid, for its user's fair share (sessions, shares).
        def handle(frames: list[zmq.Frame]) -> None:
            self.guard.call("a client frame", sessions.on_frames, frames)
            for _ in range(_DRAIN_BATCH):
                try:
                    more = queued.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self.guard.call("a client frame", sessions.on_frames, more)

        await serve(self.guard, lambda: clients.recv_multipart(copy=False), handle)

    def send(self, identity: bytes, message: msgspec.Struct) -> None:
        if self.socket is None:
            return
        future = self.socket.send_multipart([identity, encode(message)])
        future.add_done_callback(ignore_result)  # type: ignore[attr-defined]
        if self.on_error is not None and isinstance(message, Error):
            self.on_error(message.code)

    def close(self, linger_ms: int) -> None:
        """Close the socket (the last replies leave within ``linger_ms``) and remove its
        file, ours only if we bound it."""
        if self.socket is None:
            return
        self.socket.close(linger=linger_ms)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path)


def ignore_result(future: asyncio.Future[object]) -> None:
    """A send's outcome is not awaited: read it so that asyncio does not log it."""
    if not future.cancelled():
        future.exception()

