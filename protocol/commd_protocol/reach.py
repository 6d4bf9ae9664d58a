"""A daemon's ipc socket this user may not open, said as such: for the client and `commd status`.

ZeroMQ connects to an ipc socket in the background and retries for ever, so a socket this
user may not open (it is 0660: the daemon's user and group only) looked like a daemon that
never answers. One plain ``connect`` first tells the kernel's refusal apart.
"""

from __future__ import annotations

import errno
import grp
import os
import pwd
import socket
import stat
from collections.abc import Callable
from typing import Any

__all__ = ["connect_problem", "unreachable"]

_PROBE_S = 2.0  # a daemon too busy to accept at once is ZeroMQ's to wait for, not ours


def unreachable(path: str, hint: str = "is `commd run` running?") -> str:
    """'' when ``path`` is a socket this process may connect to, else the one "commd: " line
    saying why not: no socket there (``hint`` says what to check), or permission denied —
    also when a directory on the way may not be searched, which makes the socket look absent
    to this user (the default /run/commd is the daemon's)."""
    if not os.path.exists(path):
        closed = _closed_directory(path)
        if closed:
            return (f"commd: permission denied on the directory {closed} of the daemon socket "
                    f"{path}: this user (uid {os.geteuid()}) may not look inside it; ask to be "
                    "added to its group, or run as its user")
        return f"commd: no daemon socket at {path}; {hint}"
    return connect_problem(path, hint)


def _closed_directory(path: str) -> str:
    """The first directory on the way to ``path`` that this user may not search ('': none;
    the path is then simply absent)."""
    folder = os.path.dirname(os.path.abspath(path))
    parts = folder.split(os.sep)[1:]
    for depth in range(len(parts) + 1):
        ancestor = os.sep + os.sep.join(parts[:depth])
        if not os.path.isdir(ancestor):
            return ""
        if not os.access(ancestor, os.X_OK):
            return ancestor
    return ""


def connect_problem(path: str, hint: str = "is `commd run` running?") -> str:
    """'' unless a connection to the socket file ``path`` fails for a reason a client should
    hear now: the kernel refuses this process (a "commd: " line naming the socket's mode,
    user and group and what to do), or nothing listens there (a daemon that was killed
    leaves its socket file behind; ``hint`` says what to check). A client would otherwise
    wait in silence for its timeout."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(_PROBE_S)
    try:
        probe.connect(path)
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EPERM):
            return (f"commd: permission denied on the daemon socket {path}{_owners(path)}: "
                    f"this user (uid {os.geteuid()}) may not open it; ask to be added to its "
                    "group, or run as its user")
        if exc.errno == errno.ECONNREFUSED:
            return (f"commd: no daemon listens on {path} (a socket file left by a daemon that "
                    f"stopped); {hint}")
    finally:
        probe.close()
    return ""


def _owners(path: str) -> str:
    """' (mode 0660, user U, group G)' when the socket can be looked at, else ''."""
    try:
        info = os.stat(path)
    except OSError:  # a directory on the way that this user may not search
        return ""
    return (f" (mode {stat.S_IMODE(info.st_mode):04o}, user {_name(pwd.getpwuid, info.st_uid)}"
            f", group {_name(grp.getgrgid, info.st_gid)})")


def _name(lookup: Callable[[int], Any], number: int) -> str:
    try:
        return str(lookup(number)[0])
    except (KeyError, OverflowError):
        return str(number)
