"""Message loops that cannot die: whatever handling a frame raises is logged and counted, and
the loop goes on with the next frame.

The first failure of a kind (exception type and where) is logged with its traceback; later
ones only as a count, at 2, 4, 8, … occurrences, so that a flood of bad frames cannot flood
the log. ``counts`` is what status and metrics can show.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import sys
import threading
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import zmq

T = TypeVar("T")

log = logging.getLogger("commd.guard")

RECEIVE_BACKOFF_S = 0.01  # after a failed receive: a socket error must not spin a core


class Guard:
    """One message loop's guard (``loop`` names it): what handling its frames raised or refused,
    logged rarely and counted by kind (the metrics show the counts)."""

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
        with collector_paused():
            try:
                function(*args)
            except Exception as exc:
                self.failed(exc, where)


_pause = threading.Lock()
_pausing = 0  # callers inside collector_paused(), on any thread
_was_enabled = False


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic collector off while the block runs, on every thread (it is one per
    process): a frame being handled, a plan being decided (its thread). It comes back when
    the last such block ends, as it was before the first."""
    global _pausing, _was_enabled
    with _pause:
        if _pausing == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _pausing += 1
    try:
        yield
    finally:
        with _pause:
            _pausing -= 1
            if _pausing == 0 and _was_enabled:
                gc.enable()


# While a plan is decided on its thread, the loop gets the interpreter back within this:
# Python hands it between threads every 5 ms by default, and a status answer takes it
# several times.
PLANNING_SWITCH_S = 0.0005


@contextlib.contextmanager
def planning_aside() -> Iterator[None]:
    """Around CPU-bound Python on a thread beside the loop (the coordinator's planning): the
    collector paused (``collector_paused``) and the interpreter handed back to the loop
    within PLANNING_SWITCH_S. One such thread at a time (the coordinator has one)."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(min(before, PLANNING_SWITCH_S))
    try:
        with collector_paused():
            yield
    finally:
        sys.setswitchinterval(before)


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
