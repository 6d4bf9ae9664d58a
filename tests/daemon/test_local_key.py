"""Without --cluster-key a daemon still speaks only to key holders: the local key beside its
socket, made once and shared by the daemons of that directory; key files are checked before
they are read; every refused handshake is counted by reason; a socket this user may not open
is reported as such."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
import zmq.asyncio

from commd.cli.status import query
from commd.cli.trace import request_traces
from commd.daemon.handshakes import REASONS, HandshakeCounts
from commd.daemon.key_files import (
    MAX_KEY_FILE_BYTES,
    KeyFileError,
    load_key,
    local_key,
    local_key_path,
)
from commd.daemon.server import Daemon
from commd.testing.daemons import LocalDaemon, workdir_key
from commd.testing.peers import connect_peer, socket_key
from commd.testing.ranks import JobSpec, assert_exact, collect, daemon_status, start_ranks
from commd_client.connection import Connection
from commd_protocol import PROTOCOL_VERSION

from inprocess import peer_dealer
from polling import until, until_sync

LAYERS = [("conv.weight", 27), ("conv.bias", 3), ("fc.weight", 130)]
STRANGER_UID = 65534  # nobody: not the daemon's user, not in its group
WAIT_S = 30.0  # bounds every wait for a count; a hang becomes a failure


def peer_join(job: str, ranks: list[int], world: int,
              layers: list[tuple[str, int]] = LAYERS) -> bytes:
    return msgpack.packb({
        "type": "peer_join", "protocol": PROTOCOL_VERSION, "job": job, "ranks": ranks,
        "world_size": world, "layers": [{"name": n, "size": s} for n, s in layers],
        "dtype": "float32", "op": "sum", "planner": "wfbp", "host": "127.0.0.1"})


def refused_by(status: dict[str, Any]) -> dict[str, int]:
    return {reason: status.get("peer_handshakes_refused_by", {}).get(reason, 0)
            for reason in REASONS}


def failed_start(*extra: str, socket_path: Path) -> str:
    """`commd run` that must fail at start, within a timeout (a hang is a failure): its one
    error line (the lines before it are the settings it logged), after checking there is one
    and no traceback; the socket is not left behind."""
    done = subprocess.run(
        [sys.executable, "-m", "commd.cli", "run", "--backend", "gloo", "--socket",
         str(socket_path), "--listen", "127.0.0.1:0", *extra],
        capture_output=True, text=True, timeout=30)
    errors = [line for line in done.stderr.splitlines() if line.startswith("commd: ")]
    assert done.returncode == 1 and len(errors) == 1, done.stderr
    assert "Traceback" not in done.stderr and done.stderr.strip().endswith(errors[0])
    assert not socket_path.exists()
    return errors[0]


# --- key files are checked before a byte is read ---------------------------------------------


def make_fifo(path: Path) -> str:
    os.mkfifo(path, 0o600)
    return str(path)


def make_big(path: Path) -> str:
    path.write_bytes(b"#" * (MAX_KEY_FILE_BYTES + 1))
    path.chmod(0o600)
    return str(path)


def make_dir(path: Path) -> str:
    path.mkdir(mode=0o700)
    return str(path)


@pytest.mark.parametrize(("make", "words"), [
    (make_fifo, "is a FIFO, not a regular file"),
    (lambda _: "/dev/zero", "is a character device, not a regular file"),
    (make_dir, "is a directory, not a regular file"),
    (make_big, f"{MAX_KEY_FILE_BYTES + 1} bytes, more than a key file"),
], ids=["fifo", "dev-zero", "directory", "too-big"])
def test_a_key_that_is_not_a_small_regular_file_fails_the_start_at_once(
        tmp_path: Path, make: Callable[[Path], str], words: str) -> None:
    """A FIFO used to hang the start with no word, /dev/zero to end in a MemoryError."""
    key = make(tmp_path / "key")
    line = failed_start("--cluster-key", key, socket_path=tmp_path / "d.sock")
    assert line.startswith(f"commd: the cluster key {key} ") and words in line, line


# --- the local key ---------------------------------------------------------------------------


def test_the_first_daemon_makes_the_local_key_and_the_next_one_shares_it(
        start_daemon, tmp_path: Path) -> None:
    """Two daemons whose sockets share a directory need no flag to run an exact job."""
    first = start_daemon()
    path = tmp_path / "cluster.key"
    info = os.stat(path)
    assert stat.S_ISREG(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o640
    assert info.st_uid == os.geteuid()
    text = path.read_text()
    second = start_daemon()
    assert path.read_text() == text  # loaded, not remade
    assert local_key_path(first.socket) == local_key_path(second.socket) == str(path)
    assert workdir_key(tmp_path) == str(path)
    spec = JobSpec("local-key", [first, second], 1, LAYERS, iterations=3)
    assert_exact(spec, collect(start_ranks(spec)))
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".cluster.key.")]  # no temps


def test_daemons_starting_together_agree_on_one_key(tmp_path: Path) -> None:
    """Each writes a whole file and links it: one wins, the others load the winner's."""
    socket_path = str(tmp_path / "run" / "d.sock")
    start = threading.Barrier(8)
    keys: list[Any] = []

    def race() -> None:
        start.wait(timeout=WAIT_S)
        keys.append(local_key(socket_path)[0])

    threads = [threading.Thread(target=race) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT_S)
    assert len(keys) == 8 and len(set(keys)) == 1
    assert local_key(socket_path)[0] == keys[0]
    assert os.listdir(tmp_path / "run") == ["cluster.key"]  # no temporary file left


def test_a_local_key_readable_by_group_is_not_an_explicit_key(tmp_path: Path) -> None:
    """--cluster-key keeps its rule (0600); the local key may be 0640 or 0600."""
    key, path = local_key(str(tmp_path / "d.sock"))
    with pytest.raises(KeyFileError, match="can be read by others"):
        load_key(path)
    os.chmod(path, 0o600)
    assert load_key(path) == key == local_key(str(tmp_path / "d.sock"))[0]


def chown_stranger(path: Path) -> None:
    os.chown(path, STRANGER_UID, STRANGER_UID)


@pytest.mark.parametrize(("spoil", "words"), [
    (lambda p: p.chmod(0o644), "has mode 0644: others could read or change it; chmod 640"),
    (lambda p: p.chmod(0o660), "has mode 0660"),
    (chown_stranger, f"belongs to uid {STRANGER_UID}, not to this daemon's"),
    (lambda p: (p.unlink(), p.symlink_to(p.with_name("elsewhere.key"))), "is a symbolic link"),
    (lambda p: (p.unlink(), os.mkfifo(p, 0o600)), "is a FIFO, not a regular file"),
    (lambda p: p.write_text("garbage [", encoding="ascii"), "is not a commd cluster key"),
], ids=["world-readable", "group-writable", "another-owner", "symlink", "fifo", "garbage"])
def test_a_local_key_that_others_could_have_made_or_read_fails_the_start(
        tmp_path: Path, spoil: Callable[[Path], Any], words: str) -> None:
    path = tmp_path / "cluster.key"
    (tmp_path / "elsewhere.key").write_text("")
    local_key(str(tmp_path / "d.sock"))
    spoil(path)
    line = failed_start(socket_path=tmp_path / "d.sock")
    assert line.startswith((f"commd: the local cluster key {path}", f"commd: {path} is not"))
    assert words in line, line


def test_insecure_uses_no_key_at_all(start_daemon, tmp_path: Path) -> None:
    """--insecure is what it was: nothing protects the peer port (documented as such)."""
    daemon = start_daemon("--insecure")
    assert not (tmp_path / "cluster.key").exists()
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        connect_peer(sock, daemon.port, None)
        sock.send(peer_join("open", [0], 1, [("w", 4)]))
        assert sock.poll(int(WAIT_S * 1000)), "an insecure daemon answers anyone"
        assert msgpack.unpackb(sock.recv())["type"] == "peer_setup"
    finally:
        sock.close()
        context.term()


# --- strangers on the loopback peer port ------------------------------------------------------


def test_a_strangers_join_for_a_forming_job_gets_nothing_and_the_job_runs_exact(
        start_daemon, tmp_path: Path) -> None:
    """The finding: with no --cluster-key a local process sent `peer_join` for node 1's ranks
    to the loopback peer port, got `peer_setup` (with the store prefix) as node 1 once node 0
    joined, and the real job failed. Now its handshake fails and nothing of it is decoded."""
    nodes = [start_daemon(), start_daemon()]
    coordinator = nodes[0]
    before = refused_by(daemon_status(coordinator.socket))
    context = zmq.Context()
    stranger = context.socket(zmq.DEALER)  # ZeroMQ without the key
    stranger.setsockopt(zmq.LINGER, 0)
    raw = socket.create_connection(("127.0.0.1", coordinator.port), timeout=WAIT_S)
    try:
        connect_peer(stranger, coordinator.port, None)
        stranger.send(peer_join("forming", [1], 2))
        raw.sendall(peer_join("forming", [1], 2))  # the same bytes without ZeroMQ at all
        # A keyless ZeroMQ peer is counted as no_key, or as garbage if it hangs up first
        until_sync(lambda: sum(refused_by(daemon_status(coordinator.socket)).values())
                   >= sum(before.values()) + 2, "both strangers refused", WAIT_S, poll_s=0.05)
        spec = JobSpec("forming", nodes, 1, LAYERS, iterations=3)
        assert_exact(spec, collect(start_ranks(spec)))
        # The job formed long ago: a setup for the stranger would have arrived by now.
        assert not stranger.poll(0), msgpack.unpackb(stranger.recv())
        got = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := raw.recv(4096):  # the daemon hung up on it: this ends
                got += chunk
        # ZeroMQ's greeting (10 bytes of signature and version, then the mechanism) at most
        assert len(got) <= 64 and b"peer_setup" not in got, got
    finally:
        raw.close()
        stranger.close()
        context.term()
    status = daemon_status(coordinator.socket)
    assert status["peer_handshakes_refused"] == sum(refused_by(status).values())


@pytest.fixture
def daemon_settings() -> dict[str, Any]:
    return {"timeout_s": 60}  # the in-process daemon: no --cluster-key, so its local key


async def test_a_keyless_strangers_joins_fill_no_forming_slot(daemon: Daemon) -> None:
    """8 connections x 32 joins used to fill all 256 forming slots for ``timeout_s``."""
    context = zmq.asyncio.Context()
    strangers = []
    key_holder = peer_dealer(context, daemon)
    try:
        for connection in range(8):
            sock = context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            connect_peer(sock, daemon.peer_port, None)
            strangers.append(sock)
            for job in range(32):
                # Never blocking: once the refused handshake tears the connection's pipe down,
                # a DEALER with no pipe would wait in send() for ever.
                with contextlib.suppress(zmq.Again):
                    await sock.send(peer_join(f"fill-{connection}-{job}", [0], 2, [("w", 4)]),
                                    zmq.NOBLOCK)
        await until(lambda: daemon.status().peer_handshakes_refused >= 8,
                    "8 refused handshakes", WAIT_S)
        assert daemon._coordinator.status() == []  # nothing forming
        await key_holder.send(peer_join("mine", [0], 1, [("w", 4)]))
        while True:
            reply = msgpack.unpackb(await asyncio.wait_for(key_holder.recv(), WAIT_S))
            if reply["type"] != "peer_status":
                break
        assert reply["type"] == "peer_setup" and reply["job"] == "mine", reply
    finally:
        for sock in [*strangers, key_holder]:
            sock.close(linger=0)
        context.term()


# --- every refused handshake, counted by reason ----------------------------------------------


# A ZMTP 3.0 greeting for the NULL mechanism: signature, version, mechanism, as-server, filler.
NULL_GREETING = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + bytes(32)


def attempt(port: int, reason: str, cluster: Any, counted: Callable[[], int]) -> None:
    """One stranger of each kind: what it does to the peer port, until ``counted()``."""
    if reason in ("garbage", "no_key"):
        # A keyless ZeroMQ socket hangs up itself on reading the daemon's mechanism, which can
        # come before the daemon reads its greeting (then it is garbage): this one waits.
        with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as raw:
            raw.sendall(NULL_GREETING if reason == "no_key" else b"GET / HTTP/1.1\r\n\r\n")
            until_sync(lambda: counted() > 0, f"a {reason} refusal", WAIT_S, poll_s=0.05)
        return
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    # One try: a reconnection cut short by our close would be counted as garbage (rightly)
    sock.setsockopt(zmq.RECONNECT_IVL, -1)
    public, secret = zmq.curve_keypair()
    if reason == "wrong_server_key":
        sock.curve_publickey, sock.curve_secretkey = public, secret
        sock.curve_serverkey = zmq.curve_keypair()[0]
    elif reason == "wrong_client_key":
        sock.curve_publickey, sock.curve_secretkey = public, secret
        sock.curve_serverkey = cluster.public
    sock.connect(f"tcp://127.0.0.1:{port}")
    sock.send(peer_join("counted", [0], 1, [("w", 4)]))
    try:
        until_sync(lambda: counted() > 0, f"a {reason} refusal", WAIT_S, poll_s=0.05)
    finally:
        sock.close()
        context.term()


def test_every_kind_of_refused_handshake_is_counted_under_its_reason(
        start_daemon, tmp_path: Path) -> None:
    """Only the ZAP refusals (a wrong client key) used to be counted."""
    node = start_daemon("--metrics-listen", "127.0.0.1:0")
    cluster = socket_key(node.socket)
    counted: dict[str, int] = {}
    for reason in REASONS:
        before = refused_by(daemon_status(node.socket))

        def count(reason: str = reason, before: dict[str, int] = before) -> int:
            return refused_by(daemon_status(node.socket))[reason] - before[reason]

        attempt(node.port, reason, cluster, count)
        after = refused_by(daemon_status(node.socket))
        others = {r: after[r] - before[r] for r in REASONS if r != reason}
        assert others == dict.fromkeys(others, 0), (reason, others)
        counted[reason] = after[reason] - before[reason]
    assert all(n >= 1 for n in counted.values()), counted
    status = daemon_status(node.socket)
    assert status["peer_handshakes_refused"] == sum(refused_by(status).values())
    assert status["peer_handshakes_refused"] >= len(REASONS)
    assert "Traceback" not in node.log()
    final = refused_by(daemon_status(node.socket))
    assert scraped_reasons(node) == final
    shown = subprocess.run([sys.executable, "-m", "commd.cli", "status", "--socket", node.socket],
                           capture_output=True, text=True, timeout=30, check=True).stdout
    assert f"peer handshakes refused {sum(final.values())} (" in shown, shown
    assert all(f"{reason} {number}" in shown for reason, number in final.items()), shown


def scraped_reasons(node: LocalDaemon) -> dict[str, int]:
    """``commd_peer_handshakes_refused_by_reason_total`` per reason, from /metrics."""
    ready = next(n for n in node.notifications if "metrics on" in n)
    match = re.search(r"metrics on (\S+:\d+)", ready)
    assert match, ready
    with urllib.request.urlopen(f"http://{match.group(1)}/metrics", timeout=WAIT_S) as reply:
        text = reply.read().decode()
    found = re.findall(r'^commd_peer_handshakes_refused_by_reason_total\{reason="(\w+)"\} '
                       r"(\S+)$", text, re.MULTILINE)
    return {reason: int(float(number)) for reason, number in found}


def test_the_counts_match_verdicts_to_connections() -> None:
    """The monitor's verdicts carry no descriptor: a protocol failure belongs to the next
    disconnection, a success or a ZAP refusal to the oldest connection in its handshake,
    a disconnection with no verdict is garbage; a guess undone later keeps totals right."""
    counts = HandshakeCounts()
    feed = [(zmq.EVENT_ACCEPTED, 10), (zmq.EVENT_ACCEPTED, 11), (zmq.EVENT_ACCEPTED, 12),
            (zmq.EVENT_HANDSHAKE_SUCCEEDED, 0),  # 12's, guessed 10's
            (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH),
            (zmq.EVENT_DISCONNECTED, 10),  # its failure: the guess is moved on to 11
            (zmq.EVENT_ACCEPTED, 13),
            (zmq.EVENT_HANDSHAKE_FAILED_AUTH, 400),  # 13's, guessed 12's
            (zmq.EVENT_DISCONNECTED, 13),  # no verdict on record: counted as garbage...
            (zmq.EVENT_DISCONNECTED, 11),  # ...and 11, a success, is not counted again
            (zmq.EVENT_ACCEPTED, 14), (zmq.EVENT_DISCONNECTED, 14),  # raw TCP: garbage
            (zmq.EVENT_DISCONNECTED, 12),  # the success closes: nothing
            (zmq.EVENT_ACCEPTED, 15),
            (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC),
            (zmq.EVENT_DISCONNECTED, 15),
            (zmq.EVENT_ACCEPTED, 16), (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, 104),
            (zmq.EVENT_DISCONNECTED, 16)]
    for event, value in feed:
        counts.on_event(event, value)
    assert counts.refused == {"no_key": 1, "wrong_server_key": 1, "wrong_client_key": 1,
                              "garbage": 3}
    assert counts.total == 6


# --- a socket this user may not open ----------------------------------------------------------


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory others may enter (pytest's own are 0700), removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="commd-perm-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def as_stranger(probe: Callable[[], str]) -> str:
    """``probe()`` in a child that dropped to uid/gid 65534 (the tests run as root, which any
    mode lets in): what it returned, or the exception it raised, as text."""
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(STRANGER_UID)
            os.setuid(STRANGER_UID)
            try:
                said = probe()
            except Exception as exc:  # the answer is the exception's text
                said = f"{type(exc).__name__}: {exc}"
            os.write(write, said.encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        said = pipe.read().decode()
    os.waitpid(child, 0)
    return said


def test_a_socket_this_user_may_not_open_is_reported_as_permission_denied(
        shared_dir: Path) -> None:
    """It used to look like a daemon that never answers ("no daemon answered ...")."""
    node = LocalDaemon(shared_dir, "perm", "--backend", "gloo")
    try:
        client = as_stranger(lambda: str(Connection(node.socket)))
        status = as_stranger(lambda: str(query(node.socket, timeout_s=2)))
        trace = as_stranger(lambda: str(request_traces([node.socket], "j", 1, 2.0)))
        key = as_stranger(lambda: Path(local_key_path(node.socket)).read_text())
    finally:
        node.stop()
    for said in (client, status, trace):
        assert "commd: permission denied on the daemon socket" in said, said
        assert "mode 0660" in said and f"uid {STRANGER_UID}" in said, said
    assert key.startswith("PermissionError"), "a stranger read the local key"


def test_a_socket_in_a_directory_this_user_may_not_enter_is_permission_denied(
        shared_dir: Path) -> None:
    """A socket in a directory the user may not search (0700, like a daemon's runtime
    directory) looked absent: "no daemon socket". It is there; the user may not reach it."""
    private = shared_dir / "private"
    private.mkdir(mode=0o700)
    node = LocalDaemon(private, "hidden", "--backend", "gloo")
    try:
        said = [as_stranger(lambda: str(Connection(node.socket))),
                as_stranger(lambda: str(query(node.socket, timeout_s=2))),
                as_stranger(lambda: str(request_traces([node.socket], "j", 1, 2.0)))]
    finally:
        node.stop()
    for line in said:
        assert f"commd: permission denied on the directory {private} " in line, line
        assert "no daemon socket" not in line, line
