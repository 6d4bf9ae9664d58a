"""CurveZMQ on the peer channel: the cluster key, and who may speak to this daemon.

Every node holds the same cluster key file (``commd keygen PATH``): one Curve25519 key pair,
used by the peer ROUTER as server and by every link to a coordinator as client. A ZAP
handler admits a connection only if its client key is the cluster's public key, so a peer
without the file fails the handshake and none of its frames is ever decoded. Traffic between
daemons is encrypted; Gloo's and NCCL's own data connections are not (docs/security.md).
Without ``--cluster-key`` the daemon uses the local key beside its socket (``key_files``), so
the loopback peer port is closed to local users who cannot read it; only ``--insecure``
serves peers with no key at all.
"""

from __future__ import annotations

import logging
from typing import Any

import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator

from commd.daemon.handshakes import HandshakeWatch
from commd.daemon.key_files import ClusterKey, KeyFileError, generate_key, load_key, local_key

__all__ = ["ClusterKey", "KeyFileError", "PeerSecurity", "connect_securely", "generate_key",
           "load_key", "serve_securely"]

log = logging.getLogger("commd.security")


class ClusterOnly:
    """The ZAP credentials check: only the cluster's own key is let in."""

    def __init__(self, key: ClusterKey) -> None:
        self._key = key.public

    def callback(self, domain: str, client_key: bytes) -> bool:
        # Refusals are counted (and logged) from the socket monitor, with every other kind.
        return client_key == self._key


def start_authenticator(context: zmq.asyncio.Context, key: ClusterKey) -> AsyncioAuthenticator:
    """The context's ZAP handler, before any socket of it binds or connects."""
    authenticator = AsyncioAuthenticator(context)
    authenticator.start()
    authenticator.configure_curve_callback(domain="*", credentials_provider=ClusterOnly(key))
    return authenticator


class PeerSecurity:
    """This daemon's cluster key, the ZAP handler that admits only its holders, and the count
    of every handshake refused on the peer port."""

    def __init__(self) -> None:
        self._authenticator: AsyncioAuthenticator | None = None
        self.handshakes = HandshakeWatch()
        self.key_path = ""  # the key file in use ("": none, --insecure)

    def start(self, context: zmq.asyncio.Context, key_file: str, socket_path: str,
              insecure: bool) -> ClusterKey | None:
        """The key: ``key_file`` if given; else none with ``insecure``; else the local key
        beside ``socket_path`` (made if absent). KeyFileError if it cannot be used."""
        if key_file:
            key = load_key(key_file)
            self.key_path = key_file
            log.info("peers authenticated and encrypted with the cluster key %s", key_file)
        elif insecure:
            log.warning("no cluster key (--insecure): anyone who reaches the peer port can "
                        "join, read and abort this node's jobs")
            return None
        else:
            key, self.key_path = local_key(socket_path)
            log.info("peers authenticated with the local key %s (shared by the daemons whose "
                     "sockets are in its directory; --cluster-key for a cluster)", self.key_path)
        self._authenticator = start_authenticator(context, key)
        return key

    def watch(self, peers: zmq.asyncio.Socket) -> None:
        """Count the handshakes ``peers`` refuses (call before it binds)."""
        self.handshakes.start(peers)

    @property
    def refused(self) -> int:
        """Handshakes refused on the peer port, every reason."""
        return self.handshakes.total

    @property
    def refused_by_reason(self) -> dict[str, int]:
        return self.handshakes.refused

    async def stop(self) -> None:
        await self.handshakes.close()
        if self._authenticator is not None:
            self._authenticator.stop()
            self._authenticator = None


def serve_securely(socket: zmq.Socket[Any], key: ClusterKey) -> None:
    """The peer ROUTER speaks CurveZMQ as the server (before bind)."""
    socket.curve_secretkey = key.secret
    socket.curve_publickey = key.public
    socket.curve_server = True


def connect_securely(socket: zmq.Socket[Any], key: ClusterKey) -> None:
    """A link to a coordinator speaks CurveZMQ as a client of the same key (before connect)."""
    socket.curve_secretkey = key.secret
    socket.curve_publickey = key.public
    socket.curve_serverkey = key.public
