"""A blocking ZeroMQ connection to the node's daemon, with loss detection."""

from __future__ import annotations

import itertools
import logging
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
from commd_protocol.messages import Progress
from commd_protocol.reach import unreachable

_POLL_SLICE_MS = 200
# The daemon sends a waiting rank a ``progress`` every 2 s: this much silence means it stopped.
DAEMON_SILENCE_S = 10.0
PROGRESS_EVERY_S = 10.0  # how often a long wait logs what it waits for

log = logging.getLogger("commd_client")
_MONITOR_IDS = itertools.count()  # how often a long wait re-checks for a lost daemon


class Connection:
    """DEALER socket to the daemon's ROUTER; a socket monitor reports a lost daemon."""

    def __init__(self, socket_path: str) -> None:
        # At once, not after a hello timeout; permission denied would look like a silent daemon.
        problem = unreachable(socket_path, "is `commd run` running there? (COMMD_SOCKET names "
                              "another path)")
        if problem:
            raise CommdError(problem, ErrorCode.RANK_LOST)
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
        self._progress = ProgressLog()

    def send(self, message: msgspec.Struct) -> None:
        with self._lock:
            self._socket.send(encode(message), copy=False)

    def receive(self, timeout_s: float | None, what: str) -> DaemonMessage:
        """The next message from the daemon but a ``progress`` (logged, and proof that the
        daemon lives), or CommdTimeout / CommdError if it is gone or silent."""
        started = time.monotonic()
        deadline = None if timeout_s is None else started + timeout_s
        heard, culprit = started, ""
        while True:
            message = self._next(deadline, timeout_s, what, heard, culprit)
            if not isinstance(message, Progress):
                return message
            heard = time.monotonic()
            # the last word on whom the job waits for (a stall's, from a daemon without it)
            culprit = message.waiting_for or message.stall
            self._progress.show(message, heard - started)

    def _next(self, deadline: float | None, timeout_s: float | None, what: str,
              heard: float, culprit: str = "") -> DaemonMessage:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        while True:
            slice_ms = _POLL_SLICE_MS
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0 and culprit:
                    raise CommdTimeout(
                        f"commd: timed out after {timeout_s:g}s waiting for {what}: {culprit}")
                if left <= 0:
                    raise CommdTimeout(
                        f"commd: timed out after {timeout_s:g}s waiting for {what}; "
                        f"check that every rank is running and `commd status` on each node"
                    )
                slice_ms = min(slice_ms, max(1, int(left * 1000)))
            if time.monotonic() - heard > DAEMON_SILENCE_S:
                raise CommdError(
                    f"commd: the daemon at {self.socket_path} has sent nothing for "
                    f"{DAEMON_SILENCE_S:g}s while this rank waits for {what}: it is stopped "
                    "or hung (check `commd status` and its log)", ErrorCode.RANK_LOST)
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


class ProgressLog:
    """What a waiting rank logs of the daemon's ``progress``: a stall once (a warning through
    Python logging), and what it waits for every PROGRESS_EVERY_S once it waits that long."""

    def __init__(self) -> None:
        self._stall = ""
        self._shown_at = 0.0

    def show(self, progress: Progress, waited_s: float) -> None:
        if progress.stall and progress.stall != self._stall:
            log.warning("%s", progress.stall)
        self._stall = progress.stall
        now = time.monotonic()
        if waited_s >= PROGRESS_EVERY_S and now - self._shown_at >= PROGRESS_EVERY_S:
            self._shown_at = now
            log.warning("%s (waiting %.0fs)", progress.message, waited_s)
