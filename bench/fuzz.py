"""Fuzz both sockets of real `commd run` daemons, then check that a real job is still exact.

    .venv/bin/python bench/fuzz.py                  # 100,000 frames per socket
    .venv/bin/python bench/fuzz.py --frames 2000    # a quick run
    .venv/bin/python bench/fuzz.py --seed 7 --json results.json
    .venv/bin/python bench/fuzz.py --worst          # the worst frame per type, timed

``--worst`` is its own mode (bench/worst_frames.py): two daemons without a key (``w0``,
``w1``, ``--max-layers`` as given); for every client and peer message type the frames that
make it cost most within the 4 MiB cap go to ``w0``, each timed by how long a ``status``
prober on another connection was held; then a real 2-node job on ``w0``+``w1`` must be exact.
It fails when a frame blocks the loop longer than ``--limit-ms`` or gets an untyped reply.

What runs (docs/reliability.md says more):

- Two daemons without a key on 127.0.0.1 (``u0``, ``u1``) and two with a cluster key from
  `commd keygen` (``k0``, ``k1``), started with ``commd.testing.daemons.LocalDaemon``.
- **ipc** (``u0``): ``--frames`` frames on the ipc socket, in episodes of one connection each:
  no hello, after a valid hello, or inside a running one-rank job (a real buffer handed over
  and registered). Frames go out in batches of ``--batch``, each followed by a ``status``
  request as a barrier; every reply must decode as a daemon message, an ``error`` must carry
  a known code and a "commd: " message, and outside running jobs every frame must get exactly
  one reply (none for a goodbye that ends a session).
- **peer** (``u0``, no ``--cluster-key``): ``--frames`` frames from raw DEALERs to the peer
  port, holding the local key ``u0`` made beside its socket (a member node's view), in batches
  closed by a join the coordinator must refuse to us (its ``peer_abort`` is the barrier);
  whatever comes back must decode as a peer message.
- **keyed peer** (``k0``): ``--frames`` frames from attackers without the key: raw TCP
  connections (a ZMTP greeting for NULL or CURVE with junk, or plain garbage, then frames),
  and ZeroMQ DEALERs with no key or a wrong one. None may reach the daemon: no peer-loop log
  line, no job, nothing sent back.
- Frames: ``commd.testing.fuzz``'s (the fuzz test's too), drawn from a ``random.Random`` of
  ``--seed``: mutations of valid messages of every type (a field dropped, duplicated or
  retyped, huge ints, negative sizes, NaN and infinities, long strings, deep nesting, unknown
  tags, extra fields, cut or flipped bytes), random bytes, random MessagePack values, messages
  of several ZeroMQ frames; here also, rarely, one over the size limit.
- Then a real job of 2 daemons x 2 ranks on ``u0``+``u1`` (``u0`` coordinates) and on
  ``k0``+``k1`` (``commd.testing.ranks``): every element every rank got in every iteration
  must be exact.

Reported: frames per socket, replies by type and error code, crashes (a daemon exited),
dead loops (no answer to a barrier or to ``status`` within ``--reply-timeout``), untyped
replies, internal errors and logged tracebacks, each daemon's RSS before and after
(/proc/PID/status VmRSS), wall time, the jobs. Exit status 1 if any check fails. Everything
started is stopped (also on Ctrl-C and SIGTERM); the daemons' logs are kept with
``--keep-logs`` or when a check fails, with every finding's frame in findings.jsonl.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from commd.cli.tables import markdown_table
from commd.daemon.peer_security import ClusterKey, connect_securely
from commd.testing import fuzz
from commd.testing.daemons import LocalDaemon
from commd.testing.fuzz import (
    CODES,
    POOL,
    RandomDraws,
    builtins,
    decoded,
    pack,
    stack_sensitive,
)
from commd.testing.ranks import JobSpec, assert_exact, collect, start_ranks
from commd.testing.results import write_results
from commd_client.host_buffer import HostBuffer
from commd_protocol import (
    PROTOCOL_VERSION,
    CommdError,
    Done,
    Error,
    Goodbye,
    Hello,
    Layer,
    PeerAbort,
    PeerJoin,
    PeerLeave,
    Progress,
    ProtocolViolation,
    Ready,
    Register,
    StatusReply,
    StatusRequest,
    Wait,
    Welcome,
)
from commd_protocol.codec import MAX_MESSAGE_BYTES, daemon_codec, peer_codec
from commd_protocol.handover import buffer_socket_path
from commd_protocol.messages import Registered

RSS_TARGET_MB = 50.0
JOB_LAYERS = [("conv.weight", 1728), ("conv.bias", 64), ("fc.weight", 4096), ("fc.bias", 10)]
JOB_ITERATIONS = 5


# --- results ---------------------------------------------------------------------------------


@dataclass
class Side:
    """What one socket's fuzzing saw."""

    name: str
    frames: int = 0
    replies: Counter[str] = field(default_factory=Counter)
    untyped: int = 0
    internal_errors: int = 0
    count_mismatches: int = 0  # frames whose replies were not exactly one (ipc)
    crashes: int = 0
    dead_loops: int = 0
    breaches: int = 0  # keyed port: a frame or a handshake that got through
    setup_failures: int = 0  # a valid hello or register refused: state left behind (ipc)
    own_report_refused: int = 0  # a running job failed by a report its own node made (ipc)
    regenerated: int = 0  # stack-sensitive frames replaced before sending (ipc)
    wall_s: float = 0.0
    rss_before_mb: float = 0.0
    rss_after_mb: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return bool(self.untyped or self.internal_errors or self.count_mismatches or self.crashes
                    or self.dead_loops or self.breaches or self.setup_failures
                    or self.own_report_refused)


class Findings:
    """Every frame that broke a rule, as hex, in findings.jsonl (kept with the logs)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.count = 0

    def add(self, what: str, frames: list[Any], detail: object = "") -> None:
        """``frames``: the frames sent since the last barrier (bytes, or a list of parts)."""
        self.count += 1
        if self.count > 200:
            return
        record = {"what": what, "detail": str(detail)[:2000],
                  "frames": [_hex(f) for f in frames[:64]]}
        with open(self.path, "a") as out:
            out.write(json.dumps(record) + "\n")


def _hex(frame: Any) -> Any:
    if isinstance(frame, list):
        return [part.hex() for part in frame]
    return bytes(frame[:4096]).hex()


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


class Gone(Exception):
    """No answer within the deadline."""


class SetupFailed(Exception):
    """A valid hello or register of an episode's set-up was refused."""


def receive(sock: zmq.Socket[bytes], timeout_s: float) -> bytes:
    """The next frame but a ``progress`` (sent every 2 s to a waiting rank: not a reply)."""
    while True:
        if not sock.poll(int(timeout_s * 1000)):
            raise Gone(f"no answer within {timeout_s:g}s")
        frame = sock.recv()
        try:
            if isinstance(daemon_codec.decode(frame), Progress):
                continue
        except ProtocolViolation:
            pass
        return frame


def answers_status(path: str, context: zmq.Context[zmq.Socket[bytes]], timeout_s: float) -> bool:
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"ipc://{path}")
        sock.send(pack(builtins(StatusRequest())))
        while True:
            reply = daemon_codec.decode(receive(sock, timeout_s))
            if isinstance(reply, StatusReply):
                return True
    except (Gone, ProtocolViolation):
        return False
    finally:
        sock.close(linger=0)


def status_of(path: str, context: zmq.Context[zmq.Socket[bytes]],
              timeout_s: float) -> dict[str, Any]:
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"ipc://{path}")
        sock.send(pack(builtins(StatusRequest())))
        reply = daemon_codec.decode(receive(sock, timeout_s))
        assert isinstance(reply, StatusReply), reply
        return reply.status
    finally:
        sock.close(linger=0)


def liveness(side: Side, daemon: LocalDaemon, context: zmq.Context[zmq.Socket[bytes]],
             timeout_s: float, what: str) -> None:
    """After a barrier that did not come back: a crash, or a loop that stopped serving."""
    if daemon.process.poll() is not None:
        side.crashes += 1
        side.notes.append(f"{daemon.name} exited with {daemon.process.returncode} ({what})")
    else:
        side.dead_loops += 1
        alive = answers_status(daemon.socket, context, timeout_s)
        side.notes.append(f"{daemon.name}: {what}; status {'still' if alive else 'not'} answered")


# --- the ipc socket --------------------------------------------------------------------------


def classify(frame: bytes, side: Side, findings: Findings, sent: list[Any]) -> Any:
    """The daemon's reply as its type, counted; None (and a finding) if it is not one."""
    try:
        message = daemon_codec.decode(frame)
    except ProtocolViolation as exc:
        side.untyped += 1
        findings.add("untyped ipc reply", sent, f"{frame[:200]!r}: {exc}")
        return None
    tag = type(message).__struct_config__.tag
    if isinstance(message, Error):
        side.replies[f"error {message.code}"] += 1
        if message.code not in CODES or not message.message.startswith("commd: "):
            side.untyped += 1
            findings.add("error reply without a known code or 'commd: '", sent, message)
        if message.message.startswith("commd: internal error"):
            side.internal_errors += 1
            findings.add("internal error", sent, message)
    else:
        side.replies[str(tag)] += 1
    return message


class IpcEpisode:
    """One connection: ``fresh`` (no hello), ``greeted`` (a valid hello first) or ``running``
    (a one-rank job, registered with a real buffer, coordinated by the same daemon)."""

    def __init__(self, kind: str, daemon: LocalDaemon, context: zmq.Context[zmq.Socket[bytes]],
                 number: int, timeout_s: float) -> None:
        self.kind = kind
        self.timeout_s = timeout_s
        self.sock = context.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"ipc://{daemon.socket}")
        self.session = False
        self.buffer: HostBuffer | None = None
        self.job_running = False
        self.next_iteration = 0
        self.report_refused = False
        if kind == "greeted":
            self.session = self._ask(_hello(POOL[number % len(POOL)], "127.0.0.1:1"), Welcome)
        elif kind == "running":
            job = f"fuzz-run-{number}"
            self._ask(_hello(job, daemon.address), Welcome)
            self.buffer = HostBuffer(f"commd-fuzz-{number}", 4 * 9)
            try:
                token = self.buffer.hand_over(buffer_socket_path(daemon.socket), timeout_s)
            except CommdError as exc:
                self.abandon()
                raise SetupFailed(f"the buffer hand-over: {exc}") from None
            layers = [Layer(name=f"l{i}", size=3) for i in range(3)]
            self._ask(Register(layers=layers, dtype="float32", op="sum", planner="wfbp",
                               buffer_token=token), Registered)
            self.session = self.job_running = True

    def _ask(self, message: msgspec.Struct, expected: type) -> bool:
        self.sock.send(pack(builtins(message)))
        reply = daemon_codec.decode(receive(self.sock, self.timeout_s))
        if not isinstance(reply, expected):
            self.abandon()
            raise SetupFailed(f"{type(message).__name__} got {reply}")
        return True

    def batch(self, frames: list[Any], side: Side, findings: Findings,
              rng: random.Random | None = None) -> None:
        """Send ``frames`` and a status barrier; check every reply up to the barrier's. In a
        running job (with ``rng``), one real iteration follows the frames: every layer ready,
        sometimes with odd stamps, and a wait, so that the job reaches its report rounds."""
        if self.job_running and rng is not None:
            # All three layers in one ready, as a client sends a group; then each alone, so
            # that whatever the frames marked already, the iteration completes (the rest get
            # a typed "ready twice").
            stamps = _stamps(rng)
            single = [Ready(layers=[layer], stamps=stamps[i:i + 1])
                      for i, layer in enumerate([2, 1, 0])]
            driver = [Ready(layers=[2, 1, 0], stamps=stamps), *single,
                      Wait(iteration=self.next_iteration)]
            frames = [*frames, *[pack(builtins(message)) for message in driver]]
        for frame in frames:
            if isinstance(frame, list):
                self.sock.send_multipart(frame)
            else:
                self.sock.send(frame)
        self.sock.send(pack(builtins(StatusRequest())))
        statuses = 1 + sum(isinstance(decoded(f), StatusRequest) for f in frames)
        replies: list[Any] = []
        while statuses:
            message = classify(receive(self.sock, self.timeout_s), side, findings, frames)
            replies.append(message)
            statuses -= isinstance(message, StatusReply)
            if isinstance(message, Done):
                self.next_iteration = max(self.next_iteration, message.iteration + 1)
            if isinstance(message, Error) and "report is refused" in message.message \
                    and not self.report_refused:  # input this socket took broke the report
                self.report_refused = True
                side.own_report_refused += 1
                findings.add("the node's own report was refused", frames, message)
        if self.kind != "running":  # a running job may answer later (a done): not counted
            self._account(frames, replies, side, findings)

    def _account(self, frames: list[Any], replies: list[Any], side: Side,
                 findings: Findings) -> None:
        """Exactly one reply per frame, in order; none for a goodbye that ends a session."""
        at = 0
        for frame in frames:
            message = decoded(frame)
            if isinstance(message, Goodbye) and self.session:
                self.session = False
                continue
            if at >= len(replies) - 1:
                break
            reply = replies[at]
            at += 1
            if isinstance(message, StatusRequest) and not isinstance(reply, StatusReply):
                break
            self.session = self.session or isinstance(reply, Welcome)
        else:
            if at == len(replies) - 1:
                return
        side.count_mismatches += 1
        findings.add("not one reply per frame", frames,
                     [type(r).__name__ if r is not None else None for r in replies])
        self.kind = "running"  # the model lost track: check types only, until the end

    def close(self, side: Side, findings: Findings) -> None:
        """Goodbye (also when the model thinks no session is open: then an error comes back),
        so that no session outlives its connection; the last replies are checked for their
        types only (a running job may still send a done)."""
        self.sock.send(pack(builtins(Goodbye())))
        self.session = self.job_running = False
        self.kind = "running"
        try:
            self.batch([], side, findings)
        finally:
            self.abandon()

    def abandon(self) -> None:
        self.sock.close(linger=0)
        if self.buffer is not None:
            self.buffer.close()


def _stamps(rng: random.Random) -> list[float]:
    """Stamps for the three layers of a running episode's iteration: none, plausible ones
    (CLOCK_MONOTONIC seconds), or now and then odd ones."""
    roll = rng.random()
    if roll < 0.5:
        return []
    if roll < 0.9:
        now = time.monotonic()
        return [now - rng.uniform(0, 0.01) for _ in range(3)]
    odd = [math.nan, math.inf, -math.inf, 1e308, -1e308, 0.0, -1.0, 5e-324, 2.0**63]
    return [rng.choice(odd) for _ in range(3)]


def _hello(job: str, coordinator: str) -> Hello:
    return Hello(protocol=PROTOCOL_VERSION, job=job, rank=0, world_size=1, local_rank=0,
                 local_world_size=1, coordinator=coordinator, pid=os.getpid())


def measure_from(side: Side, daemon: LocalDaemon) -> float:
    """Take the daemon's RSS before ``side``'s fuzzing; the start of its wall time."""
    started = time.monotonic()
    side.rss_before_mb = rss_mb(daemon.process.pid)
    return started


def measure_to(side: Side, daemon: LocalDaemon, started: float) -> None:
    """``side``'s wall time since ``started`` and the daemon's RSS after (0 once it died)."""
    side.wall_s = time.monotonic() - started
    side.rss_after_mb = rss_mb(daemon.process.pid) if daemon.process.poll() is None else 0.0


def report_every_10k(side: Side, count: int, daemon: LocalDaemon,
                     progress: Callable[[str], None]) -> None:
    """A progress line each time ``side`` passes a multiple of 10,000 frames (``count`` sent
    last)."""
    if side.frames % 10_000 < count:
        rss = rss_mb(daemon.process.pid)
        progress(f"{side.name}: {side.frames} frames, {daemon.name} RSS {rss:.1f} MB")


def fuzz_ipc(daemon: LocalDaemon, draws: RandomDraws, total: int, batch: int, timeout_s: float,
             findings: Findings, context: zmq.Context[zmq.Socket[bytes]],
             progress: Callable[[str], None]) -> Side:
    side = Side("ipc")
    rng = draws.rng
    started = measure_from(side, daemon)
    oversize = pack({"type": "status", "pad": "x" * (MAX_MESSAGE_BYTES + 1)})
    number = 0
    while side.frames < total:
        kind = rng.choices(["fresh", "greeted", "running"], [5, 3, 2])[0]
        number += 1
        try:
            episode = IpcEpisode(kind, daemon, context, number, timeout_s)
        except Gone:
            liveness(side, daemon, context, timeout_s, f"no answer setting up a {kind} episode")
            break
        except SetupFailed as exc:  # something an earlier episode left behind
            side.setup_failures += 1
            findings.add(f"a {kind} episode could not start", [], exc)
            continue
        length = min(rng.randint(16, 400), total - side.frames)
        try:
            while length > 0:  # a running job gets one iteration per batch: smaller batches
                count = min(batch if kind != "running" else max(1, batch // 4), length)
                chunk = [fuzz.frame(draws, "ipc") for _ in range(count)]
                for index, frame in enumerate(chunk):  # (a goodbye would end a running job)
                    while stack_sensitive(frame) or (
                            kind == "running" and isinstance(decoded(frame), Goodbye)):
                        side.regenerated += stack_sensitive(frame)
                        frame = chunk[index] = fuzz.frame(draws, "ipc")
                if rng.random() < 0.002:
                    chunk[-1] = oversize
                episode.batch(chunk, side, findings, rng)
                side.frames += count
                length -= count
                report_every_10k(side, count, daemon, progress)
            episode.close(side, findings)
        except Gone:
            liveness(side, daemon, context, timeout_s, "a status barrier was not answered")
            episode.abandon()
            break
    if side.regenerated:
        side.notes.append(f"{side.regenerated} goodbye/status frames whose decoding depends on "
                          "the stack depth were replaced before sending (an xfail test)")
    if daemon.process.poll() is None and not answers_status(daemon.socket, context, timeout_s):
        liveness(side, daemon, context, timeout_s, "status not answered after the fuzzing")
    measure_to(side, daemon, started)
    return side


# --- the peer port, without a key ------------------------------------------------------------


def peer_barrier(sock: zmq.Socket[bytes], number: int, side: Side, findings: Findings,
                 timeout_s: float, sent: list[Any]) -> None:
    """A join the coordinator must refuse to us, after everything sent before it."""
    job = f"!barrier-{number}"
    join = PeerJoin(protocol=PROTOCOL_VERSION, job=job, ranks=[0], world_size=1,
                    layers=[Layer(name="w", size=1)], dtype="float32", op="sum",
                    planner="wfbp", host="127.0.0.1")
    sock.send(pack(builtins(join)))
    while True:
        frame = receive(sock, timeout_s)
        try:
            message = peer_codec.decode(frame)
        except ProtocolViolation as exc:
            side.untyped += 1
            findings.add("untyped peer message", sent, f"{frame[:200]!r}: {exc}")
            continue
        if isinstance(message, PeerAbort) and message.job == job:
            return
        tag = type(message).__struct_config__.tag
        side.replies[f"{tag} {getattr(message, 'code', '')}".strip()] += 1
        if isinstance(message, PeerAbort) and not message.message.startswith("commd: "):
            side.untyped += 1
            findings.add("peer_abort without 'commd: '", sent, message)


def peer_socket(context: zmq.Context[zmq.Socket[bytes]], daemon: LocalDaemon) -> Any:
    """A peer daemon's DEALER to ``daemon``'s peer port: CurveZMQ with the local key beside
    its socket when it has one (an unkeyed daemon's automatic key), so the frames reach the
    coordinator as a member node's would; plain otherwise."""
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    key = Path(daemon.socket).parent / "cluster.key"
    if key.exists():
        pair = tomllib.loads(key.read_text())
        connect_securely(sock, ClusterKey(pair["public"].encode(), pair["secret"].encode()))
    sock.connect(f"tcp://{daemon.address}")
    return sock


def fuzz_peer(daemon: LocalDaemon, draws: RandomDraws, total: int, batch: int, timeout_s: float,
              findings: Findings, context: zmq.Context[zmq.Socket[bytes]],
              progress: Callable[[str], None]) -> Side:
    side = Side("peer")
    rng = draws.rng
    started = measure_from(side, daemon)
    barriers = 0
    oversize_sent = 0
    while side.frames < total:
        sock = peer_socket(context, daemon)
        length = min(rng.randint(16, 600), total - side.frames)
        try:
            while length > 0:
                count = min(batch, length)
                chunk = [fuzz.frame(draws, "peer") for _ in range(count)]
                for frame in chunk:
                    if isinstance(frame, list):
                        sock.send_multipart(frame)
                    else:
                        sock.send(frame)
                barriers += 1
                peer_barrier(sock, barriers, side, findings, timeout_s, chunk)
                side.frames += count
                length -= count
                report_every_10k(side, count, daemon, progress)
            for job in POOL:  # leave what this connection joined
                sock.send(pack(builtins(PeerLeave(job=job))))
            barriers += 1
            peer_barrier(sock, barriers, side, findings, timeout_s, [])
            if rng.random() < 0.02:  # over the frame cap: the daemon ends the connection
                sock.send(b"\x00" * (MAX_MESSAGE_BYTES + 128 * 1024))
                oversize_sent += 1
                sock.setsockopt(zmq.LINGER, 1000)  # let it leave before the close
        except Gone:
            liveness(side, daemon, context, timeout_s, "a peer barrier was not answered")
            break
        finally:
            sock.close()
    if oversize_sent:
        side.notes.append(f"{oversize_sent} frame(s) over the peer frame cap (connection ended)")
    # the peer loop still serves a new connection
    if daemon.process.poll() is None and not side.crashes and not side.dead_loops:
        sock = peer_socket(context, daemon)
        try:
            peer_barrier(sock, barriers + 1, side, findings, timeout_s, [])
        except Gone:
            liveness(side, daemon, context, timeout_s, "the peer loop stopped serving")
        finally:
            sock.close(linger=0)
    measure_to(side, daemon, started)
    return side


# --- the keyed peer port: attackers without the key ------------------------------------------


def zmtp_greeting(mechanism: bytes) -> bytes:
    """A ZMTP 3.0 greeting (64 bytes) for ``mechanism``, as a client."""
    return b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + mechanism.ljust(20, b"\x00") + \
        b"\x00" + b"\x00" * 31


def zmtp_frame(body: bytes, flags: int = 0) -> bytes:
    if len(body) < 256:
        return bytes([flags, len(body)]) + body
    return bytes([flags | 0x02]) + len(body).to_bytes(8, "big") + body


def zmtp_command(name: bytes, body: bytes) -> bytes:
    return zmtp_frame(bytes([len(name)]) + name + body, flags=0x04)


def attack_keyed(daemon: LocalDaemon, public_key: bytes, draws: RandomDraws, total: int,
                 timeout_s: float, context: zmq.Context[zmq.Socket[bytes]],
                 progress: Callable[[str], None]) -> Side:
    side = Side("keyed peer")
    rng = draws.rng
    started = measure_from(side, daemon)
    refused_before = int(status_of(daemon.socket, context, timeout_s)["peer_handshakes_refused"])
    host, port = daemon.host, daemon.port
    written = dropped = received = 0
    # ZeroMQ attackers: no key (NULL against CURVE), and a Curve key that is not the cluster's.
    zmq_attempts = 0
    zmq_queued = 0
    for attempt in range(8):
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 1000)
        if attempt % 2:
            client_public, client_secret = zmq.curve_keypair()
            sock.curve_secretkey, sock.curve_publickey = client_secret, client_public
            sock.curve_serverkey = public_key
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                                          | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                                          | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                                          | zmq.EVENT_HANDSHAKE_SUCCEEDED
                                          | zmq.EVENT_DISCONNECTED)
        sock.connect(f"tcp://{host}:{port}")
        for _ in range(1000):
            frame = fuzz.frame(draws, "peer")
            try:
                if isinstance(frame, list):
                    sock.send_multipart(frame, zmq.NOBLOCK)
                else:
                    sock.send(frame, zmq.NOBLOCK)
                zmq_queued += 1
            except zmq.Again:
                break
        # until the daemon turns the handshake down (a monitor event, with a deadline)
        deadline = time.monotonic() + timeout_s
        verdict = "no event"
        while time.monotonic() < deadline and verdict == "no event":
            if monitor.poll(100):
                event = recv_monitor_message(monitor)["event"]
                verdict = ("handshake succeeded" if event == zmq.EVENT_HANDSHAKE_SUCCEEDED
                           else "refused")
        if verdict != "refused":
            side.breaches += 1
            side.notes.append(f"zmq attacker {attempt}: {verdict}")
        while sock.poll(0):
            sock.recv()
            received += 1
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)
        zmq_attempts += 1
    # Raw TCP: greetings for NULL or CURVE (with a junk HELLO), or garbage; then frames.
    connections = 0
    per_connection = 2000
    while side.frames < total:
        count = min(rng.randint(1, per_connection), total - side.frames)
        style = ("null", "curve", "garbage")[connections % 3]
        if style == "null":
            head = zmtp_greeting(b"NULL") + zmtp_command(
                b"READY", b"\x0bSocket-Type" + (6).to_bytes(4, "big") + b"DEALER")
        elif style == "curve":
            head = zmtp_greeting(b"CURVE") + zmtp_command(b"HELLO", rng.randbytes(194))
        else:
            head = rng.randbytes(rng.randint(1, 128))
        stream = head + b"".join(zmtp_frame(_flat(fuzz.frame(draws, "peer"))) for _ in range(count))
        with socket.create_connection((host, port), timeout=timeout_s) as conn:
            connections += 1
            try:  # one write: it is in the daemon's TCP socket before it can hang up
                conn.sendall(stream)
                written += count
            except OSError:  # it hung up first: how much got there is unknown
                dropped += count
            with contextlib.suppress(OSError):
                while conn.recv(65536):  # until the daemon closes the connection
                    pass
        side.frames += count
        if side.frames % 10_000 < count:
            progress(f"keyed peer: {side.frames} frames")
    status = status_of(daemon.socket, context, timeout_s)
    refused = int(status["peer_handshakes_refused"]) - refused_before
    log = daemon.log()
    through = [line for line in log.splitlines()
               if "peer loop:" in line or "refused this node's join" in line]
    if through or status["coordinating"]:
        side.breaches += len(through) + len(status["coordinating"])
        side.notes.append(f"frames got through: {through[:3]} {status['coordinating']}")
    if received:
        side.breaches += received
        side.notes.append(f"{received} message(s) came back to a zmq attacker")
    side.replies["zap handshakes refused"] = refused
    side.replies["tcp connections"] = connections
    side.replies["frames delivered to its TCP socket"] = written
    side.replies["frames in a write cut by its hang-up"] = dropped
    side.replies["frames queued on zmq attackers"] = zmq_queued
    side.replies["frames that reached the daemon"] = len(through)
    side.notes.append(f"{zmq_attempts} zmq attackers (no key, wrong key), {connections} raw "
                      f"TCP connections; {refused} handshakes refused by the ZAP check")
    if not answers_status(daemon.socket, context, timeout_s):
        liveness(side, daemon, context, timeout_s, "status not answered after the attack")
    measure_to(side, daemon, started)
    return side


def _flat(frame: bytes | list[bytes]) -> bytes:
    return frame if isinstance(frame, bytes) else b"".join(frame)


# --- a real job afterwards -------------------------------------------------------------------


def real_job(name: str, nodes: list[LocalDaemon], timeout_s: float) -> tuple[bool, str]:
    """2 daemons x 2 ranks (commd.testing.rank_worker); the first daemon coordinates.
    (exact?, what happened)."""
    spec = JobSpec(name, nodes, 2, JOB_LAYERS, iterations=JOB_ITERATIONS, timeout=timeout_s)
    results = collect(start_ranks(spec), timeout_s + 60)
    try:
        assert_exact(spec, results)
    except AssertionError as exc:
        return False, f"{str(exc)[:1500]} " + "; ".join(
            f"rank {r.get('rank')}: {r.get('error', '')} (exit {r['returncode']}) "
            f"{r['stderr'][-300:]}" for r in results)
    return True, f"{spec.world_size} ranks x {JOB_ITERATIONS} iterations, every element exact"


# --- the run ---------------------------------------------------------------------------------


def log_problems(daemon: LocalDaemon) -> list[str]:
    """Tracebacks and exceptions the daemon's guards caught (not refusals)."""
    lines = daemon.log().splitlines()
    return [line for line in lines
            if "Traceback" in line or "the loop goes on" in line or "internal error" in line
            or "task failed" in line]


def table(rows: list[list[str]]) -> str:
    """The headers first, then the rows."""
    head, *body = rows
    return markdown_table(head, body)


def top(counter: Counter[str], limit: int = 12) -> str:
    return ", ".join(f"{key} {count:,}" for key, count in counter.most_common(limit)) or "-"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, default=100_000, help="frames per socket")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--batch", type=int, default=64,
                        help="frames between two barriers (a status request, a refused join)")
    parser.add_argument("--reply-timeout", type=float, default=10.0,
                        help="seconds a barrier may take before the loop counts as dead")
    parser.add_argument("--job-timeout", type=float, default=120.0)
    parser.add_argument("--keep-logs", action="store_true")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    parser.add_argument("--worst", action="store_true",
                        help="the worst frame per message type, timed (instead of fuzzing)")
    parser.add_argument("--max-layers", type=int, default=65536,
                        help="--worst: the daemons' --max-layers (the default is commd's)")
    parser.add_argument("--window", type=float, default=1.0,
                        help="--worst: seconds the prober watches the loop after each frame")
    parser.add_argument("--limit-ms", type=float, default=50.0,
                        help="--worst: the most a frame may block the loop")
    args = parser.parse_args()
    if args.worst:
        return worst_mode(args)
    signal.signal(signal.SIGTERM, _interrupted)
    workdir = Path(tempfile.mkdtemp(prefix="commd-fuzz-"))
    daemons: list[LocalDaemon] = []
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    keep = args.keep_logs
    started = time.monotonic()
    findings = Findings(workdir / "findings.jsonl")

    def progress(text: str) -> None:
        print(f"[fuzz] {text} ({time.monotonic() - started:.0f}s)", file=sys.stderr, flush=True)

    try:
        key = workdir / "keyed-cluster.key"  # k0, k1; u0 and u1 make their local key
        made = subprocess.run([sys.executable, "-m", "commd.cli", "keygen", str(key)],
                              capture_output=True, text=True, timeout=60)
        if made.returncode != 0:
            raise RuntimeError(f"commd keygen failed: {made.stderr}")
        public = _public_key(key)
        for name, extra in [("u0", ()), ("u1", ()), ("k0", ("--cluster-key", str(key))),
                            ("k1", ("--cluster-key", str(key)))]:
            daemons.append(LocalDaemon(workdir, name, "--backend", "gloo", *extra))
        u0, u1, k0, k1 = daemons
        progress(f"daemons up: u0 pid {u0.process.pid}, k0 pid {k0.process.pid}; seed "
                 f"{args.seed}, {args.frames} frames per socket, logs in {workdir}")
        rss_start = {d.name: rss_mb(d.process.pid) for d in daemons}
        rng = random.Random(args.seed)
        ipc = fuzz_ipc(u0, RandomDraws(rng), args.frames, args.batch, args.reply_timeout,
                       findings, context, progress)
        peer = fuzz_peer(u0, RandomDraws(rng), args.frames, args.batch,
                         args.reply_timeout, findings, context, progress)
        keyed = attack_keyed(k0, public, RandomDraws(rng), args.frames,
                             args.reply_timeout, context, progress)
        sides = [ipc, peer, keyed]
        rss_fuzzed = {d.name: rss_mb(d.process.pid) for d in daemons if d.process.poll() is None}
        problems = {d.name: log_problems(d) for d in daemons}
        progress("fuzzing done; a real job on u0+u1 and on k0+k1")
        jobs = {}
        for name, pair in [("u0+u1", [u0, u1]), ("k0+k1 (keyed)", [k0, k1])]:
            if any(d.process.poll() is not None for d in pair):
                jobs[name] = (False, "a daemon is gone")
            else:
                jobs[name] = real_job(f"fuzz-after-{pair[0].name}", pair, args.job_timeout)
        rss_end = {d.name: rss_mb(d.process.pid) for d in daemons if d.process.poll() is None}
        wall = time.monotonic() - started

        growth = {n: rss_fuzzed.get(n, 0.0) - rss_start[n] for n in ("u0", "k0")}
        checks = [
            ("crashes", sum(s.crashes for s in sides) == 0, str(sum(s.crashes for s in sides))),
            ("dead loops", sum(s.dead_loops for s in sides) == 0,
             str(sum(s.dead_loops for s in sides))),
            ("untyped replies", ipc.untyped + peer.untyped == 0,
             str(ipc.untyped + peer.untyped)),
            ("internal errors", ipc.internal_errors == 0, str(ipc.internal_errors)),
            ("ipc frames without exactly one reply", ipc.count_mismatches == 0,
             str(ipc.count_mismatches)),
            ("ipc episodes whose valid hello/register was refused", ipc.setup_failures == 0,
             str(ipc.setup_failures)),
            ("running jobs failed by their own node's report (client input taken unchecked)",
             ipc.own_report_refused == 0, str(ipc.own_report_refused)),
            ("tracebacks / caught exceptions in the logs",
             not any(problems.values()), str(sum(len(p) for p in problems.values()))),
            ("keyed port: frames through, handshakes accepted", keyed.breaches == 0,
             str(keyed.breaches)),
            (f"RSS growth u0 (target < {RSS_TARGET_MB:g} MB)", growth["u0"] < RSS_TARGET_MB,
             f"{growth['u0']:+.1f} MB"),
            (f"RSS growth k0 (target < {RSS_TARGET_MB:g} MB)", growth["k0"] < RSS_TARGET_MB,
             f"{growth['k0']:+.1f} MB"),
            *[(f"job afterwards on {name}", ok, text) for name, (ok, text) in jobs.items()],
        ]
        failed = any(not ok for _, ok, _ in checks) or findings.count > 0
        print(f"\n## commd fuzz: seed {args.seed}, {args.frames:,} frames per socket, "
              f"batch {args.batch}, {wall:.0f} s\n")
        print(table([["socket", "daemon", "frames sent", "replies / outcome", "crashes",
                      "dead loops", "untyped", "internal errors", "reply count wrong",
                      "RSS before → after (MB)", "wall (s)"]] + [
            [s.name, d, f"{s.frames:,}", top(s.replies), str(s.crashes), str(s.dead_loops),
             str(s.untyped), str(s.internal_errors), str(s.count_mismatches),
             f"{s.rss_before_mb:.1f} → {s.rss_after_mb:.1f}", f"{s.wall_s:.1f}"]
            for s, d in [(ipc, "u0"), (peer, "u0"), (keyed, "k0")]]))
        print()
        print(table([["daemon", "RSS at start (MB)", "after fuzzing", "after the job"]] + [
            [d.name, f"{rss_start[d.name]:.1f}", f"{rss_fuzzed.get(d.name, 0.0):.1f}",
             f"{rss_end.get(d.name, 0.0):.1f}"] for d in daemons]))
        print()
        print(table([["check", "result", "value"]] + [
            [name, "pass" if ok else "**FAIL**", text] for name, ok, text in checks]))
        for side in sides:
            for note in side.notes:
                print(f"- {side.name}: {note}")
        for name, lines in problems.items():
            for line in lines[:5]:
                print(f"- {name} log: {line[:300]}")
        if findings.count:
            print(f"- {findings.count} finding(s), frames as hex: {findings.path}")
        if args.json:
            write_results("fuzz", {
                "seed": args.seed, "frames": args.frames, "batch": args.batch,
                "wall_s": wall,
                "sides": [{**{k: v for k, v in vars(s).items() if k != "replies"},
                           "replies": dict(s.replies)} for s in sides],
                "rss_start_mb": rss_start, "rss_fuzzed_mb": rss_fuzzed, "rss_end_mb": rss_end,
                "checks": [{"check": n, "ok": ok, "value": v} for n, ok, v in checks],
                "log_problems": problems, "findings": findings.count,
            }, args.json)
        keep = keep or failed
        return 1 if failed else 0
    finally:
        for daemon in daemons:
            daemon.stop()
        context.destroy(linger=0)
        if keep:
            print(f"[fuzz] logs kept in {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)


def worst_mode(args: argparse.Namespace) -> int:
    """``--worst``: every message type's worst frames against ``w0``, then a real job."""
    import worst_frames

    signal.signal(signal.SIGTERM, _interrupted)
    workdir = Path(tempfile.mkdtemp(prefix="commd-worst-"))
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    daemons: list[LocalDaemon] = []
    started = time.monotonic()
    failed = True

    def progress(text: str) -> None:
        print(f"[fuzz] {text} ({time.monotonic() - started:.0f}s)", file=sys.stderr, flush=True)

    try:
        for name in ("w0", "w1"):
            daemons.append(LocalDaemon(workdir, name, "--backend", "gloo", "--max-layers",
                                       str(args.max_layers)))
        w0, _ = daemons
        rows = worst_frames.run(w0, context, args.max_layers, args.window,
                                args.reply_timeout, workdir, progress)
        alive = w0.process.poll() is None and answers_status(w0.socket, context,
                                                             args.reply_timeout)
        problems = log_problems(w0)
        progress("a real job on w0+w1")
        exact, job = real_job("worst-after", daemons, args.job_timeout) if alive else \
            (False, "w0 is gone")
        worst = max(rows, key=lambda row: row.blocked_ms)
        checks = [
            (f"worst blocking (limit {args.limit_ms:g} ms)", worst.blocked_ms <= args.limit_ms,
             f"{worst.blocked_ms:.1f} ms ({worst.type}: {worst.frame})"),
            ("untyped replies", not any(row.untyped for row in rows),
             str(sum(row.untyped for row in rows))),
            ("daemon alive, status answered", alive, str(alive)),
            ("tracebacks / caught exceptions in the log", not problems, str(len(problems))),
            ("job afterwards on w0+w1", exact, job),
        ]
        failed = not all(ok for _, ok, _ in checks)
        print(f"\n## commd fuzz --worst: --max-layers {args.max_layers}, window "
              f"{args.window:g} s, {time.monotonic() - started:.0f} s\n")
        print(worst_tables([vars(row) for row in rows],
                           [{"check": n, "ok": ok, "value": v} for n, ok, v in checks]))
        for line in problems[:5]:
            print(f"- w0 log: {line[:300]}")
        if args.json:
            write_results("fuzz-worst", {
                "max_layers": args.max_layers, "window_s": args.window,
                "rows": [vars(row) for row in rows],
                "checks": [{"check": n, "ok": ok, "value": v} for n, ok, v in checks],
            }, args.json)
        return 1 if failed else 0
    finally:
        for daemon in daemons:
            daemon.stop()
        context.destroy(linger=0)
        if failed or args.keep_logs:
            print(f"[fuzz] logs kept in {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)


def worst_tables(rows: list[dict[str, Any]], checks: list[dict[str, Any]]) -> str:
    """``--worst``'s tables: each message type's worst frame, then the checks (what its
    results file holds)."""
    return "\n\n".join([
        table([["socket", "type", "frame", "bytes", "loop blocked (ms)", "replies"]] + [
            [row["side"], row["type"], row["frame"], f"{row['size']:,}",
             f"{row['blocked_ms']:.1f}", ", ".join(sorted(set(row["replies"]))) or "-"]
            for row in rows]),
        table([["check", "result", "value"]] + [
            [c["check"], "pass" if c["ok"] else "**FAIL**", c["value"]] for c in checks])])


def _public_key(path: Path) -> bytes:
    for line in path.read_text().splitlines():
        if line.startswith("public"):
            return line.split('"')[1].encode()
    raise RuntimeError(f"no public key in {path}")


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # the finally blocks stop everything


if __name__ == "__main__":
    sys.exit(main())
