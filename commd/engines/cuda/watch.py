"""Bridging device completion to asyncio without blocking the event loop.

One thread per job waits for its stream's events in the order they were recorded (a stream
completes in order) with ``cudaEventSynchronize`` — a blocking-sync event, so the thread
sleeps instead of spinning, and cupy releases the GIL meanwhile — and settles each future
on the loop with ``call_soon_threadsafe``. A timer on the loop bounds every wait: when it
fires, the future fails and ``on_timeout`` runs (the NCCL engine aborts its communicator,
which also wakes the thread). Cleanup runs on the same thread after the last wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from commd.engines.base import EngineError
from commd.engines.cuda import calls as cuda_calls

log = logging.getLogger("commd.engine.cuda")


@dataclass
class _Wait:
    what: str
    end: Any  # an event object with .ptr (kept alive until it is waited for)
    start: Any | None  # a timing event recorded before the work, or None
    future: asyncio.Future[float | None]
    check: Callable[[], None] | None  # runs after the wait (NCCL: the async error check)


class StreamWatcher:
    """One job's waiting thread (the module's docstring): ``watch`` gives a future for an event's
    completion, settled on the loop in the order the events were recorded."""

    def __init__(self, loop: asyncio.AbstractEventLoop, *, synchronize: Callable[[int], None],
                 elapsed_ms: Callable[[int, int], float],
                 bind_thread: Callable[[], None] = lambda: None, name: str = "commd-watch"
                 ) -> None:
        self._loop = loop
        self._synchronize = synchronize
        self._elapsed_ms = elapsed_ms
        self._bind_thread = bind_thread  # e.g. make the job's device current on the thread
        self._queue: queue.SimpleQueue[_Wait | Callable[[], None] | None] = queue.SimpleQueue()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # --- the loop's side -------------------------------------------------------------------------

    def watch(self, what: str, end: Any, *, start: Any | None = None,
              timeout_s: float | None = None, on_timeout: Callable[[], None] | None = None,
              check: Callable[[], None] | None = None) -> asyncio.Future[float | None]:
        """A future for ``end``'s completion: the seconds since ``start`` when given."""
        future: asyncio.Future[float | None] = self._loop.create_future()
        if self._stopped:
            future.set_exception(EngineError(f"commd: {what}: the job's stream is closed"))
            return future
        if timeout_s is not None:
            timer = self._loop.call_later(timeout_s, self._expire, future, what, timeout_s,
                                          on_timeout)
            future.add_done_callback(lambda _: timer.cancel())
        self._queue.put(_Wait(what, end, start, future, check))
        return future

    def after(self, function: Callable[[], None]) -> None:
        """Run ``function`` on the thread once every earlier wait is over."""
        if not self._stopped:
            self._queue.put(function)

    def stop(self) -> None:
        """The thread ends after what is queued (safe to call twice)."""
        if not self._stopped:
            self._stopped = True
            self._queue.put(None)

    def _expire(self, future: asyncio.Future[float | None], what: str, timeout_s: float,
                on_timeout: Callable[[], None] | None) -> None:
        if future.done():
            return
        future.set_exception(EngineError(
            f"commd: {what} did not complete within {timeout_s:g}s; a node may be gone or "
            "stalled"))
        if on_timeout is not None:
            on_timeout()

    def _settle(self, future: asyncio.Future[float | None], result: float | None,
                error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    # --- the thread's side -----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._bind_thread()
        except Exception:
            log.exception("cannot bind the watcher thread to its device")
        while True:
            item = self._queue.get()
            if item is None:
                return
            if not isinstance(item, _Wait):
                try:
                    item()
                except Exception:
                    log.exception("cleanup on the stream's thread failed")
                continue
            result: float | None = None
            error: BaseException | None = None
            try:
                cuda_calls.call(f"{item.what} (waiting for it)", self._synchronize, item.end.ptr)
                if item.check is not None:
                    cuda_calls.call(item.what, item.check)
                if item.start is not None:
                    result = self._elapsed_ms(item.start.ptr, item.end.ptr) / 1e3
            except Exception as exc:
                error = exc
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                self._loop.call_soon_threadsafe(self._settle, item.future, result, error)
