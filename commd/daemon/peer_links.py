"""Links from this daemon to the coordinator daemons of its jobs (DEALER → peer ROUTER)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from commd.daemon.guard import Guard, serve
from commd.daemon.peer_security import ClusterKey, connect_securely
from commd.daemon.sockets import PEER_FRAME_CAP
from commd_protocol import PeerMessage, ProtocolViolation, encode
from commd_protocol.codec import peer_codec

log = logging.getLogger("commd.peers")

_REFUSED = (zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
            zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
           | _REFUSED[0] | _REFUSED[1] | _REFUSED[2])
# libzmq drops a link whose peer sent no heartbeat for this long: a disconnect after such
# silence is a cut-off or a stopped process, not the close a dying process makes.
HEARTBEAT_TIMEOUT_S = 5.0
# An address is probed at most this often, each probe waiting this long for an answer
PROBE_EVERY_S = 0.5
PROBE_TIMEOUT_S = 1.0


class PeerLinks:
    """One DEALER per coordinator address, shared by every job coordinated there."""

    def __init__(
        self, context: zmq.asyncio.Context, on_message: Callable[[str, PeerMessage], None],
        on_closed: Callable[[str], None] = lambda address: None,
        on_up: Callable[[str], None] = lambda address: None,
        on_nothing_listens: Callable[[str], None] = lambda address: None,
    ) -> None:
        """``on_closed(address)``: an established link to ``address`` closed (its daemon's
        process ended, or it dropped a silent link: the caller tells them apart by how long
        the coordinator had been silent). ``on_up(address)``: a handshake there succeeded,
        the first or one after a close (a daemon answers there again).
        ``on_nothing_listens(address)``: a ``probe`` of an address whose link is not up found
        nothing listening: no process has that port (its host's kernel said so), a daemon
        that is gone, not one that is silent."""
        self._context = context
        self._on_message = on_message
        self._on_closed = on_closed
        self._on_up = on_up
        self._on_nothing_listens = on_nothing_listens
        self._probed: dict[str, float] = {}  # address -> when it was last probed
        self._links: dict[str, zmq.asyncio.Socket] = {}
        self._readers: dict[str, asyncio.Task[None]] = {}
        self._states: dict[str, str] = {}  # "connecting", "up" or "refused", from the monitor
        self.guard = Guard("coordinator link")
        self.key: ClusterKey | None = None  # CurveZMQ on every link once set (before any)

    @property
    def count(self) -> int:
        """Links open to coordinators."""
        return len(self._links)

    def state(self, address: str) -> str:
        """"up" once a handshake with ``address`` succeeded, "refused" if one failed (keys),
        else "connecting" (nothing answers, yet or at all)."""
        return self._states.get(address, "connecting")

    def send(self, address: str, message: msgspec.Struct) -> None:
        socket = self._links.get(address) or self._open(address)
        future = socket.send(encode(message))
        future.add_done_callback(_log_failure)  # type: ignore[attr-defined]

    def _open(self, address: str) -> zmq.asyncio.Socket:
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 1000)  # let a last abort or leave go out on shutdown
        socket.setsockopt(zmq.MAXMSGSIZE, PEER_FRAME_CAP)
        if self.key is not None:
            connect_securely(socket, self.key)
        socket.setsockopt(zmq.HEARTBEAT_IVL, 1000)
        socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(HEARTBEAT_TIMEOUT_S * 1000))
        monitor = socket.get_monitor_socket(_EVENTS)  # before connect: no event is missed
        socket.connect(f"tcp://{address}")
        self._links[address] = socket
        loop = asyncio.get_running_loop()
        self._readers[address] = loop.create_task(self._read(address, socket),
                                                  name=f"commd-peer-{address}")
        self._readers[f"{address} monitor"] = loop.create_task(
            self._watch(address, monitor), name=f"commd-peer-monitor-{address}")
        return socket

    async def _watch(self, address: str, monitor: zmq.asyncio.Socket) -> None:
        """The link's handshakes, for ``state``: a coordinator that never answers, or turns
        our key away, is named to the job within seconds (commd.job.liveness); and the close
        of a link that was up, for ``on_closed`` (ZeroMQ reconnects by itself: the state is
        "connecting" again until a handshake succeeds)."""
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())["event"]
                if event == zmq.EVENT_DISCONNECTED:
                    if self._states.get(address) == "up":
                        self._states[address] = "connecting"
                        self.guard.call(f"the close of the link to {address}",
                                        self._on_closed, address)
                elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self._states[address] = "up"
                    self.guard.call(f"the link to {address} coming up", self._on_up, address)
                elif event in _REFUSED:
                    self._states[address] = "refused"
                    log.warning("the coordinator at %s refused this daemon's handshake", address)
        finally:
            monitor.close(linger=0)

    def probe(self, address: str) -> None:
        """Find out whether anything listens at ``address``, whose link is not up: libzmq's
        retries do not say why, and only a refusal (the host's reset: no socket bound to the
        port) means no daemon is there; ``on_nothing_listens`` hears of it. A stopped
        daemon's kernel still accepts, and a cut network is unreachable or silent: those
        are for the peer timeout. Asked for only where it matters (a node awaiting its
        successor): a probe that reaches a live daemon counts there as a refused handshake."""
        now = time.monotonic()
        if self._states.get(address) == "up" \
                or now - self._probed.get(address, -PROBE_EVERY_S) < PROBE_EVERY_S:
            return
        self._probed[address] = now  # one entry per address asked about
        key = f"{address} probe"
        if key in self._readers and not self._readers[key].done():
            return
        self._readers[key] = asyncio.get_running_loop().create_task(
            self._refused(address), name=f"commd-peer-probe-{address}")

    async def _refused(self, address: str) -> None:
        host, _, port = address.rpartition(":")
        try:
            _, writer = await asyncio.wait_for(
                asyncio.open_connection(host.strip("[]"), int(port)), PROBE_TIMEOUT_S)
        except ConnectionRefusedError:
            if self._states.get(address) != "up":
                self.guard.call(f"nothing listening at {address}", self._on_nothing_listens,
                                address)
            return
        except (OSError, TimeoutError, ValueError, OverflowError):
            return  # unreachable, silent or not an address: nothing to conclude
        writer.close()  # something listens there: the link's own retries will find it

    async def _read(self, address: str, socket: zmq.asyncio.Socket) -> None:
        def handle(frame: bytes) -> None:
            try:
                message = peer_codec.decode(frame)
            except ProtocolViolation as exc:
                self.guard.refused(f"bad message from coordinator {address} ({exc.code})", exc)
                return
            self._on_message(address, message)

        await serve(self.guard, socket.recv, handle)

    async def close(self) -> None:
        for task in self._readers.values():
            task.cancel()
        await asyncio.gather(*self._readers.values(), return_exceptions=True)
        for socket in self._links.values():
            socket.close()
        self._links.clear()
        self._readers.clear()


def _log_failure(future: asyncio.Future[object]) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.warning("peer send failed: %s", future.exception())
