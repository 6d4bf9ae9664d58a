"""Hostile frames for the daemons' sockets: what bench/fuzz.py (seeded ``random``) and
tests/daemon/test_fuzz.py (hypothesis) both build on.

A frame is MessagePack written by ``pack``, which also writes what msgpack will not: ``Raw``
bytes where a value goes (nesting deeper than msgpack packs, invalid UTF-8) and a map that
names a key twice (its ``DUP`` pairs). msgpack is a development dependency: this module is for
the tests and benchmarks, never imported by commd itself."""

from __future__ import annotations

import math
from typing import Any

import msgpack
import msgspec

from commd_protocol import (
    ErrorCode,
    Goodbye,
    Hello,
    PeerJoin,
    PeerPlan,
    PeerProfile,
    ProtocolViolation,
    Ready,
    Register,
    StatusRequest,
    Wait,
)
from commd_protocol.codec import client_codec, daemon_codec, peer_codec

CODES = {code.value for code in ErrorCode}
POOL = ("fz0", "fz1", "fz2")  # few job ids, so that the frames of one run meet each other's jobs
TAGS = sorted({*client_codec._tags, *daemon_codec._tags, *peer_codec._tags})
FIELDS = sorted({f for struct in (Hello, Register, Ready, Wait, PeerJoin, PeerProfile, PeerPlan)
                 for f in struct.__struct_fields__})


class Raw(bytes):
    """MessagePack bytes placed verbatim where a value goes (nesting deeper than msgpack
    packs, invalid UTF-8)."""


DUP = "\x00dup"  # the key under which a map keeps the (key, value) pairs it repeats


def pack(value: Any) -> bytes:
    """MessagePack of ``value``; ``Raw`` parts go in as they are, and a map's ``DUP`` pairs
    follow its items, so that it may name a key twice."""
    if isinstance(value, Raw):
        return bytes(value)
    if isinstance(value, dict):
        items = [(k, v) for k, v in value.items() if k != DUP] + list(value.get(DUP, []))
        return _header(len(items), 0x80, b"\xde", b"\xdf") + b"".join(
            pack(k) + pack(v) for k, v in items)
    if isinstance(value, list):
        return _header(len(value), 0x90, b"\xdc", b"\xdd") + b"".join(pack(v) for v in value)
    packed: bytes = msgpack.packb(value, use_bin_type=True)
    return packed


def _header(n: int, fix: int, b16: bytes, b32: bytes) -> bytes:
    """A map's or an array's header: fixmap/fixarray, then the 16- and 32-bit forms."""
    if n < 16:
        return bytes([fix | n])
    return b16 + n.to_bytes(2, "big") if n < 65536 else b32 + n.to_bytes(4, "big")


def builtins(message: msgspec.Struct) -> dict[str, Any]:
    """A message as the dict ``pack`` writes (its tag under "type")."""
    value: dict[str, Any] = msgspec.to_builtins(message, builtin_types=(bytes,))
    return value


HUGE = [2**31, 2**31 - 1, -(2**31) - 1, 2**32, 2**53 + 1, 2**63 - 1, -(2**63), 2**64 - 1]
SPECIAL: list[Any] = [
    None, True, False, 0, -1, *HUGE, math.nan, math.inf, -math.inf, -0.0, 1e308, 5e-324,
    "", "x" * 5000, "x" * 200_000, "\u202e\x00", Raw(b"\xa2\xff\xfe"),  # the last: not UTF-8
    b"", b"\x00" * 70, [], {}, [None], [[]], {"": None}, {1: 2},
    msgpack.ExtType(5, b"ext"), msgpack.Timestamp(0, 0),
    Raw(b"\xd5\xff\x00\x00"),  # a timestamp of a length that does not exist
    [-1], [2**63 - 1],
    [math.nan], [[0, 0, math.inf, 1.0]], [{"name": "w", "size": -1}],
    [{"name": "w", "size": 2**63 - 1}], [{"name": 1, "size": "1"}], [{"size": 1}],
    [{"name": "w", "size": 4, "rows": 3}], [{"name": "w", "size": 4, "rows": -1}],
    [{"name": "w", "size": 4, "rows": 2**64 - 1}],
]


def decoded(frame: Any) -> Any:
    """The client message a frame is, or None (not bytes, or not a valid message)."""
    if not isinstance(frame, bytes):
        return None
    try:
        return client_codec.decode(frame)
    except ProtocolViolation:
        return None


def decoded_deeper(frame: bytes, frames: int) -> Any:
    """``decoded(frame)`` called ``frames`` Python frames deeper."""
    return decoded_deeper(frame, frames - 1) if frames else decoded(frame)


def stack_sensitive(frame: Any) -> bool:
    """A goodbye or status whose decoding depends on the caller's stack depth (msgspec's
    nesting limit is Python's recursion limit): the daemon may call it malformed where this
    process sees the message, and a reply would be missing or extra. tests/daemon/test_fuzz.py has
    the case as an xfail test; neither it nor bench/fuzz.py sends such frames otherwise."""
    return isinstance(decoded(frame), Goodbye | StatusRequest) and \
        decoded_deeper(frame, 200) is None
