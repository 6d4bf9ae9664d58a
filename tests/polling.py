"""Waiting for a condition in a test: polled, with a deadline that turns a hang into a failure
naming what never happened.

``until`` is for async tests (it yields to the event loop between polls, so an in-process
daemon keeps running); ``until_sync`` is for plain tests, which poll something in another
process (a daemon's status, a count) and may block while they do."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 5.0  # an in-process event; a wait on other processes passes its own
POLL_S = 0.005  # often enough that a poll adds little to a test, rarely enough to cost little


async def until(condition: Callable[[], T], what: str,
                timeout_s: float = DEFAULT_TIMEOUT_S) -> T:
    """``condition()``'s first true value; AssertionError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        await asyncio.sleep(POLL_S)  # polling a condition, bounded by the deadline
    return value


def until_sync(condition: Callable[[], T], what: str,
               timeout_s: float = DEFAULT_TIMEOUT_S, poll_s: float = POLL_S) -> T:
    """``until`` for a test without an event loop: blocks between polls (``poll_s``, longer
    where each poll asks another process)."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(poll_s)  # polling a condition, bounded by the deadline
    return value
