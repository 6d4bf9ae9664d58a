"""The allgather's compact wire format (wire.py): bfloat16 values and 16-bit offsets, the
rounding's remainder kept in the residual; decoding checks every received buffer. Runs on
numpy's loops and the compiled ones (loop_variants)."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
from compression_reference import bfloat16, exchange, topk

from commd.compression import wire
from commd.compression.exchange import GroupExchange
from commd.compression.kernels import accumulate_pairs

from loop_variants import loops  # noqa: F401

pytestmark = pytest.mark.usefixtures("loops")

EDGES = np.array([np.inf, -np.inf, 3.4e38, -3.4e38, 1e-40, -0.0, 65504.0, 1.00390625,
                  1.01171875, 2.0**-133], np.float32)


def test_rounding_matches_torch_bfloat16_to_nearest_even() -> None:
    values = np.concatenate([EDGES, np.random.default_rng(0).standard_normal(100_000)
                             .astype(np.float32)])
    np.testing.assert_array_equal(wire.from_bfloat16(wire.to_bfloat16(values)),
                                  bfloat16(values))
    nan = wire.to_bfloat16(np.array([np.nan, -np.nan], np.float32))
    assert np.isnan(wire.from_bfloat16(nan)).all()


def packed_case(elements: int, k: int, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    error = rng.standard_normal(elements).astype(np.float32)
    error[:EDGES.size] = EDGES
    indices = np.sort(rng.choice(elements, k, replace=False)).astype(np.int32)
    indices[:EDGES.size] = np.arange(EDGES.size)  # the edge values are all sent
    return error, np.unique(indices)


@pytest.mark.parametrize("elements", [300_000, 65_536, 65_537, 20])
def test_pack_take_and_unpack_give_back_every_pair(elements: int) -> None:
    error, indices = packed_case(elements, min(elements, 12_000))
    k = indices.size
    original = error.copy()
    out = np.empty(wire.packed_bytes(elements, k), np.uint8)
    energy = wire.pack_take(error, indices, out)
    taken = original[indices].astype(np.float64)
    assert energy == pytest.approx(float(np.dot(taken, taken)), rel=1e-6, nan_ok=True)
    got_indices, got_values = np.empty(2 * k, np.int32), np.empty(2 * k, np.float32)
    wire.unpack(np.concatenate([out, out]), 2, elements, k, got_indices, got_values)
    np.testing.assert_array_equal(got_indices, np.tile(indices, 2))
    sent = bfloat16(original[indices])
    np.testing.assert_array_equal(got_values[k:], sent)
    # What was sent plus what stays is the value exactly; nothing stays where inf was sent.
    kept = error[indices]
    finite = np.isfinite(sent)
    np.testing.assert_array_equal((kept + sent)[finite], original[indices][finite])
    assert (kept[~finite] == 0).all()
    untouched = np.ones(elements, bool)
    untouched[indices] = False
    np.testing.assert_array_equal(error[untouched], original[untouched])


def test_pack_take_refuses_what_it_cannot_encode() -> None:
    error, indices = packed_case(1000, 50)
    out = np.empty(wire.packed_bytes(1000, indices.size), np.uint8)
    before = error.copy()
    with pytest.raises(ValueError, match="strictly ascending"):
        wire.pack_take(error, indices[::-1].copy(), out)
    with pytest.raises(ValueError, match="strictly ascending"):
        wire.pack_take(error, np.append(indices[:-1], 1000).astype(np.int32), out)
    with pytest.raises(ValueError, match="needs"):
        wire.pack_take(error, indices, out[:-1])
    with pytest.raises(TypeError, match="float32"):
        wire.pack_take(error.astype(np.float64), indices, out)
    np.testing.assert_array_equal(error, before)  # nothing taken


def gathered_pair(elements: int = 200_000, k: int = 5_000) -> tuple[np.ndarray, int]:
    error, indices = packed_case(elements, k)
    out = np.empty(wire.packed_bytes(elements, indices.size), np.uint8)
    wire.pack_take(error, indices, out)
    return np.concatenate([out, out]), indices.size


def test_unpack_refuses_buffers_no_node_could_send() -> None:
    """A corrupt or hostile peer's buffer: typed errors naming the node, never an index
    outside the group."""
    elements = 200_000
    gathered, k = gathered_pair(elements)
    per = gathered.size // 2
    pairs = np.empty(2 * k, np.int32), np.empty(2 * k, np.float32)
    bad_sum = gathered.copy()
    bad_sum[per:per + 4] = np.frombuffer(np.int32(1_000).tobytes(), np.uint8)
    with pytest.raises(wire.WireFormatError, match="node 1's block counts"):
        wire.unpack(bad_sum, 2, elements, k, *pairs)
    negative = gathered.copy()
    counts = negative[:4 * wire.blocks(elements)].view(np.int32)
    counts[1] += int(counts[0]) + 1  # the same sum, with a negative count
    counts[0] = -1
    with pytest.raises(wire.WireFormatError, match="node 0's block counts"):
        wire.unpack(negative, 2, elements, k, *pairs)
    # Every pair moved into the last block, whose offsets run past the group's end.
    beyond = gathered.copy()
    last = beyond[per:per + 4 * wire.blocks(elements)].view(np.int32)
    last[:] = 0
    last[-1] = k
    lows = beyond[per + last.nbytes:per + last.nbytes + 2 * k].view(np.uint16)
    lows[:] = np.arange(k, dtype=np.uint16) + np.uint16(65_535 - k)
    with pytest.raises(wire.WireFormatError, match="node 1 sent index"):
        wire.unpack(beyond, 2, elements, k, *pairs)
    with pytest.raises(wire.WireFormatError, match="expected"):
        wire.unpack(gathered[:-2], 2, elements, k, *pairs)
    with pytest.raises(wire.WireFormatError, match="expected"):
        wire.unpack(gathered.view(np.int16), 2, elements, k, *pairs)
    with pytest.raises(ValueError, match="needs"):
        wire.unpack(gathered, 2, elements, k, pairs[0][:-1], pairs[1])


@pytest.mark.parametrize("elements", [300_000, 65_536, 65_537, 20])
@pytest.mark.parametrize("zeroed", [True, False])
def test_unpack_add_is_unpack_then_accumulate_bit_for_bit(elements: int, zeroed: bool) -> None:
    """Three nodes' buffers with overlapping indices, decoded as they are added."""
    k = min(elements, 9_000)
    per = wire.packed_bytes(elements, k)
    gathered = np.empty(3 * per, np.uint8)
    for node in range(3):
        error, indices = packed_case(elements, k, seed=node)
        indices = np.sort(np.random.default_rng(node).choice(elements, k, replace=False))
        wire.pack_take(error, indices.astype(np.int32), gathered[node * per:(node + 1) * per])
    pairs = np.empty(3 * k, np.int32), np.empty(3 * k, np.float32)
    wire.unpack(gathered, 3, elements, k, *pairs)
    start = np.zeros(elements, np.float32) if zeroed else np.full(elements, 7.0, np.float32)
    want, got = start.copy(), start.copy()
    accumulate_pairs(want, *pairs, zeroed=zeroed)
    wire.unpack_add(got, gathered, 3, k, zeroed=zeroed)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_unpack_add_writes_nothing_for_a_malformed_buffer() -> None:
    elements = 200_000
    gathered, k = gathered_pair(elements)
    per = gathered.size // 2
    target = np.full(elements, 3.0, np.float32)
    bad_sum = gathered.copy()
    bad_sum[per:per + 4] = np.frombuffer(np.int32(1_000).tobytes(), np.uint8)
    with pytest.raises(wire.WireFormatError, match="node 1's block counts"):
        wire.unpack_add(target, bad_sum, 2, k)
    beyond = gathered.copy()
    counts = beyond[:4 * wire.blocks(elements)].view(np.int32)
    counts[:] = 0
    counts[-1] = k
    lows = beyond[counts.nbytes:counts.nbytes + 2 * k].view(np.uint16)
    lows[:] = np.arange(k, dtype=np.uint16) + np.uint16(65_535 - k)
    with pytest.raises(wire.WireFormatError, match="node 0 sent index"):
        wire.unpack_add(target, beyond, 2, k)
    with pytest.raises(wire.WireFormatError, match="expected"):
        wire.unpack_add(target, gathered[:-4], 2, k)
    with pytest.raises(TypeError, match="float32"):
        wire.unpack_add(target.astype(np.float64), gathered, 2, k)
    assert (target == 3.0).all()


class Meeting:
    """Two nodes' allgathers met in memory: each node's i-th call waits for the other's."""

    def __init__(self) -> None:
        self.queues: list[list[tuple[np.ndarray, np.ndarray, asyncio.Future[None]]]] = [[], []]
        self.dtypes: list[str] = []

    def engine(self, node: int) -> Any:
        meeting = self

        class NodeEngine:
            def allgather(self, out: np.ndarray, data: np.ndarray,
                          dtype: str) -> asyncio.Future[None]:
                meeting.dtypes.append(dtype)
                future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                meeting.queues[node].append((out, data, future))
                while all(meeting.queues):  # the same collective of both nodes: node order
                    calls = [queue.pop(0) for queue in meeting.queues]
                    gathered = np.concatenate([data for _, data, _ in calls])
                    for target, _, done in calls:
                        target[:] = gathered
                        done.set_result(None)
                return future

        return NodeEngine()


class Clock:
    def span(self, launched: float) -> float:
        return 0.001


@pytest.mark.parametrize("dtype", ["float32", "float64"])
async def test_two_nodes_sum_the_rounded_pairs_and_keep_the_remainders(dtype: str) -> None:
    """Two nodes' allgather, three iterations, against the reference model: bit for bit,
    results and residuals. float32 through the compact wire (torch's rounding in the
    model), float64 as values and int32 indices."""
    elements, k = 150_000, 4_000
    rng = np.random.default_rng(5)
    meeting = Meeting()
    with ThreadPoolExecutor(2) as pool:
        nodes = [GroupExchange(meeting.engine(node), pool, node, 2, dtype, Clock())
                 for node in (0, 1)]
        residuals = [np.zeros(elements, dtype) for _ in nodes]
        model = [r.copy() for r in residuals]
        for iteration in range(3):
            sums = [rng.standard_normal(elements).astype(dtype) * 1e-3 for _ in nodes]
            want = exchange([s.copy() for s in sums], model, k, "allgather", iteration)
            loop = asyncio.get_running_loop()
            turns = [loop.create_future() for _ in nodes]
            for turn in turns:
                turn.set_result(None)
            await asyncio.gather(*(
                node.allgather(total, residual, None, k, turn, loop.create_future())
                for node, total, residual, turn in zip(nodes, sums, residuals, turns,
                                                       strict=True)))
            for node in range(2):
                np.testing.assert_array_equal(sums[node], want)
                np.testing.assert_array_equal(residuals[node], model[node])
    compact = dtype == "float32"  # one collective per node and group, or two
    assert set(meeting.dtypes) == ({"uint8"} if compact else {"float64", "int32"})
    assert topk(want, 1).size == 1
