"""Errors shared by the client and the daemon.

One root, ``CommdError``; every message starts with ``commd: `` and says what to do next.
"""

from __future__ import annotations

from enum import StrEnum


class ErrorCode(StrEnum):
    """Machine-readable reason carried in an ``Error`` reply."""

    MALFORMED = "malformed"  # bytes that are not a valid message
    UNKNOWN_TYPE = "unknown_type"  # a message type the daemon does not know
    TOO_LARGE = "too_large"  # a frame over the daemon's size limit
    VERSION = "version"  # protocol version mismatch
    OUT_OF_ORDER = "out_of_order"  # e.g. register before hello, wait before register
    INVALID = "invalid"  # a well-formed message with a bad value
    MISMATCH = "mismatch"  # ranks of one job disagree (layers, dtype, op, world size)
    RANK_LOST = "rank_lost"  # a rank or a node of the job went away
    ENGINE = "engine"  # the collective engine failed
    TIMEOUT = "timeout"
    SHUTDOWN = "shutdown"  # the daemon is stopping
    LIMIT = "limit"  # over a limit of the daemon: jobs, connections, layers, bytes


PREFIX = "commd: "


def prefixed(message: str, context: str = "") -> str:
    """``message`` as commd says it: unchanged when it starts with "commd: ", else behind the
    prefix and ``context`` (e.g. "job 'j1': ")."""
    return message if message.startswith(PREFIX) else f"{PREFIX}{context}{message}"


class CommdError(Exception):
    """Root of every commd error. ``code`` says why, machine-readably."""

    def __init__(self, message: str, code: ErrorCode | str = ErrorCode.INVALID) -> None:
        super().__init__(prefixed(message))
        self.code = ErrorCode(code) if code in ErrorCode._value2member_map_ else code

    @property
    def message(self) -> str:
        return str(self.args[0])


class CommdValueError(CommdError, ValueError):
    """An argument with a bad value; the message names the argument."""


class CommdTypeError(CommdError, TypeError):
    """An argument of the wrong type; the message names the argument."""


class CommdTimeout(CommdError, TimeoutError):
    """A wait, a registration or a collective ran past its timeout."""

    def __init__(self, message: str) -> None:
        super().__init__(message, ErrorCode.TIMEOUT)


def error_from_reply(code: str, message: str) -> CommdError:
    """Turn an ``Error`` reply from the daemon into the matching exception."""
    if code == ErrorCode.TIMEOUT:
        return CommdTimeout(message)
    return CommdError(message, code)
