"""Typed wire messages: msgspec Structs, encoded as plain MessagePack maps.

Every message is a map with a ``type`` tag, so a client in another language can speak the
protocol with any MessagePack library. New fields always get defaults, so that an old client
keeps working against a newer daemon.
"""

from __future__ import annotations

import msgspec

PROTOCOL_VERSION = 1

# Dtypes the daemon reduces; bfloat16 travels as raw 16-bit words (numpy has no bfloat16).
DTYPES = ("float32", "float64", "float16", "bfloat16")
OPS = ("sum", "avg")


class _Msg(msgspec.Struct, tag_field="type", forbid_unknown_fields=False, kw_only=True):
    """Base of every message; the tag is the class's ``type`` name."""


# --- client -> daemon -----------------------------------------------------------------------


class Hello(_Msg, tag="hello"):
    protocol: int
    job: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    coordinator: str  # "host:port" of the peer endpoint of the daemon on rank 0's node
    pid: int = 0  # lets the daemon notice a client that dies (pidfd)


class Layer(msgspec.Struct, array_like=False, kw_only=True):
    name: str
    size: int  # number of elements


class Register(_Msg, tag="register"):
    layers: list[Layer]  # forward order
    dtype: str
    op: str
    shm_name: str  # POSIX shared-memory segment holding the flat buffer (backward order)
    planner: str = ""  # "" = the daemon's default (optimal unless configured)
    compression: str = "none"


class Ready(_Msg, tag="ready"):
    layers: list[int]  # forward-order indices whose gradients are final for this iteration


class Wait(_Msg, tag="wait"):
    iteration: int


class StatusRequest(_Msg, tag="status"):
    pass


class Goodbye(_Msg, tag="goodbye"):
    pass


# --- daemon -> client -----------------------------------------------------------------------


class Welcome(_Msg, tag="welcome"):
    protocol: int
    version: str
    backend: str


class Registered(_Msg, tag="registered"):
    nodes: int
    node_index: int
    groups: list[list[int]]  # forward-order layer indices, in communication order
    planner: str


class Done(_Msg, tag="done"):
    iteration: int
    plan: int = 0  # version of the merge plan this iteration ran with


class Error(_Msg, tag="error"):
    code: str
    message: str
    ref: str = ""  # the type of the message this answers, when known
    fatal: bool = False  # True: the job failed and every later call fails the same way


class StatusReply(_Msg, tag="status_reply"):
    status: dict[str, object]


ClientMessage = Hello | Register | Ready | Wait | StatusRequest | Goodbye
DaemonMessage = Welcome | Registered | Done | Error | StatusReply
