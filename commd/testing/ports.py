"""Loopback ports for tests and benchmarks that start rendezvous stores and daemons."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listened on a moment ago (the kernel's pick); the
    caller binds it soon after, so a clash with another starter is unlikely, not impossible."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextlib.contextmanager
def busy_port() -> Iterator[int]:
    """A TCP port on 127.0.0.1 that a socket listens on until the block ends (what a daemon
    started on it must refuse)."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        yield int(busy.getsockname()[1])
