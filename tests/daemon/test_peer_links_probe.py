"""A link that cannot connect tells a dead daemon from a silent one: ``PeerLinks.probe`` makes
a plain connection to the address, and only a refusal (no process listens on the port) is
reported as nothing listening. A port whose socket accepts but never speaks (a stopped
daemon's kernel still completes the handshake) is not, nor a link that is up. Real ZeroMQ
links, real sockets."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
import zmq.asyncio

from commd.daemon.peer_links import PeerLinks
from commd.testing.ports import free_port
from commd_protocol import PeerHeartbeat

from polling import until

pytestmark = pytest.mark.timeout(30)


class SilentListener:
    """A TCP socket that listens and accepts, and never says a word: what a SIGSTOPped
    daemon's port looks like from outside. Keeps the connections it accepted."""

    def __init__(self) -> None:
        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.socket.listen(64)
        self.socket.setblocking(False)
        self.address = f"127.0.0.1:{self.socket.getsockname()[1]}"
        self.accepted: list[socket.socket] = []

    def accept_waiting(self) -> int:
        """Accept what waits; how many connections were accepted in all."""
        while True:
            try:
                connection, _ = self.socket.accept()
            except BlockingIOError:
                return len(self.accepted)
            self.accepted.append(connection)

    def close(self) -> None:
        for connection in self.accepted:
            connection.close()
        self.socket.close()


@pytest.fixture
def silent() -> Iterator[SilentListener]:
    listener = SilentListener()
    yield listener
    listener.close()


async def test_a_refused_address_is_reported_and_a_silent_one_is_not(
        silent: SilentListener) -> None:
    context = zmq.asyncio.Context()
    gone: list[str] = []
    links = PeerLinks(context, lambda address, message: None,
                      on_nothing_listens=gone.append)
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    try:
        links.send(dead, PeerHeartbeat(job="j"))
        links.send(silent.address, PeerHeartbeat(job="j"))
        await until(silent.accept_waiting, "libzmq's connection to the silent port")
        links.probe(silent.address)  # accepted, never answered: silence, not death
        await until(lambda: silent.accept_waiting() >= 2, "the probe's connection")
        links.probe(dead)
        await until(lambda: gone, "the refused address reported", 10)
        assert gone == [dead]
        assert links.state(dead) == links.state(silent.address) == "connecting"
        links.probe(dead)  # within PROBE_EVERY_S of the last: not probed again
        links.probe(silent.address)
        assert silent.accept_waiting() == 2
    finally:
        await links.close()
        context.term()
