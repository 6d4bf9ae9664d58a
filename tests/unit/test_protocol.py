"""The wire protocol: typed messages, their MessagePack form, the codecs and the errors."""

from __future__ import annotations

from typing import Any

import msgpack
import msgspec
import msgspec.inspect as mi
import pytest

from commd_protocol import (
    MAX_MESSAGE_BYTES,
    ClientMessage,
    Codec,
    CommdError,
    CommdTimeout,
    DaemonMessage,
    Done,
    Error,
    ErrorCode,
    Goodbye,
    Hello,
    Layer,
    PeerAbort,
    PeerJoin,
    PeerLeave,
    PeerMessage,
    ProtocolViolation,
    Ready,
    Register,
    Registered,
    StatusReply,
    StatusRequest,
    TraceEvent,
    TraceReply,
    TraceRequest,
    Wait,
    Welcome,
    encode,
    error_from_reply,
)
from commd_protocol.agreement import describe_difference
from commd_protocol.checks import layers_problem
from commd_protocol.codec import client_codec, daemon_codec, peer_codec

LAYERS = [Layer(name="conv1.weight", size=864), Layer(name="fc.bias", size=10)]


def sample(kind: Any, name: str) -> Any:
    """A value of a field's type; never the field's default, so a round trip proves it travels."""
    if isinstance(kind, mi.IntType):
        return 7
    if isinstance(kind, mi.StrType):
        return f"{name}-value"
    if isinstance(kind, mi.FloatType):
        return 0.25
    if isinstance(kind, mi.BoolType):
        return True
    if isinstance(kind, mi.BytesType):
        return name.encode() + b"\x00\xff"
    if isinstance(kind, mi.ListType):
        return [sample(kind.item_type, name), sample(kind.item_type, name)]
    if isinstance(kind, mi.DictType):
        return {"a": sample(kind.value_type, name), "b": sample(kind.value_type, name)}
    if isinstance(kind, mi.TupleType):
        return tuple(sample(item, name) for item in kind.item_types)
    if isinstance(kind, mi.AnyType) or (isinstance(kind, mi.CustomType) and kind.cls is object):
        return {"nested": [1, "two", 3.5, None, True, {"deeper": []}]}
    if isinstance(kind, mi.StructType):
        return build(kind.cls)
    if isinstance(kind, mi.UnionType):  # an optional field: a value of its non-None type
        return sample(next(t for t in kind.types if not isinstance(t, mi.NoneType)), name)
    raise AssertionError(f"add a sample for {kind!r} (field {name})")


def as_lists(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return [as_lists(item) for item in value]
    if isinstance(value, dict):
        return {key: as_lists(item) for key, item in value.items()}
    return value


def build(cls: type[msgspec.Struct]) -> Any:
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    return cls(**{f.name: sample(f.type, f.name) for f in info.fields})


def members(union: Any) -> list[type[msgspec.Struct]]:
    return list(getattr(union, "__args__", (union,)))


CODECS: list[tuple[Codec[Any], Any]] = [
    (client_codec, ClientMessage),
    (daemon_codec, DaemonMessage),
    (peer_codec, PeerMessage),
]
ALL_CASES = [(codec, build(cls)) for codec, union in CODECS for cls in members(union)]
CLIENT_TYPES = ["goodbye", "hello", "ready", "register", "status", "trace", "wait"]


def tag(message: msgspec.Struct) -> str:
    return str(type(message).__struct_config__.tag)


def case_id(case: Any) -> str:
    return tag(case) if isinstance(case, msgspec.Struct) else ""


def violation(codec: Codec[Any], frame: bytes) -> ProtocolViolation:
    with pytest.raises(ProtocolViolation) as info:
        codec.decode(frame)
    return info.value


# --- round trips and the MessagePack form ------------------------------------------------------


@pytest.mark.parametrize(("codec", "message"), ALL_CASES, ids=case_id)
def test_round_trip(codec: Codec[Any], message: msgspec.Struct) -> None:
    decoded = codec.decode(encode(message))
    assert type(decoded) is type(message)
    assert decoded == message


@pytest.mark.parametrize(("codec", "message"), ALL_CASES, ids=case_id)
def test_encoded_form_is_a_plain_map_with_a_type_key(
    codec: Codec[Any], message: msgspec.Struct
) -> None:
    raw = msgpack.unpackb(encode(message), raw=False)
    assert isinstance(raw, dict)
    assert raw["type"] == tag(message)
    assert set(raw) == {"type", *message.__struct_fields__}
    # bytes: msgpack bin; tuples travel as arrays
    assert raw == as_lists(msgspec.to_builtins(message, builtin_types=(bytes,)))
    if isinstance(message, Register):
        assert raw["layers"] == [{"name": v.name, "size": v.size, "rows": v.rows}
                                 for v in message.layers]


def test_every_message_struct_is_covered() -> None:
    covered = {type(m) for _, m in ALL_CASES}
    expected = {Hello, Register, Ready, Wait, StatusRequest, Goodbye, Welcome, Registered, Done,
                Error, StatusReply, PeerJoin, PeerAbort, PeerLeave, TraceRequest, TraceReply}
    assert expected <= covered
    assert len(covered) == len(ALL_CASES)


def test_tags_are_unique_across_directions() -> None:
    tags = [tag(m) for _, m in ALL_CASES]
    assert len(tags) == len(set(tags))


@pytest.mark.parametrize(("codec", "message"), ALL_CASES, ids=case_id)
def test_other_directions_codecs_refuse_the_message(
    codec: Codec[Any], message: msgspec.Struct
) -> None:
    for other, _ in CODECS:
        if other is codec:
            continue
        error = violation(other, encode(message))
        assert error.code is ErrorCode.UNKNOWN_TYPE
        assert repr(tag(message)) in str(error)


# --- messages built by another MessagePack library ---------------------------------------------


def test_foreign_hello_decodes_with_defaults() -> None:
    frame = msgpack.packb(
        {
            "world_size": 2,
            "type": "hello",  # order does not matter
            "protocol": 1,
            "job": "j",
            "rank": 1,
            "local_rank": 0,
            "local_world_size": 1,
            "coordinator": "h:1",
        }
    )
    message = client_codec.decode(frame)
    assert message == Hello(
        protocol=1, job="j", rank=1, world_size=2, local_rank=0, local_world_size=1,
        coordinator="h:1", pid=0,
    )


def test_foreign_register_decodes_with_defaults_and_ignores_unknown_fields() -> None:
    frame = msgpack.packb(
        {
            "type": "register",
            "layers": [{"name": "w", "size": 3, "shape": [3]}, {"name": "b", "size": 1}],
            "dtype": "float32",
            "op": "sum",
            "shm_name": "commd-x",
            "from_the_future": {"nested": [1, 2.5, None]},
        }
    )
    message = client_codec.decode(frame)
    assert isinstance(message, Register)
    assert message.layers == [Layer(name="w", size=3), Layer(name="b", size=1)]
    assert message == Register(
        layers=[Layer(name="w", size=3), Layer(name="b", size=1)],
        dtype="float32", op="sum", shm_name="commd-x",
    )
    assert message.compression == "none"


def test_a_layer_carries_its_rows_and_an_old_clients_layer_has_none() -> None:
    """``Layer.rows`` travels in a register and a peer join; a layer without it (an older
    client, another language) decodes with rows 0: a vector, never compressed low-rank."""
    layers = [Layer(name="fc.weight", size=130, rows=10), Layer(name="fc.bias", size=10)]
    register = Register(layers=layers, dtype="float32", op="sum")
    frame = encode(register)
    assert msgpack.unpackb(frame)["layers"][0] == {"name": "fc.weight", "size": 130, "rows": 10}
    assert client_codec.decode(frame) == register
    join = PeerJoin(protocol=2, job="j", ranks=[0], world_size=1, layers=layers,
                    dtype="float32", op="sum", planner="wfbp", host="h")
    decoded = peer_codec.decode(encode(join))
    assert isinstance(decoded, PeerJoin) and [la.rows for la in decoded.layers] == [10, 0]
    old = client_codec.decode(msgpack.packb({
        "type": "register", "dtype": "float32", "op": "sum",
        "layers": [{"name": "fc.weight", "size": 130}, {"name": "fc.bias", "size": 10}]}))
    assert isinstance(old, Register) and [la.rows for la in old.layers] == [0, 0]


@pytest.mark.parametrize(("rows", "words"), [
    (3, ""), (12, ""), (1, ""), (0, ""),  # 3 x 4, a column, a row, a vector
    (-1, "has rows -1; must be between 0 (a vector) and the layer's size 12"),
    (13, "has rows 13; must be between 0 (a vector) and the layer's size 12"),
    (5, "has rows 5; must divide the layer's size 12"),
    (2**64 - 1, "has rows 18446744073709551615; must be between 0"),
    (True, "rows must be an int, not bool"),
    (2.0, "rows must be an int, not float"),
], ids=repr)
def test_layers_problem_checks_the_rows(rows: Any, words: str) -> None:
    problem = layers_problem([Layer(name="a", size=1), Layer(name="w", size=12, rows=rows)])
    if words:
        assert problem.startswith("layer 1 ('w') has rows") and words in problem, problem
    else:
        assert problem == ""


def test_ranks_whose_rows_differ_disagree_naming_the_layer_and_both_rows() -> None:
    def register(rows: int) -> Register:
        return Register(layers=[Layer(name="b", size=4), Layer(name="w", size=130, rows=rows)],
                        dtype="float32", op="sum")

    assert describe_difference(register(10), register(10)) == ""
    assert describe_difference(register(10), register(13)) == (
        "first differing layer is 1: 'w' (130 elements) has rows 10 (10 x 13) vs rows 13 "
        "(13 x 10); every rank must give it the same shape")
    assert "rows 0 (a vector) vs rows 10 (10 x 13)" in describe_difference(register(0),
                                                                           register(10))


@pytest.mark.parametrize(
    ("codec", "raw", "expected"),
    [
        (client_codec, {"type": "wait", "iteration": 3, "extra": "x"}, Wait(iteration=3)),
        (client_codec, {"type": "ready", "layers": [2, 1]}, Ready(layers=[2, 1])),
        (client_codec, {"type": "status"}, StatusRequest()),
        (client_codec, {"type": "goodbye", "reason": "done"}, Goodbye()),
        (daemon_codec, {"type": "error", "code": "invalid", "message": "commd: no"},
         Error(code="invalid", message="commd: no")),
        (daemon_codec, {"type": "done", "iteration": 0, "took_s": 0.1}, Done(iteration=0)),
        (daemon_codec, {"type": "done", "iteration": 4, "plan": 2, "dense": True},
         Done(iteration=4, plan=2, dense=True)),
        (daemon_codec, {"type": "status_reply", "status": {"jobs": []}},
         StatusReply(status={"jobs": []})),
        (client_codec, {"type": "trace", "job": "j"}, TraceRequest(job="j")),
        (daemon_codec, {"type": "trace_reply", "job": "j", "events": [
            {"row": "ready", "name": "w", "start_s": 1.5, "later": 1}], "node": "x"},
         TraceReply(job="j", events=[TraceEvent(row="ready", name="w", start_s=1.5)])),
        (peer_codec,
         {"type": "peer_join", "protocol": 1, "job": "j", "ranks": [0], "world_size": 1,
          "layers": [{"name": "a", "size": 1}], "dtype": "float16", "op": "avg",
          "planner": "wfbp", "host": "h"},
         PeerJoin(protocol=1, job="j", ranks=[0], world_size=1, layers=[Layer(name="a", size=1)],
                  dtype="float16", op="avg", planner="wfbp", host="h")),
        (peer_codec, {"type": "peer_leave", "job": "j", "why": 1}, PeerLeave(job="j")),
    ],
    ids=lambda v: v["type"] if isinstance(v, dict) else "",
)
def test_foreign_messages(codec: Codec[Any], raw: dict[str, Any], expected: Any) -> None:
    assert codec.decode(msgpack.packb(raw)) == expected


# --- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "frame",
    [b"", b"\xc1", b"\xc1\xc1garbage", b"\x81\xa4type", b"\x92\x01", b"\xd9\x05ab"],
    ids=["empty", "reserved-byte", "garbage", "truncated-map", "truncated-array", "short-str"],
)
def test_garbage_is_malformed(frame: bytes) -> None:
    error = violation(client_codec, frame)
    assert error.code is ErrorCode.MALFORMED
    assert "not a MessagePack message" in str(error)


@pytest.mark.parametrize(
    ("value", "kind"),
    [([1, 2], "list"), (7, "int"), ("hello", "str"), (None, "NoneType"), (b"\x01", "bytes")],
)
def test_a_non_map_is_malformed(value: Any, kind: str) -> None:
    for codec, _ in CODECS:
        error = violation(codec, msgpack.packb(value))
        assert error.code is ErrorCode.MALFORMED
        assert "map" in str(error) and "'type'" in str(error) and kind in str(error)


def test_a_map_without_type_is_refused() -> None:
    error = violation(client_codec, msgpack.packb({"job": "j", "rank": 0}))
    assert error.code in (ErrorCode.MALFORMED, ErrorCode.UNKNOWN_TYPE)
    assert "type" in str(error)


def test_a_map_without_type_is_malformed_naming_the_missing_field() -> None:
    error = violation(client_codec, msgpack.packb({"job": "j", "rank": 0}))
    assert error.code is ErrorCode.MALFORMED
    assert "missing" in str(error) and "'type'" in str(error)


@pytest.mark.parametrize("bad", ["launch", "Hello", "welcome", 5, True])
def test_unknown_type_lists_the_known_types(bad: Any) -> None:
    error = violation(client_codec, msgpack.packb({"type": bad, "job": "j"}))
    assert error.code is ErrorCode.UNKNOWN_TYPE
    assert repr(bad) in str(error)
    assert ", ".join(CLIENT_TYPES) in str(error)
    assert error.ref == str(bad)


@pytest.mark.parametrize("bad", [[1], {"a": 1}], ids=["list", "map"])
def test_unhashable_type_value_is_a_protocol_violation(bad: Any) -> None:
    error = violation(client_codec, msgpack.packb({"type": bad}))
    assert error.code in (ErrorCode.UNKNOWN_TYPE, ErrorCode.MALFORMED)


HELLO = {
    "type": "hello", "protocol": 1, "job": "j", "rank": 0, "world_size": 1, "local_rank": 0,
    "local_world_size": 1, "coordinator": "h:1",
}
REGISTER = {  # the required fields only (a host buffer's token is checked by the daemon)
    "type": "register", "layers": [{"name": "a", "size": 1}, {"name": "b", "size": 2}],
    "dtype": "float32", "op": "sum",
}


@pytest.mark.parametrize(
    ("codec", "raw", "where"),
    [
        (client_codec, {**HELLO, "rank": "zero"}, "$.rank"),
        (client_codec, {**HELLO, "rank": 1.0}, "$.rank"),
        (client_codec, {**HELLO, "pid": True}, "$.pid"),
        (client_codec, {**HELLO, "job": 7}, "$.job"),
        (client_codec, {**REGISTER, "layers": [{"name": "a", "size": 1},
                                               {"name": "b", "size": "big"}]},
         "$.layers[1].size"),
        (client_codec, {**REGISTER, "layers": {"a": 1}}, "$.layers"),
        (client_codec, {**REGISTER, "layers": [{"name": "a", "size": 4, "rows": "2"}]},
         "$.layers[0].rows"),
        (client_codec, {**REGISTER, "layers": [{"name": "a", "size": 4, "rows": 2.0}]},
         "$.layers[0].rows"),
        (client_codec, {**REGISTER, "layers": [{"name": "a", "size": 4, "rows": True}]},
         "$.layers[0].rows"),
        (peer_codec, {"type": "peer_join", "protocol": 1, "job": "j", "ranks": [0],
                      "world_size": 1, "layers": [{"name": "a", "size": 4, "rows": [2]}],
                      "dtype": "float32", "op": "sum", "planner": "wfbp", "host": "h"},
         "$.layers[0].rows"),
        (client_codec, {"type": "ready", "layers": "3"}, "$.layers"),
        (client_codec, {"type": "ready", "layers": [0, "1"]}, "$.layers[1]"),
        (client_codec, {"type": "wait", "iteration": None}, "$.iteration"),
        (daemon_codec, {"type": "registered", "nodes": 1, "node_index": 0,
                        "groups": [[0], ["a"]], "planner": "p"}, "$.groups[1][0]"),
        (daemon_codec, {"type": "error", "code": "x", "message": "m", "fatal": "yes"},
         "$.fatal"),
        (daemon_codec, {"type": "status_reply", "status": [1]}, "$.status"),
        (daemon_codec, {"type": "done", "iteration": 1, "dense": 1}, "$.dense"),
        (daemon_codec, {"type": "done", "iteration": 1, "dense": {"a": [True]}}, "$.dense"),
        (peer_codec, {"type": "peer_setup", "job": "j", "generation": 0, "node_index": 0,
                      "nodes": 1, "store_port": "x", "planner": "p"},
         "$.store_port"),
        (peer_codec, {"type": "peer_abort", "job": "j", "code": 1, "message": "m"}, "$.code"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_wrong_field_type_names_the_field(
    codec: Codec[Any], raw: dict[str, Any], where: str
) -> None:
    error = violation(codec, msgpack.packb(raw))
    assert error.code is ErrorCode.MALFORMED
    assert f"`{where}`" in str(error)
    assert repr(raw["type"]) in str(error)
    assert error.ref == raw["type"]


@pytest.mark.parametrize(
    ("codec", "raw", "field"),
    [
        *[(client_codec, {k: v for k, v in HELLO.items() if k != f}, f)
          for f in HELLO if f != "type"],
        *[(client_codec, {k: v for k, v in REGISTER.items() if k != f}, f)
          for f in REGISTER if f != "type"],
        (client_codec, {**REGISTER, "layers": [{"name": "a"}]}, "size"),
        (client_codec, {"type": "wait"}, "iteration"),
        (daemon_codec, {"type": "welcome", "protocol": 1, "version": "v"}, "backend"),
        (daemon_codec, {"type": "error", "message": "m"}, "code"),
        (peer_codec, {"type": "peer_leave"}, "job"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_missing_required_field_is_named(
    codec: Codec[Any], raw: dict[str, Any], field: str
) -> None:
    error = violation(codec, msgpack.packb(raw))
    assert error.code is ErrorCode.MALFORMED
    assert f"missing required field `{field}`" in str(error)
    assert error.ref == raw["type"]


def test_oversized_frame_is_too_large() -> None:
    codec: Codec[ClientMessage] = Codec(ClientMessage, max_bytes=64)
    small = encode(Wait(iteration=1))
    assert codec.decode(small) == Wait(iteration=1)
    big = encode(Register(layers=[Layer(name=f"l{i}", size=i) for i in range(20)],
                          dtype="float32", op="sum", shm_name="commd-x"))
    assert len(big) > 64
    error = violation(codec, big)
    assert error.code is ErrorCode.TOO_LARGE
    assert str(len(big)) in str(error) and "64" in str(error)
    # a frame of exactly the limit is allowed; garbage over it is refused for its size alone
    limit: Codec[ClientMessage] = Codec(ClientMessage, max_bytes=len(small))
    assert limit.decode(small) == Wait(iteration=1)
    assert violation(limit, b"\xc1" * (len(small) + 1)).code is ErrorCode.TOO_LARGE


def test_default_size_limit() -> None:
    for codec, _ in CODECS:
        assert codec.max_bytes == MAX_MESSAGE_BYTES
    # a 2000-layer register fits comfortably
    frame = encode(Register(layers=[Layer(name=f"block{i}.conv.weight", size=i) for i in
                                    range(2000)], dtype="float32", op="avg", shm_name="x"))
    assert len(frame) < MAX_MESSAGE_BYTES
    assert isinstance(client_codec.decode(frame), Register)


def test_decoding_a_violation_does_not_poison_the_codec() -> None:
    violation(client_codec, b"\xc1")
    violation(client_codec, msgpack.packb({"type": "nope"}))
    assert client_codec.decode(encode(Goodbye())) == Goodbye()


# --- errors ------------------------------------------------------------------------------------


def test_commd_error_message_and_code() -> None:
    error = CommdError("something broke; try again")
    assert str(error) == "commd: something broke; try again"
    assert error.message == str(error)
    assert error.code is ErrorCode.INVALID
    assert str(CommdError("commd: already prefixed")) == "commd: already prefixed"
    assert CommdError("x", "rank_lost").code is ErrorCode.RANK_LOST
    assert CommdError("x", ErrorCode.ENGINE).code is ErrorCode.ENGINE
    future = CommdError("x", "brand_new_code")
    assert future.code == "brand_new_code"
    assert isinstance(future, Exception)


def test_commd_timeout_is_a_commd_error_and_a_timeout_error() -> None:
    error = CommdTimeout("timed out after 1s")
    assert isinstance(error, CommdError)
    assert error.code is ErrorCode.TIMEOUT
    assert str(error) == "commd: timed out after 1s"
    assert isinstance(error, TimeoutError)
    with pytest.raises(TimeoutError):
        raise error
    with pytest.raises(CommdError):
        raise CommdTimeout("again")


@pytest.mark.parametrize("code", list(ErrorCode))
def test_error_from_reply_maps_every_code(code: ErrorCode) -> None:
    error = error_from_reply(str(code), "commd: the reason")
    assert isinstance(error, CommdError)
    assert error.code is code
    assert str(error) == "commd: the reason"
    assert isinstance(error, CommdTimeout) == (code is ErrorCode.TIMEOUT)
    assert isinstance(error, TimeoutError) == (code is ErrorCode.TIMEOUT)


def test_error_from_reply_keeps_an_unknown_code_and_adds_the_prefix() -> None:
    error = error_from_reply("from_a_newer_daemon", "something new")
    assert type(error) is CommdError
    assert error.code == "from_a_newer_daemon"
    assert str(error) == "commd: something new"


def test_a_violation_travels_as_an_error_reply() -> None:
    bad = violation(client_codec, msgpack.packb({**HELLO, "rank": "x"}))
    reply = Error(code=bad.code, message="commd: " + str(bad), ref=bad.ref)
    decoded = daemon_codec.decode(encode(reply))
    assert isinstance(decoded, Error)
    assert msgpack.unpackb(encode(reply))["code"] == "malformed"
    error = error_from_reply(decoded.code, decoded.message)
    assert error.code is ErrorCode.MALFORMED
    assert "$.rank" in str(error) and str(error).startswith("commd: ")
