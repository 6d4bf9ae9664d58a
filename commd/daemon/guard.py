"""Message loops that cannot die: whatever handling a frame raises is logged and counted, and
the loop goes on with the next frame.

The first failure of a kind (exception type and where) is logged with its traceback; later
ones only as a count, at 2, 4, 8, … occurrences, so that a flood of bad frames cannot flood
the log. ``counts`` is what status and metrics can show.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import zmq

T = TypeVar("T")

log = logging.getLogger("commd.guard")

RECEIVE_BACKOFF_S = 0.01  # after a failed receive: a socket error must not spin a core


class Guard:
    def __init__(self, loop: str) -> None:
        self.loop = loop
        self.counts: Counter[str] = Counter()

    def failed(self, exc: BaseException, where: str) -> None:
        kind = f"{type(exc).__name__} in {where}"
        self.counts[kind] += 1
        seen = self.counts[kind]
        if seen == 1:
            log.error("%s loop: %s; the loop goes on", self.loop, kind, exc_info=exc)
        elif seen & (seen - 1) == 0:  # a power of two
            log.error("%s loop: %s, %d times so far: %s", self.loop, kind, seen, exc)

    def refused(self, kind: str, detail: object) -> None:
        """A frame refused on purpose (malformed, unknown sender): counted, logged rarely."""
        self.counts[kind] += 1
        seen = self.counts[kind]
        if seen & (seen - 1) == 0:
            log.warning("%s loop: %s (%d so far): %s", self.loop, kind, seen, detail)

    def call(self, where: str, function: Callable[..., None], *args: Any) -> None:
        """``function(*args)``; what it raises is logged and counted, never raised.

        The cyclic collector waits meanwhile: a 4 MiB frame decodes into up to a million
        small lists, none of them garbage, and collections triggered while they are made
        walk them (and the daemon's whole heap) again and again, many times the decode's own
        cost. Freed before it is back, they cost it nothing; what the frame keeps (a join)
        is collected later, once."""
        collecting = gc.isenabled()
        gc.disable()
        try:
            function(*args)
        except Exception as exc:
            self.failed(exc, where)
        finally:
            if collecting:
                gc.enable()


async def serve(guard: Guard, receive: Callable[[], Awaitable[T]],
                handle: Callable[[T], None]) -> None:
    """Receive and handle forever; only cancellation or the end of the context stops it."""
    while True:
        try:
            item = await receive()
        except (asyncio.CancelledError, zmq.ContextTerminated):
            raise
        except Exception as exc:
            guard.failed(exc, "receive")
            await asyncio.sleep(RECEIVE_BACKOFF_S)
            continue
        guard.call("handling a frame", handle, item)
