"""Waiting for a condition inside an async test: polled, with a bound that fails the test."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def until(condition: Callable[[], object], polls: int = 2000) -> None:
    """Return once ``condition()`` is true; AssertionError after ``polls`` × 2 ms."""
    for _ in range(polls):
        if condition():
            return
        await asyncio.sleep(0.002)  # polling a condition, with a bound
    raise AssertionError("condition not reached")
