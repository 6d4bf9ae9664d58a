"""The hostile-frame generator both fuzzers draw from (commd.testing.fuzz): a seed gives the
same frames, its valid messages are valid (a mutation of one starts from a message the daemon
would take), and hypothesis draws the same kinds of frame through it."""

from __future__ import annotations

import random
from collections.abc import Callable

import msgspec
import pytest
from hypothesis import given, settings

from commd.testing import fuzz
from commd.testing.fuzz import builtins, pack
from commd_protocol import ProtocolViolation
from commd_protocol.codec import client_codec, daemon_codec, peer_codec

SIDES: list[fuzz.Side] = ["ipc", "peer", "running"]
# Distinct frames of 300 at least: a running job's valid messages are few (ready and wait of a
# 3-layer job, iterations -2..3), so most of that side's variety is the mutations' (235-252 of
# 300 over seeds 1-3 and 7); the other sides draw from every message type (280-296).
VARIETY = {"ipc": 250, "peer": 250, "running": 200}


@pytest.mark.parametrize("side", SIDES)
def test_a_seed_gives_the_same_frames(side: fuzz.Side) -> None:
    first, second = (fuzz.RandomDraws(random.Random(7)) for _ in range(2))
    frames = [fuzz.frame(first, side) for _ in range(300)]
    assert frames == [fuzz.frame(second, side) for _ in range(300)]
    distinct = {bytes(f) if isinstance(f, bytes) else b"|".join(f) for f in frames}
    assert len(distinct) > VARIETY[side]


def decodes_to_itself(message: msgspec.Struct) -> bool:
    """Some codec decodes the packed message to an equal one (a daemon's message sent the
    wrong way is valid for the daemon codec)."""
    for codec in (client_codec, peer_codec, daemon_codec):
        try:
            if codec.decode(pack(builtins(message))) == message:
                return True
        except ProtocolViolation:
            continue
    return False


@pytest.mark.parametrize("make", [fuzz.client_message, fuzz.peer_message,
                                  fuzz.running_message])
def test_the_valid_messages_are_valid(make: Callable[[fuzz.Draws], msgspec.Struct]) -> None:
    draws = fuzz.RandomDraws(random.Random(3))
    messages = [make(draws) for _ in range(400)]
    invalid = [m for m in messages if not decodes_to_itself(m)]
    assert invalid == []
    assert len({type(m) for m in messages}) >= 5  # every builder of the side is reached


@settings(max_examples=60, deadline=None, database=None)
@given(ipc=fuzz.frames("ipc"), peer=fuzz.frames("peer"), running=fuzz.frames("running"))
def test_hypothesis_draws_frames_through_the_same_generator(
        ipc: fuzz.Frame, peer: fuzz.Frame, running: fuzz.Frame) -> None:
    for frame in (ipc, peer, running):
        assert isinstance(frame, bytes) or (
            isinstance(frame, list) and all(isinstance(part, bytes) for part in frame))
    assert isinstance(running, bytes)  # a running job's session gets single frames
