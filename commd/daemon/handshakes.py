"""Every refused handshake on the peer port, counted by reason, from the ROUTER's socket monitor.

The ZAP check sees only one kind of stranger (a CurveZMQ client with another key); the others
never reach it. libzmq reports each kind on the socket's monitor:

- ``no_key``: spoke ZeroMQ without CurveZMQ (HANDSHAKE_FAILED_PROTOCOL, mechanism mismatch);
- ``wrong_server_key``: CurveZMQ to another server key (HANDSHAKE_FAILED_PROTOCOL,
  cryptographic);
- ``wrong_client_key``: CurveZMQ with a client key that is not the cluster's
  (HANDSHAKE_FAILED_AUTH, from the ZAP check);
- ``garbage``: anything else: raw TCP, a bad greeting, silence until it hung up (another
  failure, or a connection closed without any verdict).

A connection closed without a verdict is found by its descriptor: ACCEPTED and DISCONNECTED
carry it, the verdicts do not. A protocol failure is followed at once by its connection's
DISCONNECTED (libzmq sends both from one call on the context's single I/O thread); a success
or a ZAP refusal is matched to the oldest connection still in its handshake. When strangers
race, that match may pick the wrong one for a while; the totals come out right once they are
closed, and a refusal is never counted twice.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

log = logging.getLogger("commd.security")

REASONS = ("no_key", "wrong_server_key", "wrong_client_key", "garbage")
_EVENTS = (zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
           | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
           | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
_PROTOCOL_REASONS: dict[int, str] = {
    zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH: "no_key",
    zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC: "wrong_server_key",
}
_MONITOR_IDS = itertools.count()
_MONITOR_QUEUE = 100_000  # events (a few dozen bytes each) waiting to be read


class HandshakeCounts:
    """The counting itself, one monitor event at a time (no sockets: testable alone)."""

    def __init__(self) -> None:
        self.refused = dict.fromkeys(REASONS, 0)
        self._handshaking: dict[int, None] = {}  # descriptors without a verdict, oldest first
        self._failed = False  # the next DISCONNECTED is of a connection already counted

    @property
    def total(self) -> int:
        return sum(self.refused.values())

    def on_event(self, event: int, value: int) -> None:
        if event == zmq.EVENT_ACCEPTED:
            self._handshaking[value] = None
        elif event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            self._refuse(_PROTOCOL_REASONS.get(value, "garbage"))
            self._failed = True
        elif event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            self._refuse("garbage")
            self._failed = True
        elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            self._refuse("wrong_client_key")
            self._settle_oldest()
        elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._settle_oldest()
        elif event == zmq.EVENT_DISCONNECTED:
            self._closed(value)

    def _closed(self, descriptor: int) -> None:
        waiting = descriptor in self._handshaking
        self._handshaking.pop(descriptor, None)
        if self._failed:  # counted with its failure
            self._failed = False
            if not waiting:  # an earlier verdict was matched to it: it was another's
                self._settle_oldest()
        elif waiting:  # hung up (or was dropped) without any verdict
            self._refuse("garbage")

    def _settle_oldest(self) -> None:
        if self._handshaking:
            del self._handshaking[next(iter(self._handshaking))]

    def _refuse(self, reason: str) -> None:
        self.refused[reason] += 1
        total = self.total
        if total & (total - 1) == 0:  # 1, 2, 4, …: never a flood
            log.warning("refused %d peer handshake(s) in all (%s)", total, ", ".join(
                f"{name} {n}" for name, n in self.refused.items() if n))


class HandshakeWatch:
    """Reads the peer ROUTER's monitor on the daemon's loop and keeps ``HandshakeCounts``."""

    def __init__(self) -> None:
        self.counts = HandshakeCounts()
        # told the descriptor of every peer connection that closed (the daemon maps it to the
        # node that sent on it: a peer daemon that died, for its tolerant jobs)
        self.on_disconnect: Callable[[int], None] | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._watched: zmq.asyncio.Socket | None = None

    def start(self, socket: zmq.asyncio.Socket) -> None:
        """Watch ``socket`` (before it binds, so no connection is missed)."""
        # A unique endpoint: pyzmq's default is named after the descriptor, which a daemon
        # started again in this process could reuse before zmq has let the old one go.
        address = f"inproc://commd-peer-monitor-{next(_MONITOR_IDS)}-{id(self):x}"
        socket.monitor(address, _EVENTS)
        monitor = socket.context.socket(zmq.PAIR)
        # libzmq drops events it cannot queue: room for a flood of strangers between reads
        monitor.rcvhwm = _MONITOR_QUEUE
        monitor.connect(address)
        self._monitor = monitor
        self._watched = socket
        self._task = asyncio.get_running_loop().create_task(self._read(self._monitor),
                                                            name="commd-handshakes")

    async def _read(self, monitor: zmq.asyncio.Socket) -> None:
        while True:
            frames: list[Any] = await monitor.recv_multipart()
            try:
                message = parse_monitor_message(frames)
            except (ValueError, TypeError, IndexError):  # never from libzmq; never fatal
                continue
            event, value = int(message["event"]), int(message["value"])
            self.counts.on_event(event, value)
            if event == zmq.EVENT_DISCONNECTED and self.on_disconnect is not None:
                self.on_disconnect(value)

    @property
    def refused(self) -> dict[str, int]:
        return dict(self.counts.refused)

    @property
    def total(self) -> int:
        return self.counts.total

    async def close(self) -> None:
        """Stop reading and close the monitor (before the watched socket closes)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._watched is not None and not self._watched.closed:
            self._watched.disable_monitor()
        if self._monitor is not None:
            self._monitor.close(linger=0)
            self._monitor = None
