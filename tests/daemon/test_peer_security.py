"""The peer channel speaks only to holders of the cluster key; without a key nothing listens
beyond loopback; the rendezvous store is bound to one address and a job's keys hide under a
random prefix."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
import zmq.asyncio

from commd.daemon.peer_security import KeyFileError, generate_key, load_key
from commd.daemon.server import Daemon
from commd.daemon.settings import Settings
from commd.testing.ranks import (
    JobSpec,
    assert_exact,
    await_registered,
    collect,
    daemon_status,
    start_ranks,
)
from commd_protocol import PROTOCOL_VERSION

LAYERS = [("conv.weight", 27), ("conv.bias", 3), ("fc.weight", 130)]


@pytest.fixture
def key_file(tmp_path: Path) -> str:
    path = str(tmp_path / "cluster.key")
    generate_key(path)
    return path


# --- the key file ----------------------------------------------------------------------------


def test_keygen_writes_a_private_key_that_loads(tmp_path: Path) -> None:
    path = tmp_path / "k"
    done = subprocess.run([sys.executable, "-m", "commd.cli", "keygen", str(path)],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert os.stat(path).st_mode & 0o777 == 0o600
    key = load_key(str(path))
    assert len(key.public) == len(key.secret) == 40
    again = subprocess.run([sys.executable, "-m", "commd.cli", "keygen", str(path)],
                           capture_output=True, text=True, timeout=30)
    assert again.returncode == 1 and "never overwritten" in again.stderr
    assert load_key(str(path)) == key  # untouched


@pytest.mark.parametrize(("content", "mode", "words"), [
    (None, 0o640, "can be read by others"),
    ("not toml at all [", 0o600, "not a commd cluster key"),
    ('public = "x"\nsecret = "y"\n', 0o600, "40 Z85 characters"),
    ("", 0o600, "needs 'public' and 'secret'"),
    ("swap", 0o600, "is not the secret key's"),
], ids=["too-open", "garbage", "short", "empty", "mismatched"])
def test_a_bad_key_file_is_refused_naming_the_problem(
        tmp_path: Path, key_file: str, content: str | None, mode: int, words: str) -> None:
    path = tmp_path / "bad.key"
    text = Path(key_file).read_text()
    if content == "swap":  # another key's public half
        other = tmp_path / "other.key"
        generate_key(str(other))
        public = re.search(r'public = "(.*)"', other.read_text())
        assert public is not None
        content = re.sub(r'public = ".*"', f'public = "{public.group(1)}"', text)
    path.write_text(text if content is None else content)
    path.chmod(mode)
    with pytest.raises(KeyFileError, match=re.escape(words)):
        load_key(str(path))


# --- protected mode --------------------------------------------------------------------------


def test_without_a_key_the_default_is_loopback(key_file: str) -> None:
    assert Settings().peer_listen == "127.0.0.1:29600"
    assert Settings(cluster_key=key_file).peer_listen == "0.0.0.0:29600"
    assert Settings().exposure_problem() == ""
    assert "no cluster key" in Settings(listen="0.0.0.0:29600").exposure_problem()
    assert Settings(listen="0.0.0.0:29600", insecure=True).exposure_problem() == ""
    assert Settings(listen="[::1]:29600").exposure_problem() == ""


def test_a_public_listen_without_a_key_is_refused_in_one_line(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "commd.cli", "run", "--backend", "gloo", "--socket",
         str(tmp_path / "d.sock"), "--listen", "0.0.0.0:0"],
        capture_output=True, text=True, timeout=30)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("commd: --listen 0.0.0.0:0"), done.stderr
    assert "commd keygen" in lines[0] and "--insecure" in lines[0]
    assert not (tmp_path / "d.sock").exists()


def test_insecure_and_keyed_daemons_start_on_every_interface(start_daemon, key_file: str) -> None:
    for extra in (("--insecure",), ("--cluster-key", key_file)):
        daemon = start_daemon("--listen", "0.0.0.0:0", *extra)
        assert daemon_status(daemon.socket)["listen"].startswith("0.0.0.0:")


def test_an_unreadable_key_file_fails_the_start(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "commd.cli", "run", "--backend", "gloo", "--socket",
         str(tmp_path / "d.sock"), "--listen", "127.0.0.1:0", "--cluster-key",
         str(tmp_path / "missing.key")],
        capture_output=True, text=True, timeout=30)
    assert done.returncode == 1 and "cannot read the cluster key" in done.stderr, done.stderr


# --- a real job among key holders, attacked by peers without the key ------------------------


def attack(port: int, frames: list[dict[str, Any]], key: Any = None) -> None:
    """Send ``frames`` to a peer port as a raw DEALER (CurveZMQ with ``key``'s pair if given,
    which is then not the cluster's)."""
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 2000)
    if key is not None:
        public, secret = zmq.curve_keypair()
        sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = public, secret, key
    # A refused handshake can drop the connection's pipe before a frame is queued, and a
    # DEALER without a pipe blocks in send: give up on a frame after a while, as an attacker
    # the daemon never let in would.
    sock.setsockopt(zmq.SNDTIMEO, 2000)
    sock.connect(f"tcp://127.0.0.1:{port}")
    for frame in frames:
        with contextlib.suppress(zmq.Again):
            sock.send(msgpack.packb(frame))
    sock.close()
    context.term()


def test_peers_without_the_key_cannot_abort_join_or_stall_a_job(
        start_daemon, key_file: str, tmp_path: Path) -> None:
    nodes = [start_daemon("--cluster-key", key_file) for _ in range(2)]
    spec = JobSpec("secure", nodes, 2, LAYERS, iterations=200, timeout=60)
    processes = start_ranks(spec)
    await_registered(processes)  # the job runs: now the attackers come
    hostile = [
        {"type": "peer_abort", "job": "secure", "code": "engine", "message": "pwned"},
        {"type": "peer_join", "protocol": PROTOCOL_VERSION, "job": "secure", "ranks": [0],
         "world_size": 4, "layers": [{"name": n, "size": s} for n, s in LAYERS],
         "dtype": "float32", "op": "sum", "planner": "wfbp", "host": "127.0.0.1"},
    ]
    cluster_public = load_key(key_file).public
    for node in nodes:
        attack(node.port, hostile)  # no CurveZMQ at all
        attack(node.port, hostile, key=cluster_public)  # CurveZMQ with another key pair
    assert_exact(spec, collect(processes))
    refused = [daemon_status(node.socket)["peer_handshakes_refused"] for node in nodes]
    assert all(count >= 1 for count in refused), refused  # the second attacker, each node


# --- the rendezvous store --------------------------------------------------------------------


def listening_addresses(port: int) -> set[str]:
    """Local addresses with a TCP socket listening on ``port`` (from /proc/net/tcp*)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.rsplit(":", 1)
            if state == "0A" and int(hex_port, 16) == port:
                found.add(address)
    return found


@pytest.fixture
def daemon_settings(key_file: str) -> dict[str, Any]:
    """The in-process daemon of this module listens on every interface, with a key."""
    return {"listen": "0.0.0.0:0", "cluster_key": key_file}


async def test_the_store_listens_on_one_address_under_a_secret_prefix(
        daemon: Daemon, key_file: str) -> None:
    key = load_key(key_file)
    context = zmq.asyncio.Context()
    peers = []
    for _ in range(2):
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = \
            key.public, key.secret, key.public
        sock.connect(f"tcp://127.0.0.1:{daemon.peer_port}")
        peers.append(sock)
    try:
        setups = []
        for job in ("a", "b"):
            for rank, sock in enumerate(peers):
                await sock.send(msgpack.packb({
                    "type": "peer_join", "protocol": PROTOCOL_VERSION, "job": job,
                    "ranks": [rank], "world_size": 2, "layers": [{"name": "w", "size": 4}],
                    "dtype": "float32", "op": "sum", "planner": "wfbp", "host": "127.0.0.1"}))
            for sock in peers:
                setups.append(msgpack.unpackb(await asyncio.wait_for(sock.recv(), 10)))
        assert all(s["type"] == "peer_setup" for s in setups), setups
        prefixes = {s["job"]: s["store_prefix"] for s in setups}
        assert all(re.fullmatch(r"[0-9a-f]{32}", p) for p in prefixes.values()), prefixes
        assert prefixes["a"] != prefixes["b"]
        port = setups[0]["store_port"]
        # 0100007F is 127.0.0.1 in /proc's byte order: the address that routes to the peers,
        # never 0.0.0.0 (00000000), although the peer port listens on every interface.
        assert listening_addresses(port) == {"0100007F"}
    finally:
        for sock in peers:
            sock.close(linger=0)
        context.term()
