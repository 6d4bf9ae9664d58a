"""The bounded HTTP server behind ``--metrics-listen``: ``GET /metrics`` on the daemon's loop.

A scraper is not trusted to be polite, and the daemon's loop is the one that serves every job
on the node, so the server holds nothing a connection can grow and nothing a scrape can
stretch:

- **Connections**: at most ``max_connections`` open at once; one over it is answered ``503``
  and closed at once (the idle ones are not evicted: a scraper sends its request within
  milliseconds, a slow client cannot keep a slot past the deadline below).
- **Deadline**: the whole request head must arrive within ``head_deadline_s`` of the accept,
  and the reply must drain within as long again; then the connection is aborted.
- **Size**: a request head over ``max_head_bytes`` is answered ``431`` and closed; a body, if
  any, is never read.
- **One request per connection** (HTTP/1.0 style, ``Connection: close``): no keep-alive
  state.
- **Per connection**: a transport, a protocol with a head buffer of at most
  ``max_head_bytes``, one timer; no thread, no task.
- **Rendering**: the exposition text is rendered on the loop at most once per ``cache_s``
  and served from that cache in between, so scrapes at any rate cost one render per interval
  plus an accept and a write each. A render that took longer than ``RENDER_SHARE`` of the
  interval (a daemon with dozens of jobs) stretches the interval to keep that share.

``GET`` and ``HEAD`` of ``/metrics`` (a query string is ignored) are served; another path is
``404``, another method ``405``, a request line that is not HTTP ``400``.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable
from typing import cast

__all__ = ["MetricsServer"]

log = logging.getLogger("commd.metrics")

MAX_CONNECTIONS = 16
HEAD_DEADLINE_S = 5.0
MAX_HEAD_BYTES = 8192  # a Prometheus request head is a few hundred bytes
CACHE_S = 1.0  # Prometheus scrapes every 15 s by default: a second-old figure is fresh
RENDER_SHARE = 0.02  # at most this share of the loop's time goes to rendering (many jobs)
_BACKLOG = 64
_METHODS = (b"GET", b"HEAD")
_PATH = b"/metrics"
_END = b"\r\n\r\n"


def _reply(status: str, body: bytes = b"", content_type: str = "text/plain; charset=utf-8",
           *, head_only: bool = False, extra: str = "") -> bytes:
    head = (f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n{extra}\r\n").encode()
    return head if head_only else head + body


_REFUSED = _reply("503 Service Unavailable", b"commd: too many metrics connections\n")
_BAD = _reply("400 Bad Request", b"commd: not an HTTP request\n")
_NOT_FOUND = _reply("404 Not Found", b"commd: only /metrics is served\n")
_NOT_ALLOWED = _reply("405 Method Not Allowed", b"commd: only GET and HEAD are served\n",
                      extra="Allow: GET, HEAD\r\n")
_FAILED = _reply("500 Internal Server Error", b"commd: metrics could not be collected\n")


class MetricsServer:
    """Serves ``render()``'s text on ``/metrics``; ``start`` it, ``close`` it on the loop."""

    def __init__(self, render: Callable[[], bytes], content_type: str, *,
                 max_connections: int = MAX_CONNECTIONS, head_deadline_s: float = HEAD_DEADLINE_S,
                 max_head_bytes: int = MAX_HEAD_BYTES, cache_s: float = CACHE_S) -> None:
        self._render = render
        self._content_type = content_type
        self.max_connections = max_connections
        self.head_deadline_s = head_deadline_s
        self.max_head_bytes = max_head_bytes
        self.cache_s = cache_s
        # (monotonic time fresh until, the GET reply, the HEAD reply): whole replies, so that
        # a scrape between renders costs no copy of the text
        self._cached: tuple[float, bytes, bytes] | None = None
        self._open: set[_Connection] = set()
        self._server: asyncio.AbstractServer | None = None
        self.renders = 0  # how many times the text was rendered (the cache's misses)
        self.refused = 0  # connections over the cap, closed at once
        self.expired = 0  # connections aborted at their deadline

    @property
    def connections(self) -> int:
        """Connections open now (under the cap)."""
        return len(self._open)

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host``:``port`` (0: a free one), one socket as ``getaddrinfo`` resolves
        it first; the port bound. OSError when it cannot bind."""
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
            sock.listen(_BACKLOG)
            sock.setblocking(False)
            loop = asyncio.get_running_loop()
            self._server = await loop.create_server(lambda: _Connection(self), sock=sock)
        except BaseException:
            sock.close()
            raise
        return int(sock.getsockname()[1])

    async def close(self) -> None:
        """Stop listening and drop every open connection."""
        if self._server is not None:
            self._server.close()
            for connection in list(self._open):
                connection.abort()
            await self._server.wait_closed()
            self._server = None

    # --- called by the connections ---------------------------------------------------------------

    def admit(self, connection: _Connection) -> bool:
        if len(self._open) >= self.max_connections:
            self.refused += 1
            return False
        self._open.add(connection)
        return True

    def forget(self, connection: _Connection) -> None:
        self._open.discard(connection)

    def answer(self, head: bytes) -> bytes:
        """The reply to one complete request head."""
        line = head.split(b"\r\n", 1)[0].split(b"\n", 1)[0]
        parts = line.split(b" ")
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/") or not parts[1].startswith(b"/"):
            return _BAD
        method, target = parts[0], parts[1]
        if target.split(b"?", 1)[0] != _PATH:
            return _NOT_FOUND
        if method not in _METHODS:
            return _NOT_ALLOWED
        cached = self._fresh()
        if cached is None:
            return _FAILED
        return cached[2] if method == b"HEAD" else cached[1]

    def _fresh(self) -> tuple[float, bytes, bytes] | None:
        """The cached replies, rendered again once stale; None when rendering failed."""
        now = time.monotonic()
        if self._cached is not None and now < self._cached[0]:
            return self._cached
        try:
            text = self._render()
        except Exception:
            log.exception("metrics: collecting failed")
            return None
        took = time.monotonic() - now
        self.renders += 1
        self._cached = (now + max(self.cache_s, took / RENDER_SHARE),
                        _reply("200 OK", text, self._content_type),
                        _reply("200 OK", text, self._content_type, head_only=True))
        return self._cached


class _Connection(asyncio.Protocol):
    """One scrape: a request head read under a deadline and a size cap, one reply, closed."""

    __slots__ = ("_buffer", "_server", "_timer", "_transport")

    def __init__(self, server: MetricsServer) -> None:
        self._server = server
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport = cast(asyncio.Transport, transport)  # uvloop's: no subclass
        if not self._server.admit(self):
            transport.write(_REFUSED)  # a few bytes: the socket takes them at once
            transport.close()
            return
        self._timer = asyncio.get_running_loop().call_later(
            self._server.head_deadline_s, self._expire)

    def data_received(self, data: bytes) -> None:
        if self._transport is None or self._transport.is_closing():
            return  # over the cap or already answered: what else comes is not read
        start = max(0, len(self._buffer) - len(_END) + 1)
        self._buffer += data
        end = self._buffer.find(_END, start)
        limit = self._server.max_head_bytes
        if end > limit or (end < 0 and len(self._buffer) >= limit + len(_END)):
            self._send(_reply("431 Request Header Fields Too Large",
                              b"commd: request head over %d bytes\n" % limit))
        elif end >= 0:
            self._send(self._server.answer(bytes(self._buffer[:end])))

    def eof_received(self) -> bool | None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.close()  # the head never ended: nothing to answer
        return None

    def _send(self, reply: bytes) -> None:
        assert self._transport is not None
        self._buffer = bytearray()
        self._transport.write(reply)
        self._transport.close()  # after the reply drained; the deadline bounds that too
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_later(
            self._server.head_deadline_s, self._expire)

    def _expire(self) -> None:
        self._server.expired += 1
        self.abort()

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._buffer = bytearray()
        self._server.forget(self)
