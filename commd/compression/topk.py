"""Top-k compression with error feedback, at node level (after the local ranks are summed).

Pure numpy: the selection, the residual update and the scatter of received pairs (the fused
kernels are in ``kernels.py``). The collectives that carry the values live in ``exchange.py``.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
from numpy.typing import DTypeLike

from commd.compression import native
from commd.compression.costs import topk_count
from commd.compression.kernels import (
    CHUNK,
    WORKERS,
    accumulate_pairs,
    check_float_buffer,
    run_parts,
)
from commd.compression.spec import CompressionSpec, parse_compression

__all__ = [
    "DEFAULT_TUNING",
    "RATIO_RANGE",
    "CompressionSpec",
    "TopkScratch",
    "TopkTuning",
    "accumulate_pairs",
    "parse_compression",
    "sample_positions",
    "select_topk",
    "select_topk_reference",
    "topk_count",
]

RATIO_RANGE = (0.001, 0.1)  # where `topk:auto` searches
SUPPORTED_DTYPES = ("float32", "float64")

@dataclass(frozen=True)
class TopkTuning:
    """How select_topk estimates its threshold; tests change these to force each path."""

    sample_size: int = 16_384  # elements sampled to estimate the threshold
    spread: float = 4.0  # standard deviations of sampling noise the threshold allows for
    dense_below: int = 65_536  # smaller arrays take the exact full path directly
    candidates_factor: float = 2.0  # more than factor·k + extra candidates: the sample missed
    candidates_extra: int = 65_536
    chunk: int = CHUNK  # elements per step of the candidate pass

    def candidate_limit(self, k: int, size: int) -> int:
        return min(size, int(self.candidates_factor * k) + self.candidates_extra)


DEFAULT_TUNING = TopkTuning()
# Magnitudes are compared as the float's bits with the sign cleared: for non-negative floats
# the unsigned integer order is the float order, and a NaN's bits exceed +inf's (mapped to
# +inf where it matters). Per float dtype: the integer type, the sign mask, +inf's bits.
_BITS: dict[np.dtype[Any], tuple[np.dtype[Any], Any, Any]] = {
    np.dtype(np.float32): (np.dtype(np.uint32), np.uint32(0x7FFF_FFFF), np.uint32(0x7F80_0000)),
    np.dtype(np.float64): (np.dtype(np.uint64), np.uint64(0x7FFF_FFFF_FFFF_FFFF),
                           np.uint64(0x7FF0_0000_0000_0000)),
}
_INT32_MAX = 2**31 - 1
SLACK = 16  # candidate buffer elements past the limit: the compiled pass's vector stores
_SAMPLE_SEED = 0x70C0  # fixed: the sample (and so the work done) is the same on every node


class TopkScratch:
    """Buffers select_topk reuses from call to call, for arrays of up to ``capacity`` elements
    of one dtype. One call at a time: keep one scratch per concurrently running group."""

    def __init__(self, capacity: int, dtype: DTypeLike = np.float32) -> None:
        self.dtype = np.dtype(dtype)
        if self.dtype not in (np.float32, np.float64):
            raise TypeError(f"TopkScratch dtype must be float32 or float64, got {self.dtype}")
        if capacity < 0:
            raise ValueError(f"TopkScratch capacity must be >= 0, got {capacity}")
        self.capacity = int(capacity)
        self.last_path = ""  # the path the last call took: all, dense, sample, fallback-*
        self._bits = _BITS[self.dtype][0]
        self._chunks: list[tuple[np.ndarray, np.ndarray] | None] = [None] * WORKERS
        self._index = np.empty(0, np.int32)
        self._magnitude = np.empty(0, self._bits)
        self._work = np.empty(0, self._bits)
        self._samples: dict[tuple[int, int], np.ndarray] = {}
        self._busy = threading.Lock()

    def chunk_buffers(self, part: int, chunk: int) -> tuple[np.ndarray, np.ndarray]:
        """Magnitude and mask buffers of one part of the candidate pass (made on first use)."""
        buffers = self._chunks[part]
        if buffers is None or buffers[0].size < chunk:
            buffers = (np.empty(chunk, self._bits), np.empty(chunk, bool))
            self._chunks[part] = buffers
        return buffers

    def candidates(self, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Index, magnitude and work buffers of ``count`` elements (grown, never shrunk)."""
        if self._index.size < count:
            size = min(self.capacity + SLACK, max(count, 2 * self._index.size))
            self._index = np.empty(size, np.int32)
            self._magnitude = np.empty(size, self._bits)
            self._work = np.empty(size, self._bits)
        return self._index[:count], self._magnitude[:count], self._work[:count]

    def sample(self, size: int, count: int) -> np.ndarray:
        key = (size, count)
        if key not in self._samples:
            if len(self._samples) >= 16:  # groups change rarely; keep the cache small
                self._samples.clear()
            self._samples[key] = sample_positions(size, count)
        return self._samples[key]


def sample_positions(size: int, count: int) -> np.ndarray:
    """``count`` ascending positions in [0, size): one at a seeded random offset in each of
    ``count`` equal strides (a stratified sample; regular data cannot alias a fixed stride)."""
    stride = size // count
    offsets = np.random.default_rng(_SAMPLE_SEED).integers(0, stride, count)
    return np.arange(count, dtype=np.int64) * stride + offsets


def _check_k(k: object) -> int:
    if isinstance(k, bool) or not isinstance(k, int | np.integer):
        raise TypeError(f"k must be an integer, got {type(k).__name__}")
    if k <= 0:
        raise ValueError(f"k must be positive, got {k}")
    return int(k)


def select_topk(error: np.ndarray, k: int, scratch: TopkScratch | None = None, *,
                tuning: TopkTuning = DEFAULT_TUNING) -> np.ndarray:
    """int32 indices of the k largest |error|, ascending; among equal magnitudes at the
    threshold the lower indices win, so every node selects identically. k >= size: all.

    NaN counts as an infinite magnitude (it ties with ±inf, lower index first): it is sent,
    so it reaches the result as in a dense all-reduce, and leaves the residual.

    A sample sets a threshold a little below the k-th magnitude; one chunked pass keeps the
    candidates above it and the exact selection runs on those only. If the sample missed
    (too few or too many candidates) the exact full path runs instead (full-size temporaries).
    The returned array is new (never a view into ``scratch``).
    """
    check_float_buffer("error", error)
    if error.size > _INT32_MAX + 1:
        raise ValueError(f"error has {error.size} elements; int32 indices reach 2**31")
    with _holding(scratch, error):
        return _select(error, _check_k(k), scratch, tuning)


@contextmanager
def _holding(scratch: TopkScratch | None, error: np.ndarray) -> Iterator[None]:
    if scratch is None:
        yield
        return
    if scratch.dtype != error.dtype:
        raise TypeError(f"scratch is {scratch.dtype}, error is {error.dtype}")
    if error.size > scratch.capacity:
        raise ValueError(f"error has {error.size} elements, scratch capacity "
                         f"{scratch.capacity}")
    if not scratch._busy.acquire(blocking=False):
        raise RuntimeError("TopkScratch is in use by another call; keep one per group")
    try:
        yield
    finally:
        scratch._busy.release()


def _select(error: np.ndarray, k: int, scratch: TopkScratch | None,
            tuning: TopkTuning) -> np.ndarray:
    size = error.size
    limit = tuning.candidate_limit(k, size)
    threshold = None
    if k < size and size >= tuning.dense_below:
        threshold = _sample_threshold(error, k, limit, scratch, tuning)
    if threshold is None:  # small, k a large share, or k >= size: no sample
        path = "all" if k >= size else "dense"
        chosen = np.arange(size, dtype=np.int32) if k >= size else _select_dense(error, k)
    elif (loops := native.active()) is not None and native.contiguous(error):
        path, chosen = _select_compiled(loops, error, k, threshold, limit, scratch)
    else:
        found = _scan(error, k, threshold, limit, scratch, tuning)
        if found is None or found[0].size < k:
            path = "fallback-many" if found is None else "fallback-few"
            chosen = _select_dense(error, k)
        else:
            path, (index, magnitude, work) = "sample", found
            chosen = index[_top_mask(magnitude, k, work)]
    if scratch is not None:
        scratch.last_path = path
    return chosen


def _select_compiled(loops: ModuleType, error: np.ndarray, k: int, threshold: np.generic,
                     limit: int, scratch: TopkScratch | None) -> tuple[str, np.ndarray]:
    """The candidate pass and the exact selection among the candidates in one compiled call
    (a radix select on the magnitude bits, no partition); the full path if the sample
    missed."""
    index, magnitude, work = candidate_buffers(error.dtype, limit, scratch)
    chosen = np.empty(k, np.int32)
    found = loops.select(error, error.dtype == np.float64, int(threshold), k, limit, index,
                         magnitude, work, chosen)
    if found < 0:
        return "fallback-many", _select_dense(error, k)
    if found < k:
        return "fallback-few", _select_dense(error, k)
    return "sample", chosen


def candidate_buffers(dtype: np.dtype[Any], limit: int, scratch: TopkScratch | None
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Index, magnitude-bit and work buffers for up to ``limit`` candidates of the compiled
    pass, SLACK more for its whole-vector stores: the scratch's, or new ones."""
    room = limit + SLACK
    if scratch is not None:
        return scratch.candidates(room)
    bits = _BITS[dtype][0]
    return np.empty(room, np.int32), np.empty(room, bits), np.empty(room, bits)


def sample_of(size: int, tuning: TopkTuning, scratch: TopkScratch | None) -> np.ndarray:
    """The sample's positions for an array of ``size``: the scratch's cached ones, or new."""
    count = min(tuning.sample_size, size)
    return scratch.sample(size, count) if scratch else sample_positions(size, count)


def _magnitude_bits(values: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """|values| as unsigned integers ordered like the magnitudes (NaN above +inf)."""
    bits, sign_off, _ = _BITS[values.dtype]
    ordered: np.ndarray = np.bitwise_and(values.view(bits), sign_off, out=out)
    return ordered


def _sample_threshold(error: np.ndarray, k: int, limit: int, scratch: TopkScratch | None,
                      tuning: TopkTuning) -> np.generic | None:
    """Magnitude bits that about k·(1 + a few σ) elements reach, from a sample; None when
    the candidates it predicts would not fit under ``limit``."""
    positions = sample_of(error.size, tuning, scratch)
    return threshold_of_sample(error[positions], error.size, k, limit, tuning)


def threshold_of_sample(sample: np.ndarray, size: int, k: int, limit: int,
                        tuning: TopkTuning = DEFAULT_TUNING) -> np.generic | None:
    """The threshold of ``_sample_threshold`` from the sampled values themselves (a new
    array: partitioned here)."""
    count = sample.size
    magnitude = _magnitude_bits(sample)
    np.minimum(magnitude, _BITS[sample.dtype][2], out=magnitude)  # NaN ranks as +inf
    expected = count * k / size  # sampled elements expected at or above the k-th magnitude
    rank = math.ceil(expected + tuning.spread * math.sqrt(expected) + 1)
    if rank >= count or rank * size / count > limit:
        return None
    magnitude.partition(count - rank)
    return magnitude[count - rank]  # type: ignore[no-any-return]


_Pieces = list[tuple[np.ndarray, np.ndarray]]


def _scan(error: np.ndarray, k: int, threshold: np.generic, limit: int,
          scratch: TopkScratch | None, tuning: TopkTuning
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The candidate pass: every index whose magnitude bits reach ``threshold`` (NaN
    included) except ties at the threshold beyond the first k (never chosen), ascending,
    with their magnitude bits (NaN as +inf), and a work buffer; None past ``limit``."""
    chunk, bits = tuning.chunk, _BITS[error.dtype][0]

    def work(part: int, lo: int, hi: int) -> _Pieces | None:
        if scratch is not None:
            magnitudes, masks = scratch.chunk_buffers(part, chunk)
        else:
            magnitudes, masks = np.empty(chunk, bits), np.empty(chunk, bool)
        found: _Pieces = []
        count, ties_left = 0, k
        for start in range(lo, hi, chunk):
            values = error[start:min(hi, start + chunk)]
            local, magnitude, ties_used = _pick(values, threshold, ties_left,
                                                magnitudes[:values.size], masks[:values.size])
            ties_left -= ties_used
            count += local.size
            if count > limit:
                return None
            if local.size:
                found.append((local + start, magnitude))
        return found

    parts = run_parts(error.size, work, chunk)
    pieces = [piece for found in parts if found is not None for piece in found]
    total = sum(index.size for index, _ in pieces)
    if any(found is None for found in parts) or total > limit:
        return None
    if scratch is not None:
        index, magnitude, spare = scratch.candidates(total)
    else:
        index, magnitude, spare = (np.empty(total, np.int32), np.empty(total, bits),
                                   np.empty(total, bits))
    if pieces:
        np.concatenate([i for i, _ in pieces], out=index, casting="same_kind")
        np.concatenate([m for _, m in pieces], out=magnitude)
    return index, magnitude, spare


def _pick(values: np.ndarray, threshold: np.generic, ties_left: int, magnitudes: np.ndarray,
          mask: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """One chunk's candidates: local indices, magnitude bits, ties at the threshold kept."""
    magnitude = _magnitude_bits(values, magnitudes)
    local = np.flatnonzero(np.greater_equal(magnitude, threshold, out=mask))
    if not local.size:
        return local, magnitude[:0], 0
    chosen = np.minimum(magnitude[local], _BITS[values.dtype][2])  # NaN ranks as +inf
    ties = np.flatnonzero(chosen == threshold)
    if ties.size > ties_left:  # ties beyond the first k can never be chosen
        keep = chosen != threshold
        keep[ties[:ties_left]] = True
        local, chosen = local[keep], chosen[keep]
    return local, chosen, min(ties.size, ties_left)


def _top_mask(magnitude: np.ndarray, k: int, work: np.ndarray) -> np.ndarray:
    """Boolean mask of the k largest of ``magnitude``, ties to the lower index; ``work``
    (same size) is overwritten."""
    size = magnitude.size
    np.copyto(work, magnitude)
    work.partition(size - k)
    kth = work[size - k]
    chosen: np.ndarray = magnitude > kth
    short = k - int(np.count_nonzero(chosen))
    if short:
        chosen[np.flatnonzero(magnitude == kth)[:short]] = True
    return chosen


def _select_dense(error: np.ndarray, k: int) -> np.ndarray:
    """The exact full path: one magnitude per element (full-size temporaries)."""
    magnitude = _magnitude_bits(error)
    np.minimum(magnitude, _BITS[error.dtype][2], out=magnitude)
    chosen = _top_mask(magnitude, k, np.empty_like(magnitude))
    return np.flatnonzero(chosen).astype(np.int32)


def select_topk_reference(error: np.ndarray, k: int) -> np.ndarray:
    """The previous select_topk (one argpartition over the whole array), for tests and the
    bench. Same answer as select_topk for finite input; NaN is not handled."""
    if k >= error.size:
        return np.arange(error.size, dtype=np.int32)
    magnitude = np.abs(error)
    # argpartition is O(n); a stable tie-break keeps every node's choice deterministic.
    chosen = np.argpartition(-magnitude, k - 1, kind="introselect")[:k]
    threshold = magnitude[chosen].min()
    above = np.flatnonzero(magnitude > threshold)
    ties = np.flatnonzero(magnitude == threshold)[: k - above.size]
    return np.sort(np.concatenate([above, ties])).astype(np.int32)
