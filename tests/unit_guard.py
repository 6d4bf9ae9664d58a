"""What a test in tests/unit may not do: start a process, or bind, connect or send a datagram on
a network or Unix socket (Python's or ZeroMQ's). tests/unit/conftest.py switches the guard on
around every phase of each unit test (setup, call, teardown, so fixtures of every scope are
covered): a test that needs a process or a socket belongs in tests/daemon or tests/system.

Allowed: ``socket.socketpair()`` (asyncio's event loop wakes itself through one), ZeroMQ's
``inproc://`` transport, threads."""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

import pytest
import zmq

GUARDED_FAMILIES = (socket.AF_INET, socket.AF_INET6, socket.AF_UNIX)

# What the running phase tried, refused or not caught: a test that swallows the exception
# (a daemon's task that logs it, an ``except Exception``) still fails on it.
violations: list[str] = []


class UnitTierViolation(RuntimeError):
    """A unit test started a process or opened a socket."""


def refuse(what: str) -> NoReturn:
    violations.append(what)
    raise UnitTierViolation(f"tests/unit runs in-process only, yet this test {what}: "
                            "move it to tests/daemon (or tests/system)")


@contextmanager
def refused() -> Iterator[None]:
    """Asserts that the block is refused by the guard, and forgives that one refusal."""
    before = len(violations)
    with pytest.raises(UnitTierViolation):
        yield
    assert len(violations) == before + 1, violations
    violations.pop()


@contextmanager
def guarded() -> Iterator[None]:
    """The guard on, for the block; what it patched is restored after it."""
    real_connect = socket.socket.connect
    real_connect_ex = socket.socket.connect_ex
    real_bind = socket.socket.bind
    real_sendto = socket.socket.sendto
    real_zmq_bind = zmq.Socket.bind
    real_zmq_connect = zmq.Socket.connect

    def connect(self: socket.socket, address: Any) -> None:
        if self.family in GUARDED_FAMILIES:
            refuse(f"connects a socket to {address!r}")
        real_connect(self, address)

    def connect_ex(self: socket.socket, address: Any) -> int:
        if self.family in GUARDED_FAMILIES:
            refuse(f"connects a socket to {address!r}")
        return real_connect_ex(self, address)

    def bind(self: socket.socket, address: Any) -> None:
        if self.family in GUARDED_FAMILIES:
            refuse(f"binds a socket to {address!r}")
        real_bind(self, address)

    def sendto(self: socket.socket, data: Any, *rest: Any) -> int:
        if self.family in GUARDED_FAMILIES:  # (data, address) or (data, flags, address)
            refuse(f"sends a datagram to {rest[-1]!r}")
        return real_sendto(self, data, *rest)

    def zmq_bind(self: zmq.Socket[Any], addr: str) -> Any:
        if not addr.startswith("inproc://"):
            refuse(f"binds a ZeroMQ socket to {addr!r}")
        return real_zmq_bind(self, addr)

    def zmq_connect(self: zmq.Socket[Any], addr: str) -> Any:
        if not addr.startswith("inproc://"):
            refuse(f"connects a ZeroMQ socket to {addr!r}")
        return real_zmq_connect(self, addr)

    def popen(self: subprocess.Popen[Any], args: Any, *_: Any, **__: Any) -> None:
        refuse(f"starts a process ({args!r})")

    def fork() -> NoReturn:
        refuse("forks")

    def spawn(path: Any, *_: Any, **__: Any) -> NoReturn:
        refuse(f"spawns a process ({path!r})")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(socket.socket, "connect", connect)
        patch.setattr(socket.socket, "connect_ex", connect_ex)
        patch.setattr(socket.socket, "bind", bind)
        patch.setattr(socket.socket, "sendto", sendto)
        patch.setattr(zmq.Socket, "bind", zmq_bind)
        patch.setattr(zmq.Socket, "connect", zmq_connect)
        patch.setattr(subprocess.Popen, "__init__", popen)
        patch.setattr(os, "fork", fork)
        patch.setattr(os, "system", spawn)
        patch.setattr(os, "posix_spawn", spawn)
        patch.setattr(os, "posix_spawnp", spawn)
        yield
