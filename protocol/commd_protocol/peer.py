"""Daemon-to-daemon control-plane messages (the data plane is the collective engine)."""

from __future__ import annotations

from .messages import Layer, _Msg


class PeerJoin(_Msg, tag="peer_join"):
    """A node's daemon has every local rank of ``job`` registered and asks to join."""

    protocol: int
    job: str
    ranks: list[int]  # the process ranks on this node
    world_size: int
    layers: list[Layer]
    dtype: str
    op: str
    planner: str
    host: str  # the address this node's engine listens on
    compression: str = "none"


class PeerSetup(_Msg, tag="peer_setup"):
    """The coordinator's answer once the whole world joined: the node's place and the plan."""

    job: str
    generation: int  # distinguishes engine set-ups of a job id that was reused
    node_index: int
    nodes: int
    store_port: int  # TCPStore on the coordinator's host
    groups: list[list[int]]
    planner: str


class PeerAbort(_Msg, tag="peer_abort"):
    """The job cannot go on (mismatch, a lost rank or node); every daemon fails its ranks."""

    job: str
    code: str
    message: str


class PeerLeave(_Msg, tag="peer_leave"):
    """A node's ranks all said goodbye: the coordinator forgets the node's part of the job."""

    job: str


PeerMessage = PeerJoin | PeerSetup | PeerAbort | PeerLeave
