"""The collective watchdog: a collective that runs far past its predicted time fails the job,
naming the group and the node, instead of waiting for the engine's own timeout (minutes).

The limit of each collective is ``factor`` × its predicted time (the plan's a + b·M for the
group's bytes) + ``floor_s``. Timers are asyncio ``call_later`` handles: nothing polls.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any


class CollectiveOverdue(Exception):
    """A collective ran past its limit; the message names it and says what may be wrong."""


class CollectiveWatch:
    """The watchdog of one job's data plane on this node: each collective (or awaited span) gets a
    timer at its limit, and one still running then fails the job through ``on_overdue`` with a
    ``CollectiveOverdue`` naming it, unless ``patient()`` says to wait one more limit."""

    def __init__(self, factor: float, floor_s: float, where: str,
                 on_overdue: Callable[[BaseException], None],
                 patient: Callable[[], bool] = lambda: False) -> None:
        """``patient()``: true while a collective may wait longer (some node still waits for
        its ranks' marks: a stall, which the stall inspector names instead)."""
        self._patient = patient
        self.factor = factor
        self.floor_s = floor_s
        self.where = where  # e.g. "node 1 of 2"
        self._on_overdue = on_overdue
        self._started: dict[int, float] = {}  # id of a watched collective -> monotonic start

    def limit(self, predicted_s: float) -> float:
        return self.factor * max(predicted_s, 0.0) + self.floor_s

    def watch(self, wire: asyncio.Future[Any], what: str, predicted_s: float) -> None:
        """Fail the job if ``wire`` is not done within its limit."""
        key = id(wire)
        self._started[key] = time.monotonic()
        handle = asyncio.get_running_loop().call_later(
            self.limit(predicted_s), self._overdue, what, predicted_s, key)

        def done(_: asyncio.Future[Any]) -> None:
            handle.cancel()  # a re-armed timer finds the key gone and stops
            self._started.pop(key, None)

        wire.add_done_callback(done)

    @contextlib.contextmanager
    def span(self, what: str, predicted_s: float) -> Iterator[None]:
        """The same for work that is awaited rather than a future (a compressed exchange)."""
        token = object()
        key = id(token)
        self._started[key] = time.monotonic()
        handle = asyncio.get_running_loop().call_later(
            self.limit(predicted_s), self._overdue, what, predicted_s, key)
        try:
            yield
        finally:
            handle.cancel()
            self._started.pop(key, None)

    def oldest_s(self) -> float:
        """How long the oldest collective still on the wire has been there (0: none)."""
        if not self._started:
            return 0.0
        return time.monotonic() - min(self._started.values())

    def _overdue(self, what: str, predicted_s: float, key: int) -> None:
        if key not in self._started:
            return  # finished in the meantime
        if self._patient():
            asyncio.get_running_loop().call_later(self.limit(predicted_s), self._overdue, what,
                                                  predicted_s, key)
            return
        self._on_overdue(CollectiveOverdue(
            f"{what} has run over {self.limit(predicted_s):.1f}s ({self.factor:g}× its "
            f"predicted {predicted_s * 1e3:.1f} ms + {self.floor_s:g}s) on {self.where}: the "
            "network between the nodes may be down, or a node stopped"))
