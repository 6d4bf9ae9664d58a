"""Fair shares: one local user filling what the daemon holds for it (ranks connected, jobs,
traces, buffers waiting for their register, hand-over connections) leaves another user's job
running exact; a job is its own user's (or root's) to join and trace; a trace is bounded.

The tests run as root; the other users are subprocesses that import what they need, then drop
to another uid before they connect (``drop`` below: the interpreter lives under /root, which
they could not read afterwards). They keep gid 0: they are users of the daemon's group, which
is how a node lets its users reach the daemon's 0660 socket. The daemon's socket is therefore
in a directory of this test's own that the group may enter (0750), not in pytest's 0700 one.
The caps are lowered on the running daemon, in the same proportions (a user's share below the
daemon's), so that filling them takes a handful of connections.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from commd.cli.status import render
from commd.daemon import handover, shares
from commd.daemon.server import Daemon
from commd.daemon.shares import Cap, Shares, peer_uid
from commd.testing.daemons import LocalDaemon
from commd_client import CommdError
from commd_client.host_buffer import HostBuffer
from commd_protocol.status import read_status, status_map

from inprocess import RawClient, coordinator_of, hello, still_serving

ATTACKER, VICTIM = 65534, 65533

# What each subprocess does first: import everything, then become ``spec["uid"]`` (gid 0).
PRELUDE = """
import json, os, socket, sys, threading
import msgpack, numpy as np, zmq
from commd_client import Client, CommdError
from commd_client.host_buffer import HostBuffer
spec = json.loads(sys.argv[1])
os.setgroups([])
os.setgid(0)
os.setuid(spec["uid"])
context = zmq.Context()

def dealer():
    link = context.socket(zmq.DEALER)
    link.setsockopt(zmq.LINGER, 0)
    link.setsockopt(zmq.RCVTIMEO, 20_000)  # a hang becomes a failure
    link.connect("ipc://" + spec["socket"])
    return link

def ask(link, message):
    link.send(msgpack.packb(message))
    return msgpack.unpackb(link.recv())

def hello(job, rank=0, world=1):
    return {"type": "hello", "protocol": spec["protocol"], "job": job, "rank": rank,
            "world_size": world, "local_rank": rank, "local_world_size": world,
            "coordinator": spec["coordinator"], "pid": os.getpid()}

def hand_over(buffer):
    try:
        return buffer.hand_over(spec["socket"] + ".buffers", 20.0)
    except CommdError as exc:
        return "refused: " + str(exc)
"""

# User A: takes its whole share of each kind, then one more of each, and holds it all until
# its stdin closes. Prints what each "one more" got.
ATTACK = PRELUDE + """
held, got = [], {}
for job in ("a-t0", "a-t1"):  # two running jobs of its own, to trace
    rank = dealer(); held.append(rank)
    assert ask(rank, hello(job))["type"] == "welcome"
    buffer = HostBuffer("a-" + job, 16); held.append(buffer)
    reply = ask(rank, {"type": "register", "dtype": "float32", "op": "sum", "planner": "wfbp",
                       "profile": False, "buffer_token": hand_over(buffer),
                       "layers": [{"name": "w", "size": 4}]})
    assert reply["type"] == "registered", reply
tracer = dealer(); held.append(tracer)
got["trace_3600"] = ask(tracer, {"type": "trace", "job": "a-t0", "timeout_s": 3600})
tracer.send(msgpack.packb({"type": "trace", "job": "a-t0", "timeout_s": 600}))
assert ask(tracer, {"type": "status"})["type"] == "status_reply"  # armed: it answers later
second = dealer(); held.append(second)
second.send(msgpack.packb({"type": "trace", "job": "a-t1", "timeout_s": 600}))
got["trace"] = ask(second, {"type": "status"})  # the refusal, or the status if it was armed
for job in ("a-j0", "a-j1"):  # jobs: a third of its own, then a fourth
    rank = dealer(); held.append(rank)
    got["job"] = ask(rank, hello(job, 0, 8))
for index in (1, 2, 3):  # sessions: ranks of a-j0 up to its share, then one more
    rank = dealer(); held.append(rank)
    got["session"] = ask(rank, hello("a-j0", index, 8))
for index in range(spec["pending"] + 1):  # buffers handed over, never registered
    buffer = HostBuffer("a-pending", 16); held.append(buffer)
    got["pending"] = hand_over(buffer)
for index in range(spec["connections"] + 1):  # silent connections; the last is answered
    link = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET); held.append(link)
    link.settimeout(20)
    link.connect(spec["socket"] + ".buffers")
got["connection"] = link.recv(512).decode()
print(json.dumps(got), flush=True)
sys.stdin.read()
"""

# User B: a two-node job, one rank on this daemon and one on another, traced on this node by
# its own user; prints what it got.
VICTIM_JOB = PRELUDE + """
registered, release = threading.Barrier(3, timeout=30), threading.Barrier(3, timeout=30)
out = {}

def rank(r):
    try:
        with Client(job="b", rank=r, world_size=2, local_rank=0, local_world_size=1,
                    coordinator=spec["coordinator"], socket=spec["sockets"][r],
                    timeout=30) as client:
            grads = client.register([("x", 3), ("y", 5)], dtype="float32", op="sum",
                                    planner="wfbp", profile=False)
            registered.wait()
            release.wait()
            out[r] = []
            for iteration in range(3):
                for index, grad in enumerate(grads):
                    grad[:] = (r + 1) * (iteration + 1) + index + np.arange(grad.size)
                for index in reversed(range(len(grads))):
                    client.ready(index)
                client.wait()
                out[r].append([grad.tolist() for grad in grads])
    except CommdError as exc:
        out[r] = str(exc)
        registered.abort(); release.abort()

threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
for thread in threads:
    thread.start()
try:
    registered.wait()
    tracer = dealer()
    tracer.send(msgpack.packb({"type": "trace", "job": "b", "iterations": 1, "timeout_s": 30}))
    assert ask(tracer, {"type": "status"})["type"] == "status_reply"  # armed
    release.wait()
    out["trace"] = msgpack.unpackb(tracer.recv())
except threading.BrokenBarrierError:
    pass
for thread in threads:
    thread.join()
print(json.dumps(out), flush=True)
"""

# Another user asks for root's job: to join it and to trace it.
INTRUDER = PRELUDE + """
out = {"hello": ask(dealer(), hello(spec["job"], 1, 2)),
       "trace": ask(dealer(), {"type": "trace", "job": spec["job"], "timeout_s": 10})}
print(json.dumps(out), flush=True)
"""


# The numbers: 64 silent connections to the buffer socket, held until stdin closes.
SILENT = PRELUDE + """
links = [socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in range(64)]
for link in links:
    link.settimeout(20)
    link.connect(spec["socket"] + ".buffers")
answers = [link.recv(512).decode() for link in links[spec["share"]:]]  # accepted in order
print(json.dumps({"refused": answers}), flush=True)
sys.stdin.read()
"""


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory other users of group 0 may enter, for the daemon's sockets."""
    folder = Path(tempfile.mkdtemp(prefix="commd-fair-", dir="/tmp"))
    folder.chmod(0o750)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def daemon_settings(shared_dir: Path) -> dict[str, Any]:
    return {"socket": str(shared_dir / "d.sock"), "timeout_s": 30}


@pytest.fixture
def small_caps(daemon: Daemon, monkeypatch: pytest.MonkeyPatch) -> dict[str, Cap]:
    """Each share lowered on the running daemon: (per daemon, per user), a user's below the
    daemon's, and the daemon's room beyond one user's enough for user B's two-rank job."""
    caps = {
        "sessions": (daemon._sessions.sessions_share, Cap("ranks connected", 7, 5, "end some")),
        "jobs": (daemon._sessions.jobs_share, Cap("jobs", 4, 3, "finish some")),
        "traces": (daemon._sessions.traces_share, Cap("traces running", 2, 1, "wait")),
        "pending": (daemon._buffers.pending_share,
                    Cap("buffers waiting for their register", 4, 2, "register first")),
        "connections": (daemon._buffers.connections_share,
                        Cap("open hand-over connections", 4, 2, "one buffer each")),
    }
    for share, cap in caps.values():
        monkeypatch.setattr(share, "cap", cap)
    # Only the per-user cap may protect user B: A's silent connections stay open for the test.
    monkeypatch.setattr(handover, "CONNECTION_S", 60.0)
    return {name: cap for name, (_, cap) in caps.items()}


async def start_as(uid: int, script: str, daemon: Daemon,
                   **extra: Any) -> asyncio.subprocess.Process:
    from commd_protocol import PROTOCOL_VERSION

    spec = {"uid": uid, "socket": daemon.settings.socket, "protocol": PROTOCOL_VERSION,
            "coordinator": coordinator_of(daemon), **extra}
    return await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, json.dumps(spec), stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)


async def result(process: asyncio.subprocess.Process) -> dict[str, Any]:
    """The one JSON line the subprocess prints (its stderr in the failure, if it prints none)."""
    assert process.stdout is not None and process.stderr is not None
    line = await asyncio.wait_for(process.stdout.readline(), 60)
    if not line:
        raise AssertionError((await process.stderr.read()).decode()[-3000:])
    parsed: dict[str, Any] = json.loads(line)
    return parsed


@pytest.fixture
async def processes() -> AsyncIterator[list[asyncio.subprocess.Process]]:
    """Subprocesses the test starts: stopped and reaped after it."""
    started: list[asyncio.subprocess.Process] = []
    yield started
    for process in started:
        if process.returncode is None:
            process.kill()
        await asyncio.wait_for(process.wait(), 20)


def per_user(cap: Cap, uid: int) -> str:
    return f"uid {uid} holds {cap.per_user} {cap.noun} already, the most one user may"


@pytest.fixture
def other_node(shared_dir: Path) -> Iterator[LocalDaemon]:
    """A second daemon (a `commd run` subprocess) beside the in-process one: its socket in the
    same directory, so it shares the in-process daemon's local key (a 2-node job on one host)."""
    other = LocalDaemon(shared_dir, "other", "--backend", "gloo")
    yield other
    other.stop()


async def test_one_user_at_its_caps_leaves_another_users_job_running_exact(
        daemon: Daemon, small_caps: dict[str, Cap], connect: Any, other_node: LocalDaemon,
        processes: list[asyncio.subprocess.Process]) -> None:
    attacker = await start_as(ATTACKER, ATTACK, daemon, pending=small_caps["pending"].per_user,
                              connections=small_caps["connections"].per_user)
    processes.append(attacker)
    got = await result(attacker)
    assert got["trace_3600"]["code"] == "limit" and "at most 600" in \
        got["trace_3600"]["message"], got
    for kind, reply in (("traces", got["trace"]), ("jobs", got["job"]),
                        ("sessions", got["session"])):
        assert reply["type"] == "error" and reply["code"] == "limit", (kind, reply)
        assert reply["message"].startswith("commd: ")
        assert per_user(small_caps[kind], ATTACKER) in reply["message"], (kind, reply)
    assert got["pending"].startswith("refused: commd: the daemon refused the gradient buffer")
    assert per_user(small_caps["pending"], ATTACKER) in got["pending"], got
    assert per_user(small_caps["connections"], ATTACKER) in got["connection"], got
    sessions, buffers = daemon._sessions, daemon._buffers
    assert sessions.sessions_share.held(ATTACKER) == small_caps["sessions"].per_user
    assert sessions.jobs_share.held(ATTACKER) == small_caps["jobs"].per_user
    assert sessions.traces_share.held(ATTACKER) == small_caps["traces"].per_user
    assert buffers.pending_share.held(ATTACKER) == small_caps["pending"].per_user
    assert buffers.connections_share.held(ATTACKER) == small_caps["connections"].per_user

    victim = await start_as(VICTIM, VICTIM_JOB, daemon,
                            sockets=[daemon.settings.socket, other_node.socket])
    processes.append(victim)
    out = await result(victim)
    for rank in ("0", "1"):
        assert isinstance(out[rank], list), out  # not an error
        for iteration, grads in enumerate(out[rank]):
            for index, (grad, size) in enumerate(zip(grads, (3, 5), strict=True)):
                expected = [3 * (iteration + 1) + 2 * (index + j) for j in range(size)]
                assert grad == expected, (rank, iteration, index)
    assert out["trace"]["type"] == "trace_reply" and out["trace"]["iterations"] == [0], out
    assert (out["trace"]["node_index"], out["trace"]["nodes"]) == (0, 2)  # a 2-node job

    # Root is capped per daemon only, and may trace any user's job.
    tracer = connect()
    await tracer.send({"type": "trace", "job": "a-t1", "timeout_s": 30})
    await still_serving(tracer)  # armed: no error came first
    assert sessions.traces_share.held(0) == 1
    assert attacker.stdin is not None
    attacker.stdin.close()
    assert await asyncio.wait_for(attacker.wait(), 20) == 0


async def test_a_job_is_its_own_users_to_join_and_trace(
        daemon: Daemon, connect: Any, processes: list[asyncio.subprocess.Process]) -> None:
    rank = connect()
    assert (await rank.ask(hello(job="mine", world=2, local_world=2,
                                 coordinator=coordinator_of(daemon))))["type"] == "welcome"
    intruder = await start_as(ATTACKER, INTRUDER, daemon, job="mine")
    processes.append(intruder)
    out = await result(intruder)
    for what in ("hello", "trace"):
        reply = out[what]
        assert reply["type"] == "error" and reply["code"] == "invalid", (what, reply)
        assert reply["message"].startswith("commd: job 'mine' belongs to uid 0, not to uid "
                                           f"{ATTACKER}: only its own user or root may"), reply
    (job,) = daemon.status().jobs
    assert job.job == "mine" and job.state == "forming"  # untouched: still one rank of two
    assert len(daemon.jobs["mine"].members.ranks) == 1


async def test_root_is_capped_per_daemon_only(daemon: Daemon, connect: Any,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(daemon._sessions.sessions_share, "cap", Cap("ranks connected", 3, 1, "x"))
    for index in range(3):  # over the per-user cap of 1: root is not held to it
        reply = await connect().ask(hello(job=f"r{index}"))
        assert reply["type"] == "welcome", reply
    reply = await connect().ask(hello(job="r3"))
    assert reply["code"] == "limit" and reply["message"] == (
        "commd: this daemon holds 3 ranks connected already, the most it holds for all users "
        "together; x"), reply


async def test_a_shares_count_follows_goodbyes(daemon: Daemon, connect: Any) -> None:
    clients: list[RawClient] = [connect() for _ in range(3)]
    for index, client in enumerate(clients):
        assert (await client.ask(hello(job=f"g{index}")))["type"] == "welcome"
    sessions = daemon._sessions
    assert (sessions.sessions_share.held(0), sessions.jobs_share.held(0)) == (3, 3)
    for client in clients:
        await client.send({"type": "goodbye"})
        await still_serving(client)
    assert (sessions.sessions_share.total, sessions.jobs_share.total) == (0, 0)
    assert daemon.jobs == {}


async def test_status_shows_each_users_share(daemon: Daemon, connect: Any) -> None:
    """`commd status --json` lists what each uid holds of every capped kind, and the text view
    names a user near its cap, before it is refused."""
    clients: list[RawClient] = [connect() for _ in range(2)]
    for index, client in enumerate(clients):
        assert (await client.ask(hello(job=f"s{index}")))["type"] == "welcome"
    travelled = read_status(status_map(daemon.status()))  # as `commd status` reads it
    by_kind = {share.kind: share for share in travelled.shares}
    assert set(by_kind) == {"ranks connected", "jobs", "traces running",
                            "buffers waiting for their register", "open hand-over connections"}
    assert (by_kind["ranks connected"].held, by_kind["ranks connected"].by_uid) == (2, {"0": 2})
    assert by_kind["jobs"].per_user == shares.JOBS.per_user
    assert not [line for line in render(travelled).splitlines() if "near a cap" in line]
    full = msgspec.structs.replace(by_kind["jobs"], held=2, by_uid={"1000": 2}, per_user=2)
    lines = render(msgspec.structs.replace(travelled, shares=[full])).splitlines()
    assert "near a cap: uid 1000 holds 2 of 2 jobs (per user)" in lines, lines
    for client in clients:
        await client.send({"type": "goodbye"})
        await still_serving(client)


@pytest.mark.parametrize(("address", "uid"), [
    ("localhost:1000:1000:4242", 1000),
    ("localhost:0:0:1", 0),
    ("some:host:with:colons:7:8:9", 7),
    (None, shares.UNKNOWN_UID),
    ("", shares.UNKNOWN_UID),
    ("127.0.0.1", shares.UNKNOWN_UID),  # a tcp peer: no credentials
    ("localhost:-1:0:1", shares.UNKNOWN_UID),
    ("localhost:x:0:1", shares.UNKNOWN_UID),
    ("a:1:2", shares.UNKNOWN_UID),
])
def test_the_peer_address_gives_the_uid_or_one_unknown_principal(address: str | None,
                                                                 uid: int) -> None:
    assert peer_uid(address) == uid


def test_an_unknown_principal_is_capped_like_a_user() -> None:
    share = Shares(Cap("things", 4, 2, "stop"))
    share.take(shares.UNKNOWN_UID)
    share.take(shares.UNKNOWN_UID)
    assert share.refusal(shares.UNKNOWN_UID) == (
        "a client whose uid could not be read holds 2 things already, the most one user may "
        "(of 4 on this daemon); stop")
    assert share.refusal(1000) == ""
    share.give(1000)  # never held: no effect, never negative
    assert (share.total, share.held(1000)) == (2, 0)


async def test_a_hand_over_refused_at_accept_hears_why(
        daemon: Daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    """Over the daemon's cap of connections, a rank gets the reason, not "Connection reset by
    peer": whether its buffer arrived before the refusal (read, then answered) or after
    (its send fails, the reason is still there to read)."""
    monkeypatch.setattr(daemon._buffers.connections_share, "cap",
                        Cap("open hand-over connections", 1, 1, "one buffer each"))
    monkeypatch.setattr(handover, "CONNECTION_S", 60.0)
    path = daemon.settings.socket + ".buffers"
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as silent:
        silent.connect(path)  # accepted first (in order): it holds the one connection
        buffer = HostBuffer("commd-test-refused", 16)
        try:
            for _ in range(5):  # either side of the race
                with pytest.raises(CommdError) as refused:
                    await asyncio.to_thread(buffer.hand_over, path, 10.0)
                assert str(refused.value) == (
                    "commd: the daemon refused the gradient buffer: this daemon holds 1 open "
                    "hand-over connections already, the most it holds for all users together; "
                    "one buffer each")
        finally:
            buffer.close()
    assert daemon._buffers.pending_share.total == 0


async def test_64_silent_connections_of_one_user_leave_anothers_hand_over_alone(
        daemon: Daemon, monkeypatch: pytest.MonkeyPatch,
        processes: list[asyncio.subprocess.Process]) -> None:
    """The daemon's own caps. The connections are held past the test (not closed after 1 s),
    so that only the per-user cap lets the other user in."""
    monkeypatch.setattr(handover, "CONNECTION_S", 60.0)
    share = shares.BUFFER_CONNECTIONS.per_user
    attacker = await start_as(ATTACKER, SILENT, daemon, share=share)
    processes.append(attacker)
    refused = (await result(attacker))["refused"]
    assert len(refused) == 64 - share
    assert all(per_user(shares.BUFFER_CONNECTIONS, ATTACKER) in answer for answer in refused)
    assert daemon._buffers.connections_share.held(ATTACKER) == share
    buffer = HostBuffer("commd-test-other-user", 16)
    try:
        token = await asyncio.to_thread(buffer.hand_over, daemon.settings.socket + ".buffers", 10)
        handed = daemon._buffers.claim(token)
        assert handed is not None and handed.uid == 0
        os.close(handed.fd)  # claimed: ours to close
    finally:
        buffer.close()
