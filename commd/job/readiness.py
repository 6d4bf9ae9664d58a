"""Which local ranks have marked which layers ready in the current iteration, and when.

Readiness is kept per layer, not per group, so a new plan can take over at any iteration
boundary. A layer is ready on the node when the last local rank has marked it; its time is
that rank's stamp (CLOCK_MONOTONIC, taken by the client when the gradient was final).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence

import numpy as np


class ReadyError(ValueError):
    """A bad ready notification; nothing was marked and the job carries on."""


class Readiness:
    """The marks of the current iteration, per local rank and layer, with when each layer became
    ready; the pipeline awaits each group here. A rank gone from a tolerant job counts as having
    marked every layer."""

    def __init__(self, ranks: int, layers: int) -> None:
        self.ranks = ranks
        self._marked = np.zeros((ranks, layers), dtype=bool)
        self._count = np.zeros(layers, dtype=np.int64)
        # CLOCK_MONOTONIC time each layer became ready on this node (the latest local rank's)
        self._ready_at = np.zeros(layers, dtype=np.float64)
        # CLOCK_MONOTONIC send time of the notification that completed each layer (0: unknown)
        self._sent_at = np.zeros(layers, dtype=np.float64)
        self._changed = asyncio.Event()
        self.notifications = 0  # ready messages received (clients batch them per group)
        self._awaited: Sequence[int] | None = None  # the group wait_for waits on
        self._began = time.monotonic()  # when the current iteration began
        # local ranks gone from a tolerant job: their rows count as marked every iteration
        self._absent: set[int] = set()

    def mark(self, local_index: int, layers: Sequence[int], iteration: int,
             sent_at: float = 0.0, stamps: Sequence[float] | None = None) -> None:
        """Record ready layers of one local rank; raise ReadyError and change nothing if bad.
        ``sent_at``: the client's CLOCK_MONOTONIC time of sending (0: not given); ``stamps``:
        when each layer became ready, on the same clock (empty: now)."""
        row = self._marked[local_index]
        if len(layers) > row.size:  # some layer twice or unknown: refused before any work
            raise ReadyError(f"ready lists {len(layers)} layers; the job has {row.size}, "
                             "each marked once per iteration")
        if stamps and len(stamps) != len(layers):
            raise ReadyError(f"{len(stamps)} stamps for {len(layers)} layers")
        _check_times(sent_at, stamps)
        self.notifications += 1
        if len(layers) == 1:  # one ready per layer, no numpy fancy indexing
            stamp = stamps[0] if stamps else time.monotonic()
            self._mark_one(row, layers[0], iteration, sent_at, stamp)
            return
        for layer in layers:  # before numpy: an int past int64 must not raise OverflowError
            if not 0 <= layer < row.size:
                raise ReadyError(f"ready for unknown layer {layer}; layers are 0..{row.size - 1}")
        chosen = np.asarray(layers, dtype=np.int64)
        # Counting, not list.count per layer: linear in the frame, whatever it repeats.
        counts = np.bincount(chosen, minlength=row.size)
        if counts.max() > 1 or row[chosen].any():
            twice = np.flatnonzero((counts > 1) | (row & (counts > 0)))
            raise ReadyError(_twice(iteration, twice.tolist()))
        row[chosen] = True
        self._count[chosen] += 1
        # distinct layers (checked above): one fancy-indexed maximum, no np.maximum.at
        self._ready_at[chosen] = np.maximum(self._ready_at[chosen],
                                            stamps if stamps else time.monotonic())
        complete = chosen[self._count[chosen] == self.ranks]
        if complete.size:
            self._sent_at[complete] = sent_at
            self._changed.set()

    def _mark_one(self, row: np.ndarray, layer: int, iteration: int, sent_at: float,
                  stamp: float) -> None:
        if not 0 <= layer < row.size:
            raise ReadyError(f"ready for unknown layer {layer}; layers are 0..{row.size - 1}")
        if row[layer]:
            raise ReadyError(_twice(iteration, [layer]))
        row[layer] = True
        self._count[layer] += 1
        self._ready_at[layer] = max(self._ready_at[layer], stamp)
        if self._count[layer] == self.ranks:
            self._sent_at[layer] = sent_at
            self._changed.set()

    @property
    def in_flight(self) -> bool:
        """Some layer of the current iteration is marked (by a rank still here)."""
        return bool((self._count > len(self._absent)).any())

    async def wait_for(self, group: Sequence[int]) -> None:
        """Until every local rank has marked every layer of ``group`` (adjacent layers)."""
        self._awaited = group
        try:
            while self._count[group[0] : group[-1] + 1].min() < self.ranks:
                self._changed.clear()
                await self._changed.wait()
        finally:
            self._awaited = None

    def waiting(self) -> tuple[float, list[tuple[int, int]]]:
        """(seconds this iteration has waited, ``missing`` of the awaited group); (0, [])
        when no group is awaited."""
        group = self._awaited
        if group is None:
            return 0.0, []
        return time.monotonic() - self._began, self.missing(group)

    def missing(self, group: Sequence[int]) -> list[tuple[int, int]]:
        """(local index, the highest layer of ``group`` it has not marked) per local rank that
        has not marked all of ``group``: backward marks the highest layers first, so that is
        the next one it should mark."""
        rows = self._marked[:, group[0] : group[-1] + 1]
        found = []
        for local, row in enumerate(rows):
            unmarked = (~row).nonzero()[0]
            if unmarked.size:
                found.append((local, group[0] + int(unmarked[-1])))
        return found

    def last_sent(self, group: Sequence[int]) -> float:
        """When the notification that completed ``group`` was sent (0: unknown)."""
        return float(self._sent_at[group[0] : group[-1] + 1].max())

    def next_iteration(self) -> np.ndarray:
        """The ready times of the iteration that ended; every mark is cleared."""
        ready_at = self._ready_at.copy()
        self._began = time.monotonic()
        self._marked[:] = False
        self._count[:] = 0
        self._ready_at[:] = 0.0
        self._fill_absent()
        return ready_at

    def absent(self, local_index: int) -> None:
        """A local rank is gone (a tolerant job goes on without it): its layers count as
        marked, now and in every later iteration."""
        self._absent.add(local_index)
        self._fill_absent()

    def present(self, local_index: int) -> None:
        """A replacement takes the place of a gone local rank: its layers are unmarked until
        it marks them, from the current iteration on."""
        self._absent.discard(local_index)
        row = self._marked[local_index]
        self._count[row] -= 1
        row[:] = False

    def _fill_absent(self) -> None:
        for index in self._absent:
            row = self._marked[index]
            self._count[~row] += 1
            row[:] = True
        if self._absent:
            self._changed.set()


# A client stamps with the same CLOCK_MONOTONIC as the daemon, just before sending: a stamp
# in the future (past this slack) or not a number would poison the node's profile.
CLOCK_SLACK_S = 1.0


def _check_times(sent_at: float, stamps: Sequence[float] | None) -> None:
    latest = time.monotonic() + CLOCK_SLACK_S
    if not (math.isfinite(sent_at) and 0.0 <= sent_at <= latest):
        raise ReadyError(f"sent_at {sent_at!r} is not a CLOCK_MONOTONIC time of this host "
                         "(0: not given)")
    if not stamps:
        return
    values = np.asarray(stamps, dtype=np.float64)  # one pass in numpy, not one per stamp
    bad = np.flatnonzero(~(np.isfinite(values) & (values >= 0.0) & (values <= latest)))
    if bad.size:
        raise ReadyError(f"stamp {stamps[int(bad[0])]!r} is not a CLOCK_MONOTONIC time of this "
                         "host up to now")


def _twice(iteration: int, layers: list[int]) -> str:
    more = f" and {len(layers) - 20} more" if len(layers) > 20 else ""
    return (f"ready twice in iteration {iteration} for layer(s) {layers[:20]}{more}; "
            "wait for the iteration to finish before marking again")
