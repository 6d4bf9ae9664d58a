"""Cluster key files: writing one, reading one safely, and the local key beside the socket.

A key file is read only once it is known to be a small regular file: a FIFO would block the
start, a device (``/dev/zero``) would never end, a directory says nothing. Each is refused in
one line, before a byte is read.

Without ``--cluster-key`` a daemon uses the *local key* ``<directory of --socket>/cluster.key``,
made by the first daemon that needs it and shared by every daemon whose socket is in that
directory (tests, `make demo`). It is readable by the daemon's user and group only: whoever
can open the ipc socket (mode 0660, the same user and group) can already join jobs there, so
the key gives them nothing more; any other local user can reach the loopback peer port but
fails the CurveZMQ handshake (docs/security.md).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
import tomllib
from dataclasses import dataclass

import zmq

KEY_CHARS = 40  # a Curve25519 key in Z85
# `commd keygen` writes ~250 bytes; room for comments, never the read of a huge file.
MAX_KEY_FILE_BYTES = 4096
LOCAL_KEY_NAME = "cluster.key"
_LOCAL_MODE = 0o640  # user read/write, group read: the ipc socket's principals
_LOCAL_FORBIDDEN = 0o7777 & ~0o640  # 0600, 0640, 0400, 0440 pass


class KeyFileError(ValueError):
    """A cluster key file that cannot be used; the message says why and what to do."""


@dataclass(frozen=True)
class ClusterKey:
    """A CurveZMQ key pair in Z85: the same on every node of a cluster, for peers' handshakes."""

    public: bytes  # Z85
    secret: bytes  # Z85


def _key_text(public: bytes, secret: bytes, made_by: str) -> str:
    return (
        "# commd cluster key: the same file on every node of the cluster; keep it secret\n"
        f"# (whoever reads it can join, read and abort jobs). Made by {made_by}.\n"
        f'public = "{public.decode()}"\nsecret = "{secret.decode()}"\n'
    )


def generate_key(path: str) -> ClusterKey:
    """Write a new cluster key to ``path`` (created 0600, never overwritten)."""
    public, secret = zmq.curve_keypair()
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w", encoding="ascii") as handle:
        handle.write(_key_text(public, secret, "`commd keygen`"))
    return ClusterKey(public, secret)


def load_key(path: str) -> ClusterKey:
    """Read and check an explicit ``--cluster-key``: a regular file only its owner can read
    (mode 0600, like ssh's keys); KeyFileError names the problem."""
    info, data = _read_small_file(path, what="the cluster key", follow_links=True)
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise KeyFileError(f"commd: the cluster key {path} can be read by others (mode "
                           f"{stat.S_IMODE(info.st_mode):04o}); chmod 600 {path}")
    return _parse(path, data)


def local_key_path(socket_path: str) -> str:
    """Where the daemon serving ``socket_path`` keeps its local key."""
    return os.path.join(os.path.dirname(socket_path) or ".", LOCAL_KEY_NAME)


def local_key(socket_path: str) -> tuple[ClusterKey, str]:
    """The local key beside ``socket_path`` and its path: loaded if present (refused unless a
    regular file owned by this user that others cannot read or write), else made atomically.
    """
    path = local_key_path(socket_path)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
    except OSError as exc:
        raise KeyFileError(f"commd: cannot make the directory of the local cluster key {path}: "
                           f"{exc.strerror}; pass --socket in a directory of your own") from None
    for _ in range(2):  # absent, then made by another daemon between our look and our link
        try:
            return _load_local(path), path
        except FileNotFoundError:
            made = _make_local(path)
            if made is not None:
                return made, path
    return _load_local(path), path


def _load_local(path: str) -> ClusterKey:
    """FileNotFoundError if absent (the caller makes it); KeyFileError if unusable."""
    info, data = _read_small_file(path, what="the local cluster key", follow_links=False)
    if info.st_uid != os.geteuid():
        raise KeyFileError(
            f"commd: the local cluster key {path} belongs to uid {info.st_uid}, not to this "
            f"daemon's ({os.geteuid()}): another user made it; remove it, or pass --socket in "
            "a directory of your own")
    mode = stat.S_IMODE(info.st_mode)
    if mode & _LOCAL_FORBIDDEN:
        raise KeyFileError(f"commd: the local cluster key {path} has mode {mode:04o}: others "
                           f"could read or change it; chmod 640 {path} (or remove it)")
    return _parse(path, data)


def _make_local(path: str) -> ClusterKey | None:
    """Write a new key to a temporary file, then link it to ``path``: a daemon starting at the
    same moment sees the whole file or none. None: another daemon linked its key first."""
    public, secret = zmq.curve_keypair()
    try:
        descriptor, temporary = tempfile.mkstemp(prefix=".cluster.key.",
                                                 dir=os.path.dirname(path))
    except OSError as exc:
        raise KeyFileError(f"commd: cannot write the local cluster key {path}: {exc.strerror}; "
                           "pass --socket in a directory of your own") from None
    try:
        os.fchmod(descriptor, _LOCAL_MODE)  # not the umask's choice
        with os.fdopen(descriptor, "w", encoding="ascii") as handle:
            handle.write(_key_text(public, secret, "the first `commd run` serving a socket "
                                   "in this directory; it is used without --cluster-key"))
            handle.flush()
            os.fsync(handle.fileno())
        try:
            os.link(temporary, path)
        except FileExistsError:
            return None
        except OSError as exc:
            raise KeyFileError(f"commd: cannot write the local cluster key {path}: "
                               f"{exc.strerror}; pass --cluster-key FILE") from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
    return ClusterKey(public, secret)


def _kind(mode: int) -> str:
    kinds = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"),
             (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link"))
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def _check_regular(path: str, info: os.stat_result, what: str) -> None:
    if not stat.S_ISREG(info.st_mode):
        raise KeyFileError(f"commd: {what} {path} is {_kind(info.st_mode)}, not a regular file; "
                           "make a key with `commd keygen PATH`")
    if info.st_size > MAX_KEY_FILE_BYTES:
        raise KeyFileError(f"commd: {what} {path} is {info.st_size} bytes, more than a key file "
                           f"({MAX_KEY_FILE_BYTES} at most); make a key with `commd keygen PATH`")


def _read_small_file(path: str, what: str, follow_links: bool) -> tuple[os.stat_result, bytes]:
    """The file's status and its bytes, once it is known to be a small regular file. Checked
    by path before it is opened (opening some devices does something), then again on the
    descriptor (the path may have changed); opened non-blocking, so a FIFO cannot hang us."""
    try:
        _check_regular(path, os.stat(path) if follow_links else os.lstat(path), what)
        flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_links
                                                              else os.O_NOFOLLOW)
        descriptor = os.open(path, flags)
    except FileNotFoundError:
        if not follow_links:
            raise
        raise KeyFileError(f"commd: cannot read {what} {path}: No such file or directory") \
            from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise KeyFileError(f"commd: {what} {path} is a symbolic link; remove it") from None
        raise KeyFileError(f"commd: cannot read {what} {path}: {exc.strerror}") from None
    try:
        info = os.fstat(descriptor)
        _check_regular(path, info, what)
        chunks: list[bytes] = []
        size = 0
        while size <= MAX_KEY_FILE_BYTES:  # bounded even if the file grows meanwhile
            chunk = os.read(descriptor, MAX_KEY_FILE_BYTES + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        raise KeyFileError(f"commd: cannot read {what} {path}: {exc.strerror}") from None
    finally:
        os.close(descriptor)
    if size > MAX_KEY_FILE_BYTES:
        raise KeyFileError(f"commd: {what} {path} grew past {MAX_KEY_FILE_BYTES} bytes while "
                           "it was read; make a key with `commd keygen PATH`")
    return info, b"".join(chunks)


def _parse(path: str, data: bytes) -> ClusterKey:
    try:
        fields = tomllib.loads(data.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError):
        raise KeyFileError(f"commd: {path} is not a commd cluster key; make one with "
                           "`commd keygen PATH`") from None
    public, secret = fields.get("public"), fields.get("secret")
    if not all(isinstance(k, str) and len(k) == KEY_CHARS for k in (public, secret)):
        raise KeyFileError(f"commd: {path} needs 'public' and 'secret', {KEY_CHARS} Z85 "
                           "characters each; make a key with `commd keygen PATH`")
    assert isinstance(public, str) and isinstance(secret, str)
    try:
        matches = zmq.curve_public(secret.encode()) == public.encode()
    except (ValueError, zmq.ZMQError):
        matches = False
    if not matches:
        raise KeyFileError(f"commd: the public key in {path} is not the secret key's; "
                           "make a new key with `commd keygen PATH`")
    return ClusterKey(public.encode(), secret.encode())
