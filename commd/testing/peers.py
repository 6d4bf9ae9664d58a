"""Speaking to a daemon's peer port as a holder of its key: for tests and benchmarks that play
a peer daemon with a raw socket. A daemon started without ``--cluster-key`` uses the local key
beside its socket (``commd.daemon.key_files``); these helpers find and use it."""

from __future__ import annotations

from typing import Any

import zmq

from commd.daemon.key_files import ClusterKey, load_key, local_key
from commd.daemon.peer_security import connect_securely

__all__ = ["ClusterKey", "connect_peer", "socket_key"]


def socket_key(socket_path: str, key_file: str = "") -> ClusterKey:
    """The key of the daemon serving ``socket_path``: ``key_file`` if it was given one, else
    its local key (made now if no daemon has made it yet)."""
    if key_file:
        return load_key(key_file)
    return local_key(socket_path)[0]


def connect_peer(sock: zmq.Socket[Any], port: int, key: ClusterKey | None,
                 host: str = "127.0.0.1") -> None:
    """Connect ``sock`` (a DEALER) to the peer port at ``host:port`` as a key holder, as a
    peer daemon's link does; ``key`` None: without CurveZMQ (a stranger, or --insecure)."""
    if key is not None:
        connect_securely(sock, key)
    sock.connect(f"tcp://{host}:{port}")

