"""The allgather's compact wire format for float32 groups: 4 bytes per selected element.

Each node sends one byte buffer (every node the same size, as an allgather needs):

* ``counts``: int32 per block of ``BLOCK`` elements, how many of its indices fall in it;
* ``lows``: uint16 per index, its offset inside its block (indices ascend, so the counts and
  the offsets give them back: index = block·BLOCK + offset);
* ``values``: uint16 per index, the value rounded to bfloat16 (to nearest, ties to even).

Against int32 indices and float32 values (8 bytes per element) this halves the wire, so a
ratio twice as large costs the same bytes. The rounding loses nothing over time: the caller
keeps ``value − sent`` in the residual (error feedback), so every bit reaches the sum later,
as what top-k holds back does. bfloat16 keeps float32's range (no overflow, no subnormal
cliff as float16 would have for small gradients).

Received buffers are checked before anything is built from them: the counts must be
non-negative and add up to k, and every index must lie inside the group.
"""

from __future__ import annotations

import numpy as np

from commd.compression import native
from commd.compression.kernels import _check_all_ascending, accumulate_pairs

BLOCK_BITS = 16
BLOCK = 1 << BLOCK_BITS
WIRE_BYTES_PER_ELEMENT = 4  # uint16 offset + bfloat16 value
_NAN_BITS = np.uint16(0x7FC0)


class WireFormatError(ValueError):
    """A received compact buffer that no node could have sent (corrupt or hostile)."""


def blocks(elements: int) -> int:
    return max(1, -(-elements // BLOCK))


def packed_bytes(elements: int, k: int) -> int:
    """Bytes of one node's buffer for a group of ``elements`` with ``k`` selected."""
    return 4 * blocks(elements) + WIRE_BYTES_PER_ELEMENT * k


def to_bfloat16(values: np.ndarray) -> np.ndarray:
    """float32 → bfloat16 bits (uint16), rounded to nearest with ties to even; NaN stays NaN
    (rounding a NaN's low bits could otherwise carry it into infinity)."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
    high = (rounded >> np.uint32(16)).astype(np.uint16)
    high[np.isnan(values)] = _NAN_BITS
    return high


def from_bfloat16(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bits → float32, exactly."""
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def _views(buffer: np.ndarray, elements: int, k: int
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    count = blocks(elements)
    head = 4 * count
    counts = buffer[:head].view(np.int32)
    lows = buffer[head:head + 2 * k].view(np.uint16)
    values = buffer[head + 2 * k:head + 4 * k].view(np.uint16)
    return counts, lows, values


def pack_take(error: np.ndarray, indices: np.ndarray, out: np.ndarray) -> float:
    """Take the selected values out of ``error`` (float32, the node's E) into ``out`` (one
    node's buffer: uint8, ``packed_bytes`` long), from its strictly ascending int32
    ``indices``. ``error`` keeps what the rounding left at those positions (0 where the sent
    value is not finite: inf, NaN), as ``take_and_clear`` leaves 0. Returns the taken
    values' sum of squares (the energy sent, for the gain)."""
    k = indices.size
    elements = error.size
    if error.dtype != np.float32 or indices.dtype != np.int32:
        raise TypeError(f"pack_take: float32 error and int32 indices, not {error.dtype} and "
                        f"{indices.dtype}")
    if out.dtype != np.uint8 or out.size != packed_bytes(elements, k):
        raise ValueError(f"pack_take: out is {out.size} {out.dtype}, needs "
                         f"{packed_bytes(elements, k)} uint8 for {k} of {elements} elements")
    loops = native.active()
    if loops is not None and native.contiguous(error, indices, out):
        packed: float = loops.pack_take(error, indices, out)
        return packed
    _check_all_ascending(indices, elements)  # take_and_clear's check, chunk by chunk
    counts, lows, bits = _views(out, elements, k)
    values = error[indices]
    counts[:] = np.bincount(indices >> BLOCK_BITS, minlength=counts.size)
    np.copyto(lows, indices, casting="unsafe")  # the low 16 bits
    bits[:] = to_bfloat16(values)
    sent = from_bfloat16(bits)
    with np.errstate(invalid="ignore"):
        error[indices] = np.where(np.isfinite(sent), values - sent, np.float32(0))
    return float(np.dot(values.astype(np.float64), values.astype(np.float64)))


def unpack(gathered: np.ndarray, nodes: int, elements: int, k: int,
           indices_out: np.ndarray, values_out: np.ndarray) -> None:
    """Every node's (index, value) pairs from the allgather's ``gathered`` buffer, node after
    node, into int32 ``indices_out`` and float32 ``values_out`` (``nodes·k`` each).
    WireFormatError names the node and what is wrong with its buffer."""
    per = _check_gathered(gathered, nodes, elements, k)
    if indices_out.size != nodes * k or values_out.size != nodes * k:
        raise ValueError(f"unpack: {indices_out.size} indices and {values_out.size} values "
                         f"out, needs {nodes * k} each")
    loops = native.active()
    if loops is not None and native.contiguous(gathered, indices_out, values_out) \
            and indices_out.dtype == np.int32 and values_out.dtype == np.float32:
        code, node, value = loops.unpack(gathered, nodes, elements, k, indices_out,
                                         values_out)
        _raise_for(code, node, value, elements, k)
        return
    starts = np.arange(blocks(elements), dtype=np.int64) << BLOCK_BITS
    for node in range(nodes):
        counts, lows, bits = _views(gathered[node * per:(node + 1) * per], elements, k)
        total = int(counts.sum(dtype=np.int64))
        if counts.min() < 0 or total != k:
            _raise_for(1, node, total, elements, k)
        mine = np.repeat(starts, counts) | lows
        if k and int(mine.max()) >= elements:
            _raise_for(2, node, int(mine.max()), elements, k)
        indices_out[node * k:(node + 1) * k] = mine
        values_out[node * k:(node + 1) * k] = from_bfloat16(bits)


def unpack_add(target: np.ndarray, gathered: np.ndarray, nodes: int, k: int,
               zeroed: bool = False) -> None:
    """target = 0 (unless ``zeroed``: it is already), then every node's pairs from the
    allgather's ``gathered`` buffer added in, node after node: what ``unpack`` and
    ``accumulate_pairs`` give, bit for bit, without writing the decoded pairs out (the
    compiled loops decode as they add). Nothing is written if a buffer is malformed."""
    elements = target.size
    if target.dtype != np.float32:
        raise TypeError(f"unpack_add: a float32 target, not {target.dtype}")
    _check_gathered(gathered, nodes, elements, k)
    loops = native.active()
    if loops is not None and native.contiguous(target, gathered):
        code, node, value = loops.unpack_add(target, gathered, nodes, k, zeroed)
        _raise_for(code, node, value, elements, k)
        return
    pairs = np.empty(nodes * k, np.int32), np.empty(nodes * k, np.float32)
    unpack(gathered, nodes, elements, k, *pairs)
    accumulate_pairs(target, *pairs, zeroed=zeroed)


def _check_gathered(gathered: np.ndarray, nodes: int, elements: int, k: int) -> int:
    """The allgather's buffer: uint8, every node's ``packed_bytes``; returns those bytes."""
    per = packed_bytes(elements, k)
    if gathered.dtype != np.uint8 or gathered.size != nodes * per:
        raise WireFormatError(f"the gathered buffer holds {gathered.size} {gathered.dtype}, "
                              f"expected {nodes * per} bytes ({nodes} nodes × {per})")
    return per


def _raise_for(code: int, node: int, value: int, elements: int, k: int) -> None:
    if code == 1:
        raise WireFormatError(f"node {node}'s block counts are negative or do not add up to "
                              f"k = {k} (sum {value})")
    if code == 2:
        raise WireFormatError(f"node {node} sent index {value}, beyond the group's "
                              f"{elements} elements")
