"""sd_notify(3) in a few lines: tell systemd that the daemon is ready, alive or stopping.

Every call is a no-op returning False outside systemd (``$NOTIFY_SOCKET`` unset), so the
daemon calls these unconditionally and `commd run` behaves the same in a terminal.

One datagram socket is opened per call rather than kept open: messages are rare (a handful at
start and stop, one watchdog ping every ~15 s), so the cost does not matter, while a fresh
``sendto`` re-reads ``$NOTIFY_SOCKET`` each time (tests swap it), leaves no descriptor to leak
into children, and keeps working after ``systemctl daemon-reexec`` recreates the socket.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable

__all__ = [
    "notify",
    "ready",
    "status",
    "stopping",
    "watchdog_interval",
    "watchdog_loop",
]

log = logging.getLogger(__name__)


def _address(value: str) -> str | None:
    """The AF_UNIX address named by ``$NOTIFY_SOCKET``; None for forms we do not speak."""
    if value.startswith("@") and len(value) > 1:
        return "\0" + value[1:]  # Linux abstract namespace: a leading NUL byte, no file.
    if value.startswith("/"):
        return value
    return None  # e.g. systemd ≥ 253's "vsock:…", only used for VMs.


def notify(*fields: str) -> bool:
    """Send ``"\\n".join(fields)`` (``"READY=1"``, ``"STATUS=…"``, …) as one datagram.

    Returns True when the datagram was sent, False when not under systemd or on failure.
    Never raises for I/O problems: losing a status line must not take the daemon down.
    """
    for field in fields:
        # A newline inside a field would smuggle in another assignment.
        if "\n" in field:
            raise ValueError(f"commd: sd_notify field {field!r} contains a newline")
    value = os.environ.get("NOTIFY_SOCKET")
    if not value:
        return False
    address = _address(value)
    if address is None:
        log.warning("commd: NOTIFY_SOCKET=%r is not a unix socket address; not notifying", value)
        return False
    payload = "\n".join(fields).encode()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            # Non-blocking: this runs on the event loop, which must never wait on systemd. A
            # full queue (EAGAIN) drops the message; the next watchdog ping follows shortly.
            sock.setblocking(False)
            sock.sendto(payload, address)
    except OSError as exc:
        log.warning("commd: sd_notify to %s failed: %s", value, exc)
        return False
    return True


def _status_field(text: str) -> str:
    # systemd shows one line per unit in `systemctl status`; flatten instead of rejecting.
    return "STATUS=" + " ".join(text.splitlines())


def ready(status: str = "") -> bool:
    """READY=1 (call only once every socket is bound), with an optional status line."""
    fields = ["READY=1"]
    if status:
        fields.append(_status_field(status))
    return notify(*fields)


def status(text: str) -> bool:
    """Replace the one-line status shown by ``systemctl status commd``."""
    return notify(_status_field(text))


def stopping(status: str = "") -> bool:
    """STOPPING=1: the daemon is draining; systemd waits for exit up to TimeoutStopSec."""
    fields = ["STOPPING=1"]
    if status:
        fields.append(_status_field(status))
    return notify(*fields)


def watchdog_interval() -> float | None:
    """The watchdog timeout in seconds (``$WATCHDOG_USEC``), or None when there is none.

    Like sd_watchdog_enabled(3): when ``$WATCHDOG_PID`` is set it must be this process, so a
    child that inherited the environment does not ping on the daemon's behalf.
    """
    raw = os.environ.get("WATCHDOG_USEC")
    if not raw:
        return None
    pid = os.environ.get("WATCHDOG_PID")
    if pid:
        try:
            if int(pid) != os.getpid():
                return None
        except ValueError:
            log.warning("commd: ignoring WATCHDOG_PID=%r: not a number", pid)
            return None
    try:
        usec = int(raw)
    except ValueError:
        log.warning("commd: ignoring WATCHDOG_USEC=%r: not a number", raw)
        return None
    return usec / 1_000_000 if usec > 0 else None


async def watchdog_loop(interval: float | None = None,
                        alive: Callable[[], bool] | None = None) -> None:
    """Send WATCHDOG=1 every ``interval / 2`` seconds until cancelled, while ``alive()``.

    ``interval`` defaults to `watchdog_interval()`; returns at once when there is no watchdog
    or no notify socket. The pings come from the event loop itself, so a loop that blocks for
    longer than the interval stops them and systemd restarts the daemon — that is the point.
    Likewise the first time ``alive()`` is false (a message loop has ended) the pings stop for
    good, and systemd restarts a daemon that could no longer serve.
    """
    if interval is None:
        interval = watchdog_interval()
    if interval is None or interval <= 0 or not os.environ.get("NOTIFY_SOCKET"):
        return
    # Half the timeout, as sd_watchdog_enabled(3) advises: one late ping is not fatal.
    period = interval / 2
    log.debug("commd: systemd watchdog %.3f s, pinging every %.3f s", interval, period)
    loop = asyncio.get_running_loop()
    next_at = loop.time()
    while True:
        if alive is not None and not alive():
            log.error("commd: a message loop has stopped; no more watchdog pings, so that "
                      "systemd restarts the daemon")
            return
        notify("WATCHDOG=1")
        # Fixed schedule (no drift from send time); after a stall, one ping at once and the
        # schedule restarts from now, never a burst of catch-up pings.
        next_at = max(next_at + period, loop.time())
        await asyncio.sleep(next_at - loop.time())
