"""Hostile frames for the daemons' sockets: the one generator bench/fuzz.py (seeded
``random``) and tests/daemon/test_fuzz.py (hypothesis) both draw from.

``frame(draws, side)`` builds one frame: a valid message of a type this module knows, changed
(a field dropped, duplicated or retyped, huge ints, negative sizes, NaN and infinities, long
strings, deep nesting, unknown tags, extra fields, cut or flipped bytes), or random bytes, a
random MessagePack value, a map in a message's shape, a valid message as it is, a message of
several ZeroMQ frames. Every choice it makes comes from ``draws``: ``RandomDraws`` (a seeded
``random.Random``: reproducible for a seed) or, through ``frames(side)``, hypothesis's own
draws, so that hypothesis shrinks a failing example. A new message type is added here, once
(``client_message`` or ``peer_message``), and both fuzzers send it.

A frame is MessagePack written by ``pack``, which also writes what msgpack will not: ``Raw``
bytes where a value goes (nesting deeper than msgpack packs, invalid UTF-8) and a map that
names a key twice (its ``DUP`` pairs). msgpack and hypothesis are development dependencies:
this module is for the tests and benchmarks, never imported by commd itself."""

from __future__ import annotations

import math
import os
import random
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol, TypeVar

import msgpack
import msgspec
from hypothesis import strategies as st

from commd_protocol import (
    DTYPES,
    OPS,
    PROTOCOL_VERSION,
    Done,
    Error,
    ErrorCode,
    Goodbye,
    Hello,
    Layer,
    PeerAbort,
    PeerFault,
    PeerHeartbeat,
    PeerJoin,
    PeerLeave,
    PeerPlan,
    PeerProfile,
    PeerRedirect,
    PeerReform,
    PeerReformState,
    PeerResume,
    PeerSetup,
    PeerStatus,
    PeerSuccession,
    PeerTakeover,
    ProtocolViolation,
    Ready,
    Register,
    RosterEntry,
    StatusReply,
    StatusRequest,
    TraceRequest,
    Wait,
    Welcome,
)
from commd_protocol.codec import client_codec, daemon_codec, peer_codec
from commd_protocol.messages import Registered

T = TypeVar("T")

CODES = {code.value for code in ErrorCode}
POOL = ("fz0", "fz1", "fz2")  # few job ids, so that the frames of one run meet each other's jobs
TAGS = sorted({*client_codec._tags, *daemon_codec._tags, *peer_codec._tags})
FIELDS = sorted({f for struct in (Hello, Register, Ready, Wait, TraceRequest, PeerJoin,
                                  PeerProfile, PeerPlan, PeerSetup, PeerHeartbeat, PeerFault,
                                  PeerReformState, PeerTakeover, PeerSuccession)
                 for f in struct.__struct_fields__})
RUNNING_LAYERS = 3  # the layers of the one-rank job that "running" frames are aimed at

Frame = bytes | list[bytes]  # a list: one message of several ZeroMQ frames
Side = Literal["ipc", "peer", "running"]  # "running": into a registered job, mostly ready/wait


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
    [{"name": "w", "size": 4, "rows": 2**64 - 1}], [0] * 3000,
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


# --- where the choices come from -------------------------------------------------------------


class Draws(Protocol):
    """Every choice a frame's generator makes. The "any" draws are each source's own idea of
    an arbitrary value (hypothesis's reach edge cases a uniform draw would not)."""

    def integer(self, low: int, high: int) -> int: ...

    def real(self, low: float, high: float) -> float: ...

    def choice(self, options: Sequence[T]) -> T: ...

    def shuffled(self, items: Sequence[T]) -> list[T]: ...

    def any_float(self) -> float: ...

    def any_text(self, max_size: int) -> str: ...

    def any_bytes(self, max_size: int) -> bytes: ...


class RandomDraws:
    """Draws from one seeded ``random.Random``: the same frames for the same seed."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def integer(self, low: int, high: int) -> int:
        return self.rng.randint(low, high)

    def real(self, low: float, high: float) -> float:
        return self.rng.uniform(low, high)

    def choice(self, options: Sequence[T]) -> T:
        return self.rng.choice(options)

    def shuffled(self, items: Sequence[T]) -> list[T]:
        return self.rng.sample(list(items), len(items))

    def any_float(self) -> float:
        r = self.rng
        return r.choice([r.uniform(-1e308, 1e308), r.uniform(-1e9, 1e9), r.random(), -r.random()])

    def any_text(self, max_size: int) -> str:
        r = self.rng
        return "".join(chr(r.randint(1, 0x4FF)) for _ in range(r.randint(0, max_size)))

    def any_bytes(self, max_size: int) -> bytes:
        return self.rng.randbytes(self.rng.randint(0, max_size))


class HypothesisDraws:
    """Draws through hypothesis (inside ``@given`` or ``st.composite``): each choice is one of
    its strategies, so it can shrink them."""

    def __init__(self, draw: st.DrawFn) -> None:
        self.draw = draw

    def integer(self, low: int, high: int) -> int:
        return self.draw(st.integers(low, high))

    def real(self, low: float, high: float) -> float:
        return self.draw(st.floats(low, high))

    def choice(self, options: Sequence[T]) -> T:
        return self.draw(st.sampled_from(options))

    def shuffled(self, items: Sequence[T]) -> list[T]:
        return self.draw(st.permutations(items))

    def any_float(self) -> float:
        return self.draw(st.floats())

    def any_text(self, max_size: int) -> str:
        return self.draw(st.text(max_size=max_size))

    def any_bytes(self, max_size: int) -> bytes:
        return self.draw(st.binary(max_size=max_size))


def weighted(draws: Draws, options: Sequence[tuple[int, T]]) -> T:
    """One of ``options`` (weight, option), in proportion to its weight. Hypothesis shrinks
    towards the first."""
    roll = draws.integer(0, sum(weight for weight, _ in options) - 1)
    for weight, option in options:
        if roll < weight:
            return option
        roll -= weight
    raise AssertionError("unreachable: the roll is below the total weight")


# --- valid messages of every type --------------------------------------------------------------


def _layers(d: Draws) -> list[Layer]:
    return [Layer(name=f"l{i}", size=d.integer(1, 64)) for i in range(d.integer(1, 4))]


def _reals(d: Draws, count: int) -> list[float]:
    return [d.real(0, 1e3) for _ in range(count)]


def _hello(d: Draws) -> Hello:
    world = d.integer(1, 4)
    local_world = d.integer(1, world)
    return Hello(protocol=PROTOCOL_VERSION, job=d.choice(POOL), rank=d.integer(0, world - 1),
                 world_size=world, local_rank=d.integer(0, local_world - 1),
                 local_world_size=local_world, coordinator="127.0.0.1:1",
                 pid=d.choice([0, 1, os.getpid()]))


def _register(d: Draws) -> Register:
    return Register(layers=_layers(d), dtype=d.choice(DTYPES), op=d.choice(OPS),
                    buffer_token=d.choice(["", "0" * 32, "commd-no-such-token"]),
                    planner=d.choice(["", "wfbp", "optimal", "syncea", "fixed:1MB"]),
                    compression=d.choice(["none", "topk:0.01"]), profile=d.choice([True, False]),
                    device=d.choice(["cpu", "cuda"]),
                    device_bus_id=d.choice(["", "0000:01:00.0"]),
                    ipc_handle=d.choice([b"", b"\x01" * 64]), ipc_offset=d.integer(0, 64),
                    event_handle=d.choice([b"", b"\x02" * 64]))


def _ready(d: Draws) -> Ready:
    count = d.integer(0, 3)
    return Ready(layers=[d.integer(-1, 3) for _ in range(count)], sent_at=d.real(0, 1e3),
                 stamps=d.choice([[], _reals(d, count)]))


def _wait(d: Draws) -> Wait:
    return Wait(iteration=d.integer(-1, 4))


def _status(d: Draws) -> StatusRequest:
    return StatusRequest()


def _goodbye(d: Draws) -> Goodbye:
    return Goodbye()


def _trace(d: Draws) -> TraceRequest:
    return TraceRequest(job=d.choice(POOL), iterations=d.integer(0, 3),
                        timeout_s=d.real(0.0, 2.0))


def _wrong_way(d: Draws) -> msgspec.Struct:
    """A daemon's message, sent to a daemon."""
    return d.choice([
        Welcome(protocol=PROTOCOL_VERSION, version="0", backend="gloo"),
        Done(iteration=d.integer(0, 3)),
        Error(code=d.choice(sorted(CODES)), message="commd: x"),
        Registered(nodes=1, node_index=0, groups=[[0]], planner="wfbp"),
        StatusReply(status={}),
    ])


def client_message(d: Draws) -> msgspec.Struct:
    """A valid message of any type a rank sends (or a daemon's, the wrong way)."""
    make: Callable[[Draws], msgspec.Struct] = weighted(d, [
        (1, _hello), (1, _register), (2, _ready), (2, _wait), (1, _status), (1, _goodbye),
        (1, _trace), (3, _wrong_way)])
    return make(d)


def _join(d: Draws) -> PeerJoin:
    world = d.integer(1, 3)
    ranks = d.shuffled(range(world))[:d.integer(1, world)]
    return PeerJoin(protocol=PROTOCOL_VERSION, job=d.choice(POOL), ranks=ranks, world_size=world,
                    layers=_layers(d), dtype=d.choice(DTYPES), op=d.choice(OPS),
                    planner=d.choice(["wfbp", "optimal", "syncea", "mgwfbp"]),
                    host="127.0.0.1", compression=d.choice(["none", "topk:0.05"]),
                    profile=d.choice([True, False]))


def _profile(d: Draws) -> PeerProfile:
    rows = [[d.real(-1, 1e6) for _ in range(d.choice([4, 5]))] for _ in range(d.integer(0, 4))]
    return PeerProfile(job=d.choice(POOL), round=d.integer(-1, 3), iteration=d.integer(-1, 30),
                       ready_offsets_s=_reals(d, d.integer(0, 4)), comm=rows,
                       measured_comm_s=d.real(0, 1), iteration_s=d.real(0, 1),
                       gains=[[d.real(0, 2), d.real(0, 2)] for _ in range(d.integer(0, 2))],
                       plan=d.integer(0, 3), step_s=d.real(0, 1))


def _leave(d: Draws) -> PeerLeave:
    return PeerLeave(job=d.choice(POOL))


def _abort(d: Draws) -> PeerAbort:
    return PeerAbort(job=d.choice(POOL), code=d.choice(sorted(CODES)), message="commd: x")


def _setup(d: Draws) -> PeerSetup:
    return PeerSetup(job=d.choice(POOL), generation=d.integer(0, 3), node_index=d.integer(0, 2),
                     nodes=d.integer(1, 3), store_port=d.integer(0, 65535), planner="wfbp")


def _plan(d: Draws) -> PeerPlan:
    return PeerPlan(job=d.choice(POOL), round=d.integer(0, 3),
                    effective_iteration=d.integer(0, 30), version=d.integer(0, 3),
                    groups=[[0]], alpha_s=d.real(0, 1), beta_s_per_byte=d.real(0, 1),
                    predicted_comm_s=d.real(0, 1))


def _heartbeat(d: Draws) -> PeerHeartbeat:
    return PeerHeartbeat(job=d.choice(POOL), iteration=d.integer(-1, 30),
                         waiting_s=d.real(0, 100), wire_s=d.real(0, 100),
                         missing=[[d.integer(-1, 3), d.integer(-1, 3)]
                                  for _ in range(d.integer(0, 2))])


def _roster(d: Draws) -> list[RosterEntry]:
    return [RosterEntry(peer=f"127.0.0.1:{d.integer(1, 65535)}", ranks=[index])
            for index in range(d.integer(0, 3))]


def _fault(d: Draws) -> PeerFault:
    return PeerFault(job=d.choice(POOL), epoch=d.integer(0, 3), message="commd: x",
                     closed=d.choice([True, False]),
                     lost_ranks=d.shuffled(range(3))[:d.integer(0, 2)])


def _reform_state(d: Draws) -> PeerReformState:
    return PeerReformState(job=d.choice(POOL), epoch=d.integer(0, 3),
                           delivered=d.integer(-1, 30), committing=d.choice([True, False]),
                           joining=d.choice([True, False]))


def _takeover(d: Draws) -> PeerTakeover:
    join = _join(d)
    return PeerTakeover(job=join.job, epoch=d.integer(0, 3), delivered=d.integer(-1, 30),
                        committing=d.choice([True, False]), join=join, roster=_roster(d),
                        lost=f"127.0.0.1:{d.integer(1, 65535)}", plan=d.integer(0, 3),
                        plans=[_plan(d) for _ in range(d.integer(0, 2))],
                        crash=d.choice([True, False]),
                        dead=[d.choice(["127.0.0.1:1", "nowhere", "x" * 400])
                              for _ in range(d.integer(0, 2))])


def _succession(d: Draws) -> PeerSuccession:
    """A node's word that a job was taken over elsewhere from this address (valid or not)."""
    return PeerSuccession(job=d.choice(POOL), lost=f"127.0.0.1:{d.integer(0, 65535)}",
                          coordinator=d.choice([f"127.0.0.1:{d.integer(0, 70000)}", "nowhere",
                                                "[::1]:1", ""]))


def _coordinators_own(d: Draws) -> msgspec.Struct:
    """A coordinator's message to its nodes, sent to a coordinator's peer port."""
    return d.choice([
        PeerStatus(job=d.choice(POOL)),
        PeerRedirect(job=d.choice(POOL), coordinator=f"127.0.0.1:{d.integer(1, 65535)}"),
        PeerReform(job=d.choice(POOL), epoch=d.integer(0, 3), change="x"),
        PeerResume(job=d.choice(POOL), epoch=d.integer(0, 3), node_index=0, nodes=1,
                   store_port=0, store_prefix="x", members=[0], iteration=0),
    ])


def peer_message(d: Draws) -> msgspec.Struct:
    """A valid message of any type a daemon sends a peer (or a rank's, or a coordinator's
    to its nodes, on the peer port): joins, reports, membership changes, takeovers."""
    make: Callable[[Draws], msgspec.Struct] = weighted(d, [
        (2, _join), (2, _profile), (1, _leave), (1, _abort), (1, _setup), (1, _plan),
        (1, _heartbeat), (1, _fault), (1, _reform_state), (1, _takeover), (1, _succession),
        (1, _coordinators_own), (1, client_message)])
    return make(d)


def _whole_ready(d: Draws) -> Ready:
    """Every layer of the running job, in some order: an iteration can complete."""
    return Ready(layers=d.shuffled(range(RUNNING_LAYERS)))


def _running_wait(d: Draws) -> Wait:
    return Wait(iteration=d.integer(-2, 3))


def running_message(d: Draws) -> msgspec.Struct:
    """A valid message aimed at a running job: mostly ready and wait."""
    make: Callable[[Draws], msgspec.Struct] = weighted(d, [
        (2, _ready), (1, _whole_ready), (2, _running_wait), (1, client_message)])
    return make(d)


# --- hostile values and frames -----------------------------------------------------------------


def hostile(d: Draws) -> Any:
    """A value no field expects: a special one, a huge int, an odd float, text or bytes, a
    list of ints, or arrays nested up to 1500 deep."""
    kind = weighted(d, [(3, "special"), (1, "int"), (1, "float"), (1, "text"), (1, "bytes"),
                        (1, "ints"), (1, "deep")])
    if kind == "special":
        return d.choice(SPECIAL)
    if kind == "int":
        return d.integer(-(2**63), 2**64 - 1)
    if kind == "float":
        return d.any_float()
    if kind == "text":
        return d.any_text(40)
    if kind == "bytes":
        return d.any_bytes(40)
    if kind == "ints":
        return [d.integer(-(2**63), 2**64 - 1) for _ in range(d.integer(0, 6))]
    return Raw(b"\x91" * d.integer(1, 1500) + b"\xc0")


def msgpack_value(d: Draws, depth: int = 0) -> Any:
    """A random MessagePack value, nested at most 3 deep (maps keyed mostly by field names)."""
    kinds = ["constant", "int", "float", "text", "bytes", "bytes"]
    kind = d.choice([*kinds, "list", "map"] if depth < 3 else kinds)
    if kind == "constant":
        return d.choice([None, True, False, math.nan, math.inf])
    if kind == "int":
        return d.integer(-(2**63), 2**64 - 1)
    if kind == "float":
        return d.any_float()
    if kind == "text":
        return d.any_text(12)
    if kind == "bytes":
        return d.any_bytes(12)
    if kind == "list":
        return [msgpack_value(d, depth + 1) for _ in range(d.integer(0, 4))]
    return {_key(d): msgpack_value(d, depth + 1) for _ in range(d.integer(0, 4))}


def _key(d: Draws) -> Any:
    kind = weighted(d, [(3, "field"), (1, "text"), (1, "int")])
    if kind == "field":
        return d.choice([*FIELDS, "type"])
    return d.any_text(8) if kind == "text" else d.integer(-5, 5)


def typed_map(d: Draws) -> bytes:
    """Random values in the shape of a message: a known tag and known field names."""
    fields = {d.choice(FIELDS): d.choice([msgpack_value, hostile])(d)
              for _ in range(d.integer(0, 6))}
    return pack({"type": d.choice(TAGS), **fields})


def _tag(d: Draws) -> Any:
    """A message's tag, known or not, or not a string at all."""
    kind = weighted(d, [(2, "known"), (1, "odd"), (1, "text"), (1, "hostile")])
    if kind == "known":
        return d.choice(TAGS)
    if kind == "odd":
        return d.choice(["", "HELLO", "hello\x00"])
    return d.any_text(12) if kind == "text" else hostile(d)


def mutated(d: Draws, message: msgspec.Struct) -> bytes:
    """``message``, changed by a few of: drop, retype, duplicate or add a field, re-tag,
    change one element of a list (or one field of a nested map); then perhaps cut or flip
    one byte of the packed frame."""
    body = builtins(message)
    for _ in range(d.choice([0, 1, 1, 2, 3])):
        keys = sorted(k for k in body if k != DUP) or ["type"]
        key = d.choice(keys)
        action = d.choice(["set", "set", "drop", "dup", "extra", "retag", "element", "element"])
        if action == "drop":
            body.pop(key, None)
        elif action == "set":
            body[key] = hostile(d)
        elif action == "dup":
            body.setdefault(DUP, []).append((key, hostile(d)))
        elif action == "extra":
            body[d.choice(FIELDS) if d.integer(0, 3) else d.any_text(10)] = hostile(d)
        elif action == "retag":
            body["type"] = _tag(d)
        elif isinstance(body.get(key), list) and body[key]:
            items = body[key] = list(body[key])
            index = d.integer(0, len(items) - 1)
            if isinstance(items[index], dict) and items[index]:
                inner = items[index] = dict(items[index])
                inner[d.choice(sorted(inner))] = hostile(d)
            else:
                items[index] = hostile(d)
        else:
            body[key] = hostile(d)
    packed = pack(body)
    tweak = d.integer(0, 11)  # about one frame in twelve cut, one flipped
    if tweak == 10 and packed:
        packed = packed[:d.integer(0, len(packed) - 1)]
    elif tweak == 11 and packed:
        at = d.integer(0, len(packed) - 1)
        packed = packed[:at] + bytes([packed[at] ^ d.integer(1, 255)]) + packed[at + 1:]
    return packed


def frame(d: Draws, side: Side) -> Frame:
    """One frame for ``side``: the ipc socket, the peer port, or a running job's session."""
    if side == "running":
        kind = weighted(d, [(5, "mutated"), (3, "valid"), (1, "bytes"), (1, "typed")])
        message = running_message
        size = 64
    else:
        kind = weighted(d, [(30, "mutated"), (5, "bytes"), (6, "value"), (6, "typed"),
                            (2, "valid"), (1, "multipart")])
        message = client_message if side == "ipc" else peer_message
        size = 256
    if kind == "mutated":
        return mutated(d, message(d))
    if kind == "bytes":
        return d.any_bytes(size)
    if kind == "value":
        return pack(msgpack_value(d))
    if kind == "typed":
        return typed_map(d)
    if kind == "valid":
        return pack(builtins(message(d)))
    return [d.any_bytes(32) for _ in range(d.integer(2, 3))]


@st.composite
def _drawn_frame(draw: st.DrawFn, side: Side) -> Frame:
    return frame(HypothesisDraws(draw), side)


def frames(side: Side) -> st.SearchStrategy[Frame]:
    """``frame`` as a hypothesis strategy: hypothesis makes every choice, and shrinks them."""
    return _drawn_frame(side)
