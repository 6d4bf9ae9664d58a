"""CurveZMQ on the peer channel: the cluster key, and who may speak to this daemon.

Every node holds the same cluster key file (``commd keygen PATH``): one Curve25519 key pair,
used by the peer ROUTER as server and by every link to a coordinator as client. A ZAP
handler admits a connection only if its client key is the cluster's public key, so a peer
without the file fails the handshake and none of its frames is ever decoded. Traffic between
daemons is encrypted; Gloo's and NCCL's own data connections are not (docs/security.md).
"""

from __future__ import annotations

import logging
import os
import stat
import tomllib
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator

log = logging.getLogger("commd.security")

_KEY_CHARS = 40  # a Curve25519 key in Z85


class KeyFileError(ValueError):
    """A cluster key file that cannot be used; the message says why and what to do."""


@dataclass(frozen=True)
class ClusterKey:
    public: bytes  # Z85
    secret: bytes  # Z85


def generate_key(path: str) -> ClusterKey:
    """Write a new cluster key to ``path`` (created 0600, never overwritten)."""
    public, secret = zmq.curve_keypair()
    text = (
        "# commd cluster key: the same file on every node of the cluster; keep it secret\n"
        "# (whoever reads it can join, read and abort jobs). Made by `commd keygen`.\n"
        f'public = "{public.decode()}"\nsecret = "{secret.decode()}"\n'
    )
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w", encoding="ascii") as handle:
        handle.write(text)
    return ClusterKey(public, secret)


def load_key(path: str) -> ClusterKey:
    """Read and check a cluster key file; KeyFileError names the problem."""
    try:
        with open(path, "rb") as handle:
            mode = os.fstat(handle.fileno()).st_mode
            data = tomllib.load(handle)
    except OSError as exc:
        raise KeyFileError(f"commd: cannot read the cluster key {path}: {exc.strerror}") \
            from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError):
        raise KeyFileError(f"commd: {path} is not a commd cluster key; make one with "
                           "`commd keygen PATH`") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise KeyFileError(f"commd: the cluster key {path} can be read by others (mode "
                           f"{stat.S_IMODE(mode):04o}); chmod 600 {path}")
    public, secret = data.get("public"), data.get("secret")
    if not all(isinstance(k, str) and len(k) == _KEY_CHARS for k in (public, secret)):
        raise KeyFileError(f"commd: {path} needs 'public' and 'secret', {_KEY_CHARS} Z85 "
                           "characters each; make a key with `commd keygen PATH`")
    assert isinstance(public, str) and isinstance(secret, str)
    try:
        matches = zmq.curve_public(secret.encode()) == public.encode()
    except (ValueError, zmq.ZMQError):
        matches = False
    if not matches:
        raise KeyFileError(f"commd: the public key in {path} is not the secret key's; "
                           "make a new key with `commd keygen PATH`")
    return ClusterKey(public.encode(), secret.encode())


class ClusterOnly:
    """The ZAP credentials check: only the cluster's own key is let in."""

    def __init__(self, key: ClusterKey) -> None:
        self._key = key.public
        self.rejected = 0  # handshakes refused (for status and metrics)

    def callback(self, domain: str, client_key: bytes) -> bool:
        if client_key == self._key:
            return True
        self.rejected += 1
        if self.rejected & (self.rejected - 1) == 0:  # 1, 2, 4, …: never a flood
            log.warning("refused %d peer handshake(s) without the cluster key",
                        self.rejected)
        return False


def start_authenticator(context: zmq.asyncio.Context, key: ClusterKey) -> tuple[
        AsyncioAuthenticator, ClusterOnly]:
    """The context's ZAP handler, before any socket of it binds or connects."""
    authenticator = AsyncioAuthenticator(context)
    authenticator.start()
    admit = ClusterOnly(key)
    authenticator.configure_curve_callback(domain="*", credentials_provider=admit)
    return authenticator, admit


class PeerSecurity:
    """This daemon's cluster key, if any, and the ZAP handler that admits only its holders."""

    def __init__(self) -> None:
        self._authenticator: AsyncioAuthenticator | None = None
        self._admit: ClusterOnly | None = None

    def start(self, context: zmq.asyncio.Context, key_file: str) -> ClusterKey | None:
        """Load ``key_file`` ("" : none) and admit only its holders; KeyFileError if bad."""
        if not key_file:
            return None
        key = load_key(key_file)
        self._authenticator, self._admit = start_authenticator(context, key)
        log.info("peers authenticated and encrypted with the cluster key %s", key_file)
        return key

    @property
    def refused(self) -> int:
        """Handshakes turned away for want of the cluster key."""
        return self._admit.rejected if self._admit else 0

    def stop(self) -> None:
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
