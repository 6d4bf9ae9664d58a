"""A blocking ZeroMQ connection to the node's daemon, with loss detection."""

from __future__ import annotations

import itertools
import os
import threading
import time

import msgspec
import zmq

from commd_protocol import (
    CommdError,
    CommdTimeout,
    DaemonMessage,
    ErrorCode,
    ProtocolViolation,
    encode,
)
from commd_protocol.codec import daemon_codec

_POLL_SLICE_MS = 200
_MONITOR_IDS = itertools.count()  # how often a long wait re-checks for a lost daemon


class Connection:
    """DEALER socket to the daemon's ROUTER; a socket monitor reports a lost daemon."""

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        # A unique monitor endpoint: pyzmq's default is named after the socket's descriptor,
        # which the next client can reuse before zmq has released the old endpoint.
        address = f"inproc://commd-monitor-{os.getpid()}-{next(_MONITOR_IDS)}"
        self._monitor = self._socket.get_monitor_socket(zmq.EVENT_DISCONNECTED, addr=address)
        self._socket.connect(f"ipc://{socket_path}")
        self._lock = threading.Lock()  # sends may come from autograd threads
        self._connected_once = False
        self.lost = False

    def send(self, message: msgspec.Struct) -> None:
        with self._lock:
            self._socket.send(encode(message), copy=False)

    def receive(self, timeout_s: float | None, what: str) -> DaemonMessage:
        """The next message from the daemon, or CommdTimeout / CommdError if it is gone."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        while True:
            slice_ms = _POLL_SLICE_MS
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CommdTimeout(
                        f"commd: timed out after {timeout_s:g}s waiting for {what}; "
                        f"check that every rank is running and `commd status` on each node"
                    )
                slice_ms = min(slice_ms, max(1, int(left * 1000)))
            events = dict(poller.poll(slice_ms))
            if self._monitor in events:
                self._monitor.recv_multipart()
                self.lost = True
            if self._socket in events:
                frame = self._socket.recv(copy=True)
                try:
                    return daemon_codec.decode(frame)
                except ProtocolViolation as exc:
                    raise CommdError(
                        f"commd: the daemon sent a message this client cannot read ({exc}); "
                        "are client and daemon the same version?",
                        ErrorCode.VERSION,
                    ) from None
            if self.lost:
                raise CommdError(
                    f"commd: lost the connection to the daemon at {self.socket_path} "
                    f"while waiting for {what}; is `commd run` still running?",
                    ErrorCode.RANK_LOST,
                )

    def close(self) -> None:
        self._socket.disable_monitor()
        self._monitor.close(linger=0)
        self._socket.close(linger=0)
