"""What other daemons reach: the peer ROUTER socket, and the coordinator of the jobs formed
here, which every message on it is for (messages for this node's own jobs come back on the
links it opened to their coordinators: ``peer_links``, ``job_messages``)."""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio

from commd.coordinator.coordinator import Coordinator
from commd.coordinator.validation import NOT_FOR_A_COORDINATOR
from commd.daemon.client_side import ignore_result
from commd.daemon.guard import Guard, serve
from commd_protocol import ProtocolViolation, encode
from commd_protocol.codec import frame_tag, peer_codec

__all__ = ["PeerSide"]

SendNode = Callable[[bytes, msgspec.Struct], None]


class PeerSide:
    """The peer socket and the coordinator it feeds. It knows which TCP connection each node
    sends on, so a connection that closes (its daemon died) reaches the coordinator as that
    node's."""

    def __init__(self, guard: Guard, coordinator_for: Callable[[SendNode], Coordinator]) -> None:
        self.guard = guard
        self.socket: zmq.asyncio.Socket | None = None
        self.coordinator = coordinator_for(self.send)
        self._connections: dict[int, bytes] = {}  # descriptor -> the node sending on it

    def send(self, node: bytes, message: msgspec.Struct) -> None:
        if self.socket is not None:
            future = self.socket.send_multipart([node, encode(message)])
            future.add_done_callback(ignore_result)  # type: ignore[attr-defined]

    async def serve(self) -> None:
        peers = self.socket
        assert peers is not None
        await serve(self.guard, lambda: peers.recv_multipart(copy=False), self._on_frames)

    def _on_frames(self, frames: list[zmq.Frame]) -> None:
        if len(frames) != 2:
            self.guard.refused("peer message of several frames", f"{len(frames)} frames")
            return
        node, frame = frames[0].bytes, frames[1].bytes
        self._note_connection(node, frames[1])
        if frame_tag(frame) in NOT_FOR_A_COORDINATOR:  # before the body is decoded
            self.guard.refused("bad peer message (not for a coordinator)",
                               f"{len(frame)} bytes")
            return
        try:
            message = peer_codec.decode(frame)
        except ProtocolViolation as exc:
            self.guard.refused(f"bad peer message ({exc.code})", exc)
            return
        self.coordinator.on_message(node, message)

    def _note_connection(self, node: bytes, frame: zmq.Frame) -> None:
        """Which TCP connection ``node`` sends on: its close is then known for whom."""
        try:
            descriptor = int(frame.get(zmq.SRCFD))
        except (zmq.ZMQError, AttributeError, TypeError, ValueError):
            return
        if self._connections.get(descriptor) != node:
            self._connections[descriptor] = node

    def connection_closed(self, descriptor: int) -> None:
        """A peer daemon's connection closed: a process that exits closes its connections,
        so the coordinator may take that node as crashed (a network split closes nothing)."""
        node = self._connections.pop(descriptor, None)
        if node is not None and node not in self._connections.values():
            self.coordinator.node_closed(node)

    def close(self, linger_ms: int) -> None:
        """The coordinator's jobs end here; the socket closes (the last replies leave within
        ``linger_ms``)."""
        self.coordinator.close()
        if self.socket is not None:
            self.socket.close(linger=linger_ms)
