"""The steps every compressed exchange of a group shares, whatever it compresses: its
arithmetic off the event loop, its collectives issued in plan order (``turn``), and the
``issued`` signal that lets the next group's collectives go."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any, Protocol, TypeVar

import numpy as np

from commd.engines import Engine
from commd.engines.buffer_ops import INLINE_BYTES

T = TypeVar("T")


class WireSpans(Protocol):
    """What an exchange asks of the job's wire clock (``WireClock``): a collective's time on the
    wire, counted from when it could start."""

    def span(self, launched: float) -> float:
        """Seconds on the wire of a collective launched at ``launched`` that just ended."""
        ...


async def off_loop(executor: Executor, function: Callable[..., T], buffer: np.ndarray,
                   *args: Any) -> T:
    """``function(buffer, *args)`` on a worker thread, or inline for a small buffer, where
    the hop would cost more than the work."""
    if buffer.nbytes <= INLINE_BYTES:
        return function(buffer, *args)
    return await asyncio.get_running_loop().run_in_executor(
        executor, lambda: function(buffer, *args))


async def allreduce_in_turn(engine: Engine | None, buffer: np.ndarray, dtype: str,
                            turn: asyncio.Future[None] | None, issued: asyncio.Future[None],
                            clock: WireSpans, last: bool = True) -> float:
    """Sum ``buffer`` over the nodes once ``turn`` is done; ``issued`` is set once the
    group's ``last`` collective is (also when this one fails). Returns its seconds on the
    wire (0 without an engine: a single node)."""
    try:
        if turn is not None and not turn.done():
            await turn
        if engine is None:
            return 0.0
        began = time.perf_counter()
        wire = engine.allreduce(buffer, dtype)
        if last:
            mark_issued(issued)
        await wire
        return clock.span(began)
    finally:
        if last:
            mark_issued(issued)


def mark_issued(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
