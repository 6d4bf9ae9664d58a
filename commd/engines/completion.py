"""How a collective or a device operation reports back to the event loop: a future."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

# A collective's future resolves to the seconds the collective itself took when the engine
# measures it (device timing events), else to None (the caller times it from the outside).
Completion = asyncio.Future[float | None]


def bridge_future(
    loop: asyncio.AbstractEventLoop,
) -> tuple[Completion, Callable[[BaseException | None], None]]:
    """An asyncio future plus a thread-safe callback that completes it with an error or not."""
    future: Completion = loop.create_future()

    def settle(error: BaseException | None) -> None:
        if future.done():
            return
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)

    def from_any_thread(error: BaseException | None = None) -> None:
        loop.call_soon_threadsafe(settle, error)

    return future, from_any_thread
