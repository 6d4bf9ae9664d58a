"""The worst frame per message type, timed: how long one frame holds a real daemon's loop.

Run through ``bench/fuzz.py --worst`` (docs/reliability.md). For every client and peer message
type it builds the frames that type makes most costly within the 4 MiB cap (the largest, the
most duplicated, the deepest, or the largest the daemon's limits accept, inside a running
job where that is where it costs most), sends each to a real `commd run` daemon and measures
how long the daemon's event loop was blocked:

    a prober sends ``status`` on its own ipc connection, one after the other, from just
    before the frame is sent until the daemon has had ``--window`` seconds with it; the
    blocking time is the longest of those round trips minus the median round trip of 30
    probes right before (the loop answers a probe only between two callbacks, so a probe
    that waits behind the frame's handling takes as long as that handling).

Every frame's replies must be typed (a daemon message; an error with a known code and a
"commd: " message); the check fails when any frame blocks longer than ``--limit-ms``.
"""

from __future__ import annotations

import statistics
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import zmq

from commd.daemon.peer_security import ClusterKey, connect_securely
from commd.testing.daemons import LocalDaemon
from commd_client.host_buffer import HostBuffer
from commd_protocol import PROTOCOL_VERSION, ErrorCode, ProtocolViolation
from commd_protocol.codec import MAX_MESSAGE_BYTES, daemon_codec, peer_codec
from commd_protocol.handover import buffer_socket_path
from commd_protocol.limits import MAX_COUNT, MAX_LOCAL_RANKS, MAX_RANKS

CODES = {code.value for code in ErrorCode}
ROOM = MAX_MESSAGE_BYTES - 4096  # what a worst frame fills: the cap, less its other fields
SMALL_LAYERS = [{"name": f"l{i}", "size": 4} for i in range(4)]
PROBES = 30


@dataclass
class Row:
    side: str  # "ipc" or "peer"
    type: str
    frame: str  # what the frame was, in words
    size: int  # bytes
    blocked_ms: float = 0.0
    replies: list[str] = field(default_factory=list)
    untyped: int = 0


def packed(message: dict[str, Any]) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def fill(message: dict[str, Any], key: str, unit: Callable[[int], Any]) -> dict[str, Any]:
    """``message`` with ``key`` a list of as many ``unit(i)`` as fit in ROOM."""
    unit_bytes = max(len(packed(unit(0))), len(packed(unit(10**6))))
    count = (ROOM - len(packed(message))) // unit_bytes
    return {**message, key: [unit(i) for i in range(count)]}


def deep(depth: int) -> bytes:
    """An array nested ``depth`` deep (MessagePack), for an unknown field."""
    return b"\x91" * depth + b"\xc0"


def with_raw(message: dict[str, Any], key: str, raw: bytes) -> bytes:
    """``message`` with an extra field ``key`` whose value is the raw MessagePack ``raw``."""
    head = packed(message)
    count = head[0] & 0x0F if head[0] & 0xF0 == 0x80 else None
    assert count is not None and count < 15, "a small map"
    return bytes([0x80 | (count + 1)]) + head[1:] + packed(key) + raw  # type: ignore[arg-type]


def hello(job: str, coordinator: str, **extra: Any) -> dict[str, Any]:
    return {"type": "hello", "protocol": PROTOCOL_VERSION, "job": job, "rank": 0,
            "world_size": 1, "local_rank": 0, "local_world_size": 1,
            "coordinator": coordinator, **extra}


def peer_join(job: str, layers: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"type": "peer_join", "protocol": PROTOCOL_VERSION, "job": job, "ranks": [0],
            "world_size": 1, "layers": layers, "dtype": "float32", "op": "sum",
            "planner": "optimal", "host": "127.0.0.1", **extra}


def unique_layers(count: int, fill_bytes: int) -> list[dict[str, Any]]:
    """``count`` layers whose distinct names fill about ``fill_bytes`` (each at most 1024)."""
    width = max(8, min(1000, fill_bytes // max(count, 1) - 16))
    return [{"name": f"{i:08d}".ljust(width, "x"), "size": 1} for i in range(count)]


class Prober:
    """``status`` round trips on its own ipc connection."""

    def __init__(self, context: zmq.Context[Any], path: str) -> None:
        self.sock = context.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"ipc://{path}")
        self.frame = packed({"type": "status"})

    def rtt(self, timeout_s: float) -> float:
        started = time.perf_counter()
        self.sock.send(self.frame)
        while True:
            if not self.sock.poll(int(timeout_s * 1000)):
                raise TimeoutError(f"status not answered within {timeout_s:g}s")
            if msgpack.unpackb(self.sock.recv()).get("type") == "status_reply":
                return time.perf_counter() - started

    def baseline(self, timeout_s: float) -> float:
        return statistics.median(self.rtt(timeout_s) for _ in range(PROBES))

    def close(self) -> None:
        self.sock.close(linger=0)


class Worst:
    """The worst frames against one daemon, each timed by a ``Prober``."""

    def __init__(self, daemon: LocalDaemon, context: zmq.Context[Any], max_layers: int,
                 window_s: float, timeout_s: float, key_dir: Path) -> None:
        self.daemon, self.context = daemon, context
        self.max_layers, self.window_s, self.timeout_s = max_layers, window_s, timeout_s
        self.key_dir = key_dir
        self.prober = Prober(context, daemon.socket)
        self.rows: list[Row] = []
        self._buffers: list[HostBuffer] = []
        self._sockets: list[zmq.Socket[Any]] = []
        self._jobs = 0

    # --- sockets ---------------------------------------------------------------------------

    def ipc(self) -> zmq.Socket[Any]:
        sock = self.context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"ipc://{self.daemon.socket}")
        self._sockets.append(sock)
        return sock

    def peer(self) -> zmq.Socket[Any]:
        """A peer daemon's DEALER, with the cluster key beside the daemon's socket when there
        is one (the automatic local key of an unkeyed daemon)."""
        sock = self.context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        key = self.key_dir / "cluster.key"
        if key.exists():
            pair = tomllib.loads(key.read_text())
            connect_securely(sock, ClusterKey(pair["public"].encode(), pair["secret"].encode()))
        sock.connect(f"tcp://{self.daemon.address}")
        self._sockets.append(sock)
        return sock

    def ask(self, sock: zmq.Socket[Any], message: dict[str, Any], want: str) -> dict[str, Any]:
        sock.send(packed(message))
        while True:
            if not sock.poll(int(self.timeout_s * 1000)):
                raise TimeoutError(f"no {want} within {self.timeout_s:g}s")
            reply: dict[str, Any] = msgpack.unpackb(sock.recv())
            if reply.get("type") == want:
                return reply
            if reply.get("type") not in ("progress", "peer_status"):
                raise RuntimeError(f"{message['type']} got {reply}")

    def running_rank(self, layers: list[dict[str, Any]]) -> zmq.Socket[Any]:
        """A one-rank job this daemon coordinates, registered with a real buffer."""
        self._jobs += 1
        job = f"worst-{self._jobs}"
        sock = self.ipc()
        self.ask(sock, hello(job, self.daemon.address), "welcome")
        total = sum(layer["size"] for layer in layers)
        buffer = HostBuffer(f"commd-worst-{self._jobs}", 4 * total)
        self._buffers.append(buffer)
        token = buffer.hand_over(buffer_socket_path(self.daemon.socket), self.timeout_s)
        self.ask(sock, {"type": "register", "dtype": "float32", "op": "sum",
                        "planner": "optimal", "buffer_token": token, "layers": layers},
                 "registered")
        return sock

    # --- one timed frame -------------------------------------------------------------------

    def timed(self, side: str, kind: str, what: str, sock: zmq.Socket[Any], frame: bytes) -> Row:
        row = Row(side, kind, what, len(frame))
        assert len(frame) <= MAX_MESSAGE_BYTES, (kind, what, len(frame))
        base = self.prober.baseline(self.timeout_s)
        worst = 0.0
        sock.send(frame)
        started = time.perf_counter()
        while time.perf_counter() - started < self.window_s:
            worst = max(worst, self.prober.rtt(self.timeout_s))
        row.blocked_ms = max(0.0, worst - base) * 1000
        while sock.poll(0):  # whatever came back: typed?
            self._classify(row, side, sock.recv())
        self.rows.append(row)
        return row

    def _classify(self, row: Row, side: str, frame: bytes) -> None:
        try:
            message = (daemon_codec if side == "ipc" else peer_codec).decode(frame)
        except ProtocolViolation:
            row.untyped += 1
            return
        tag = type(message).__struct_config__.tag
        code, text = getattr(message, "code", None), getattr(message, "message", "")
        if code is not None and (code not in CODES or not text.startswith("commd: ")):
            row.untyped += 1
        if tag in ("progress", "peer_status"):
            return
        row.replies.append(f"{tag} {code}" if code else str(tag))

    # --- every type ------------------------------------------------------------------------

    def client_types(self) -> None:
        coordinator = self.daemon.address
        self.timed("ipc", "hello", "coordinator of ~4 MiB", self.ipc(),
                  packed(hello("worst-h", "h" * ROOM)))
        self.timed("ipc", "hello", "an unknown field nested 100,000 deep", self.ipc(),
                  with_raw(hello("worst-h2", coordinator), "x", deep(100_000)))
        sock = self.ipc()
        self.ask(sock, hello("worst-reg", coordinator), "welcome")
        self.timed("ipc", "register", "~350,000 layers, one name (over --max-layers)", sock,
                  packed(fill({"type": "register", "dtype": "float32", "op": "sum",
                               "buffer_token": "x", "layers": []}, "layers",
                              lambda i: {"name": "w", "size": 1})))
        sock = self.ipc()
        self.ask(sock, hello("worst-reg-max", coordinator), "welcome")
        layers = unique_layers(self.max_layers, ROOM)
        buffer = HostBuffer("commd-worst-max", 4 * self.max_layers)
        self._buffers.append(buffer)
        token = buffer.hand_over(buffer_socket_path(self.daemon.socket), self.timeout_s)
        self.timed("ipc", "register",
                  f"{self.max_layers} layers (--max-layers), distinct names filling the frame; "
                  "the job forms and is planned", sock,
                  packed({"type": "register", "dtype": "float32", "op": "sum",
                          "planner": "optimal", "buffer_token": token, "layers": layers}))
        rank = self.running_rank(SMALL_LAYERS)
        self.timed("ipc", "ready", "layer 0, ~4 million times (a running 4-layer job)", rank,
                  packed(fill({"type": "ready", "layers": []}, "layers", lambda i: 0)))
        self.timed("ipc", "ready", "[i % 4] for ~4 million i", rank,
                  packed(fill({"type": "ready", "layers": []}, "layers", lambda i: i % 4)))
        big = self.running_rank([{"name": f"l{i}", "size": 1} for i in range(self.max_layers)])
        now = time.monotonic()
        self.timed("ipc", "ready", f"every layer of a {self.max_layers}-layer job once, "
                  "with stamps (accepted)", big,
                  packed({"type": "ready", "layers": list(range(self.max_layers)),
                          "stamps": [now] * self.max_layers, "sent_at": now}))
        self.timed("ipc", "wait", "iteration 2**64-1, ~4 MiB unknown field", rank,
                  packed({"type": "wait", "iteration": 2**64 - 1, "pad": "x" * ROOM}))
        self.timed("ipc", "status", "~4 MiB unknown field", self.ipc(),
                  packed({"type": "status", "pad": "x" * ROOM}))
        self.timed("ipc", "trace", "job of ~4 MiB", self.ipc(),
                  packed({"type": "trace", "job": "j" * ROOM, "iterations": 1}))
        self.timed("ipc", "goodbye", "~4 MiB unknown field, no session", self.ipc(),
                  packed({"type": "goodbye", "pad": ["x" * 64] * (ROOM // 66)}))

    def peer_types(self) -> None:
        peer = self.peer()
        self.timed("peer", "peer_join", "~350,000 layers, one name (over --max-layers)", peer,
                  packed(fill(peer_join("worst-j1", []), "layers",
                              lambda i: {"name": "w", "size": 1})))
        self.timed("peer", "peer_join", "~800,000 ranks of a 2**20-rank world", peer,
                  packed(fill(peer_join("worst-j2", SMALL_LAYERS, world_size=MAX_RANKS),
                              "ranks", lambda i: i)))
        self.timed("peer", "peer_join", f"{MAX_LOCAL_RANKS} ranks, {self.max_layers} layers "
                  "(the limits), distinct names filling the frame; forming", peer,
                  packed(peer_join("worst-j3", unique_layers(self.max_layers, ROOM - 20_000),
                                   ranks=list(range(MAX_LOCAL_RANKS)), world_size=MAX_RANKS)))
        formed = self.peer()
        self.ask(formed, peer_join("worst-p", [{"name": f"l{i}", "size": 1}
                                               for i in range(self.max_layers)]), "peer_setup")
        offsets = [i * 1e-6 for i in range(self.max_layers)]
        self.timed("peer", "peer_profile", f"round 0 of a {self.max_layers}-layer job: every "
                  "offset, comm rows filling the frame; planned", formed,
                  packed(fill({"type": "peer_profile", "job": "worst-p", "round": 0,
                               "iteration": -1, "ready_offsets_s": offsets,
                               "iteration_s": 0.1, "measured_comm_s": 0.05, "comm": []},
                              "comm", lambda i: [9.0, float(i % 1000), 4096.0, 1e-4])))
        self.timed("peer", "peer_profile", "iteration 2**64-1", formed,
                  packed({"type": "peer_profile", "job": "worst-p", "round": 1,
                          "iteration": 2**64 - 1}))
        formed = self.peer()
        self.ask(formed, peer_join("worst-hb", SMALL_LAYERS), "peer_setup")
        self.timed("peer", "peer_heartbeat", "~400,000 missing rows", formed,
                  packed(fill({"type": "peer_heartbeat", "job": "worst-hb", "iteration": 1,
                               "missing": []}, "missing", lambda i: [0, 1])))
        self.timed("peer", "peer_leave", "~4 MiB unknown field", peer,
                  packed({"type": "peer_leave", "job": "worst-j3", "pad": "x" * ROOM}))
        self.timed("peer", "peer_abort", "message of ~4 MiB, not a member", peer,
                  packed({"type": "peer_abort", "job": "worst-hb", "code": "engine",
                          "message": "m" * ROOM}))
        # Messages a coordinator sends, sent to a coordinator: decoded, then ignored.
        self.timed("peer", "peer_setup", "~4 MiB prefix", peer,
                  packed({"type": "peer_setup", "job": "worst-p", "generation": MAX_COUNT,
                          "node_index": 0, "nodes": 1, "store_port": 1, "planner": "wfbp",
                          "store_prefix": "p" * ROOM}))
        self.timed("peer", "peer_plan", "~1 million one-layer groups", peer,
                  packed(fill({"type": "peer_plan", "job": "worst-p", "round": 1,
                               "effective_iteration": 3, "version": 2, "groups": [],
                               "alpha_s": 1e-4, "beta_s_per_byte": 1e-9,
                               "predicted_comm_s": 0.0}, "groups", lambda i: [0])))
        self.timed("peer", "peer_status", "~800,000 joined ranks", peer,
                  packed(fill({"type": "peer_status", "job": "worst-p", "joined": []},
                              "joined", lambda i: i)))

    def close(self) -> None:
        self.prober.close()
        for sock in self._sockets:
            sock.close(linger=0)
        for buffer in self._buffers:
            buffer.close()


def run(daemon: LocalDaemon, context: zmq.Context[Any], max_layers: int, window_s: float,
        timeout_s: float, key_dir: Path, progress: Callable[[str], None]) -> list[Row]:
    worst = Worst(daemon, context, max_layers, window_s, timeout_s, key_dir)
    try:
        progress("worst frames: client types")
        worst.client_types()
        progress("worst frames: peer types")
        worst.peer_types()
    finally:
        worst.close()
    return worst.rows
