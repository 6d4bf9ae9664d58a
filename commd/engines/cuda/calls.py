"""The one checked chokepoint for CUDA and NCCL: every call of the daemon goes through here.

``call(what, function, *args)`` and ``checked(what)`` turn a library failure into an
``EngineError`` that names the operation and carries the library's own message, e.g.
``commd: ncclAllReduce failed: NCCL_ERROR_UNHANDLED_CUDA_ERROR: unhandled cuda error``.
``run_blocking`` runs a call that may hang (ncclCommInitRank, a stream drain) on its own
thread with a timeout, so that neither the event loop nor a shared executor is held.
cupy is imported lazily, only by the functions that need it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from commd.engines.base import EngineError

T = TypeVar("T")

# Errors that are the caller's bug, not the library's: let them through unchanged.
_PROGRAMMING_ERRORS = (TypeError, AttributeError, NameError, AssertionError)


def describe(exc: BaseException) -> str:
    """The library's own words: cupy's errors already read 'cudaErrorX: text' or
    'NCCL_ERROR_X: text'; anything else gets its type name in front."""
    text = str(exc).strip() or type(exc).__name__
    name = type(exc).__name__
    if name in ("CUDARuntimeError", "CUDADriverError", "NcclError", "CUDAError"):
        return text
    return f"{name}: {text}"


def failure(what: str, exc: BaseException) -> EngineError:
    error = EngineError(f"commd: {what} failed: {describe(exc)}")
    error.__cause__ = exc
    return error


def call(what: str, function: Callable[..., T], *args: Any) -> T:
    """``function(*args)``; a library failure becomes EngineError naming ``what``."""
    with checked(what):
        return function(*args)


@contextlib.contextmanager
def checked(what: str) -> Iterator[None]:
    """:func:`call`'s translation for a block of calls (kernel launches through cupy, for
    example)."""
    try:
        yield
    except EngineError:
        raise
    except _PROGRAMMING_ERRORS:
        raise
    except Exception as exc:
        raise failure(what, exc) from exc


def import_cupy() -> Any:
    """cupy, or EngineError saying how to install it."""
    try:
        import cupy
    except ImportError as exc:
        raise EngineError(
            f"commd: device buffers need cupy ({exc}); pip install 'commd[nccl]'"
        ) from None
    return cupy


async def run_blocking(what: str, function: Callable[[], T], timeout_s: float,
                       on_late_result: Callable[[T], None] | None = None) -> T:
    """Run ``function`` on a fresh daemon thread; EngineError on failure or after
    ``timeout_s``. A call that hangs keeps only its own thread; when it returns after the
    timeout, ``on_late_result`` gets its result (to abort a late communicator)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()
    timed_out = threading.Event()

    def settle(result: T | None, error: BaseException | None) -> None:
        if timed_out.is_set():  # nobody waits any more: release what came late
            if error is None and on_late_result is not None:
                with contextlib.suppress(Exception):
                    on_late_result(result)  # type: ignore[arg-type]
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]

    def body() -> None:
        result: T | None = None
        error: BaseException | None = None
        try:
            result = call(what, function)
        except BaseException as exc:
            error = exc if isinstance(exc, EngineError) else failure(what, exc)
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop is closed
            timed_out.set()
            settle(result, error)

    threading.Thread(target=body, name=f"commd-{what}", daemon=True).start()
    try:
        return await asyncio.wait_for(asyncio.shield(future), timeout_s)
    except TimeoutError:
        timed_out.set()
        raise EngineError(
            f"commd: {what} did not finish within {timeout_s:g}s; check that every node's "
            "daemon is up and can reach the others (NCCL_DEBUG=INFO tells more)"
        ) from None
