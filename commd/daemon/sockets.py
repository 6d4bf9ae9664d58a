"""The daemon's two listening sockets, bound once at start, and the address it advertises."""

from __future__ import annotations

import errno
import os
import socket as pysocket
from collections.abc import Callable

import zmq
import zmq.asyncio

from commd.daemon.peer_security import ClusterKey, serve_securely
from commd_protocol import MAX_MESSAGE_BYTES

CLIENT_FRAME_CAP = 64 * 1024 * 1024  # a hard cap on a client frame; over 4 MiB is refused typed
# A peer frame carries at most a join (the layers of a register, itself at most 4 MiB): a
# bigger one drops the connection before any of it is buffered (no one to answer, typed).
PEER_FRAME_CAP = MAX_MESSAGE_BYTES + 64 * 1024


class StartupError(Exception):
    """The daemon cannot start; the message says why and what to do."""


def bind_clients(context: zmq.asyncio.Context, path: str) -> zmq.asyncio.Socket:
    """The ROUTER the node's training processes talk to, on an ipc socket at ``path``."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    if os.path.exists(path):
        if _socket_answers(path):
            raise StartupError(f"commd: another daemon is serving {path}; stop it or pass --socket")
        os.unlink(path)  # left over from a daemon that died
    clients = context.socket(zmq.ROUTER)
    clients.setsockopt(zmq.LINGER, 0)
    clients.setsockopt(zmq.MAXMSGSIZE, CLIENT_FRAME_CAP)
    clients.bind(f"ipc://{path}")
    os.chmod(path, 0o660)
    return clients


def bind_peers(context: zmq.asyncio.Context, host: str, port: int, key: ClusterKey | None,
               watch: Callable[[zmq.asyncio.Socket], None] | None = None,
               ) -> tuple[zmq.asyncio.Socket, int]:
    """The ROUTER peer daemons talk to (CurveZMQ with a cluster key), and its port (a random
    one for port 0); ``watch`` sees it before it binds (the handshake counter's monitor)."""
    peers = context.socket(zmq.ROUTER)
    peers.setsockopt(zmq.LINGER, 0)
    peers.setsockopt(zmq.MAXMSGSIZE, PEER_FRAME_CAP)
    if key is not None:
        serve_securely(peers, key)
    if watch is not None:
        watch(peers)
    try:
        if port == 0:
            port = peers.bind_to_random_port(f"tcp://{host}")
        else:
            peers.bind(f"tcp://{host}:{port}")
    except zmq.ZMQError as exc:
        peers.close()
        raise StartupError(
            f"commd: cannot listen for peers on {host}:{port}: {exc}; pass --listen"
        ) from None
    return peers, port


def _socket_answers(path: str) -> bool:
    probe = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError as exc:
        return exc.errno not in (errno.ECONNREFUSED, errno.ENOENT)
    finally:
        probe.close()
    return True


def route_source(host: str) -> str:
    """The local address the kernel would use to reach ``host`` (no packet is sent)."""
    probe = pysocket.socket(pysocket.AF_INET, pysocket.SOCK_DGRAM)
    try:
        probe.connect((host, 9))
        return str(probe.getsockname()[0])
    except OSError:
        return "127.0.0.1"
    finally:
        probe.close()
