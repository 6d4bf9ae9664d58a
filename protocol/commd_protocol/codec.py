"""Encoding and decoding at the socket boundary.

One decoder per direction; a decode failure is turned into a ``ProtocolViolation`` that names
the field, so the daemon can answer with a typed error and keep serving everyone else.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import msgspec

from .errors import ErrorCode
from .messages import ClientMessage, DaemonMessage
from .peer import PeerMessage

MAX_MESSAGE_BYTES = 4 * 1024 * 1024  # a 2000-layer register is ~100 KB; this leaves room

T = TypeVar("T")


class ProtocolViolation(Exception):
    """A frame that cannot be accepted; ``code`` and ``args[0]`` go into the error reply."""

    def __init__(self, message: str, code: ErrorCode, ref: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.ref = ref


_encoder = msgspec.msgpack.Encoder()


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


class Codec(Generic[T]):
    """Decodes one tagged union, turning every failure into a ``ProtocolViolation``."""

    def __init__(self, union: Any, max_bytes: int = MAX_MESSAGE_BYTES) -> None:
        self._decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(union)
        self._tags = _tags_of(union)
        self.max_bytes = max_bytes

    def decode(self, frame: bytes) -> T:
        if len(frame) > self.max_bytes:
            raise ProtocolViolation(
                f"message of {len(frame)} bytes is over the limit of {self.max_bytes}",
                ErrorCode.TOO_LARGE,
            )
        try:
            return self._decoder.decode(frame)  # type: ignore[no-any-return]
        except msgspec.DecodeError as exc:
            raise self._explain(frame, exc) from None
        except RecursionError:
            raise _too_deep() from None

    def _explain(self, frame: bytes, exc: msgspec.DecodeError) -> ProtocolViolation:
        # Only the tag is decoded again, the rest skipped: a 4 MiB map refused at its last
        # field must not be built a second time just to say so.
        try:
            _skipper.decode(frame)  # well-formed MessagePack? (checked, nothing built)
            tag = _tag_decoder.decode(frame).type
        except msgspec.ValidationError:  # MessagePack, but not a map
            return ProtocolViolation(
                f"a message must be a map with a 'type' field, got {_kind(frame)}",
                ErrorCode.MALFORMED,
            )
        except msgspec.DecodeError:
            return ProtocolViolation(f"not a MessagePack message ({exc})", ErrorCode.MALFORMED)
        except RecursionError:
            return _too_deep()
        if tag is None:
            return ProtocolViolation("message is missing its 'type' field", ErrorCode.MALFORMED)
        if not isinstance(tag, str) or tag not in self._tags:
            return ProtocolViolation(
                f"unknown message type {tag!r}; known types: {', '.join(sorted(self._tags))}",
                ErrorCode.UNKNOWN_TYPE,
                ref=str(tag),
            )
        # msgspec names the offending field, e.g. "Expected `int`, got `str` - at `$.rank`".
        return ProtocolViolation(f"bad {tag!r} message: {exc}", ErrorCode.MALFORMED, ref=str(tag))


class _Tagged(msgspec.Struct, forbid_unknown_fields=False):
    type: Any = None


_tag_decoder = msgspec.msgpack.Decoder(_Tagged)
_skipper = msgspec.msgpack.Decoder(msgspec.Raw)


def frame_tag(frame: bytes) -> str | None:
    """A frame's ``type``, read without decoding the rest (skipped, not built); None when it
    is no map or its type no string (its full decode says why)."""
    try:
        tag = _tag_decoder.decode(frame).type
    except (msgspec.DecodeError, RecursionError):
        return None
    return tag if isinstance(tag, str) else None


def _kind(frame: bytes) -> str:
    """The Python type a MessagePack value decodes to, from its first byte (not a map)."""
    first = frame[0]
    if first <= 0x7F or first >= 0xE0 or 0xCC <= first <= 0xD3:
        return "int"
    if 0x90 <= first <= 0x9F or first in (0xDC, 0xDD):
        return "list"
    if 0xA0 <= first <= 0xBF or 0xD9 <= first <= 0xDB:
        return "str"
    kinds = {0xC0: "NoneType", 0xC2: "bool", 0xC3: "bool", 0xC4: "bytes", 0xC5: "bytes",
             0xC6: "bytes", 0xCA: "float", 0xCB: "float"}
    return kinds.get(first, "ExtType")


def _too_deep() -> ProtocolViolation:
    # msgspec stops at its recursion limit; no message of the protocol nests more than 3 deep.
    return ProtocolViolation("message is nested too deeply", ErrorCode.MALFORMED)


def _tags_of(union: Any) -> set[str]:
    members = getattr(union, "__args__", (union,))
    return {m.__struct_config__.tag for m in members}


client_codec: Codec[ClientMessage] = Codec(ClientMessage)
daemon_codec: Codec[DaemonMessage] = Codec(DaemonMessage)
peer_codec: Codec[PeerMessage] = Codec(PeerMessage)
