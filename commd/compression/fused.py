"""E = S + R and the top-k of E in one pass over the buffers, for the nodes that select.

``add_and_energy`` writes E, and ``select_topk`` reads all of it again for its candidate pass:
on a buffer larger than the cache, that second read is a whole memory pass. Here the compiled
loops run the candidate pass on each block of E right after the addition wrote it, while it
is in cache. The threshold must be known before E exists, so it comes from E at the sample's
positions, computed first with the same float operations the addition runs (so the same
values, bit for bit). The answer is the same as the two calls'; where the compiled loops do
not run (or the kernels split their buffers over threads), it is the two calls.
"""

from __future__ import annotations

import time
from types import ModuleType

import numpy as np

from commd.compression import kernels, native
from commd.compression.kernels import add_and_energy, check_update
from commd.compression.topk import (
    _INT32_MAX,
    DEFAULT_TUNING,
    TopkScratch,
    TopkTuning,
    _check_k,
    _holding,
    _select,
    _select_dense,
    candidate_buffers,
    sample_of,
    threshold_of_sample,
)

__all__ = ["add_and_select"]


def add_and_select(residual: np.ndarray, update: np.ndarray, k: int,
                   scratch: TopkScratch | None = None, *, clear: bool = False,
                   velocity: np.ndarray | None = None, momentum: float = 0.0,
                   tuning: TopkTuning = DEFAULT_TUNING) -> tuple[float, np.ndarray, float]:
    """``add_and_energy(residual, update, clear, velocity, momentum)``, then
    ``select_topk(residual, k, scratch)``: returns (‖E‖², the indices, the seconds the
    selection itself took: the sample and the exact pick, or the whole ``select_topk``)."""
    check_update(residual, update)
    if velocity is not None:
        check_update(residual, velocity, "velocity")
        kernels.check_momentum(momentum)
    k = _check_k(k)
    if residual.size > _INT32_MAX + 1:
        raise ValueError(f"residual has {residual.size} elements; int32 indices reach 2**31")
    loops = native.active()
    size = residual.size
    fusable = (native.contiguous(residual, update, velocity)
               and tuning.dense_below <= size < kernels.PARALLEL_MIN and k < size)
    with _holding(scratch, residual):  # checks the scratch before anything is written
        if loops is not None and fusable:
            return _fused(loops, residual, update, k, scratch, clear, velocity, momentum,
                          tuning)
        energy = add_and_energy(residual, update, clear, velocity, momentum)
        began = time.perf_counter()
        chosen = _select(residual, k, scratch, tuning)
        return energy, chosen, time.perf_counter() - began


def _fused(loops: ModuleType, residual: np.ndarray, update: np.ndarray, k: int,
           scratch: TopkScratch | None, clear: bool, velocity: np.ndarray | None,
           momentum: float, tuning: TopkTuning) -> tuple[float, np.ndarray, float]:
    began = time.perf_counter()
    size, limit = residual.size, tuning.candidate_limit(k, residual.size)
    positions = sample_of(size, tuning, scratch)
    threshold = threshold_of_sample(_error_at(positions, residual, update, velocity, momentum),
                                    size, k, limit, tuning)
    sample_s = time.perf_counter() - began
    if threshold is None:  # a share too large for a sample to help: the two calls
        energy = add_and_energy(residual, update, clear, velocity, momentum)
        began = time.perf_counter()
        chosen = _select(residual, k, scratch, tuning)
        return energy, chosen, sample_s + time.perf_counter() - began
    wide = residual.dtype == np.float64
    index, bits, work = candidate_buffers(residual.dtype, limit, scratch)
    sums = np.empty(-(-size // loops.CHUNK))
    found = loops.add_energy(residual, update, velocity, momentum, clear, wide, sums,
                             int(threshold), k, limit, index, bits)
    energy = kernels.ordered_sum([sums.tolist()])
    began = time.perf_counter()
    if found >= k:
        path, chosen = "sample", np.empty(k, np.int32)
        loops.pick(index, bits, found, k, work, chosen, wide)
    else:  # the sample missed: the exact full path, on E as written
        path = "fallback-many" if found < 0 else "fallback-few"
        chosen = _select_dense(residual, k)
    if scratch is not None:
        scratch.last_path = path
    return energy, chosen, sample_s + time.perf_counter() - began


def _error_at(positions: np.ndarray, residual: np.ndarray, update: np.ndarray,
              velocity: np.ndarray | None, momentum: float) -> np.ndarray:
    """E at ``positions`` before the addition, rounded as the addition rounds: (velocity·m)
    + update, then residual + that, each in the buffers' dtype."""
    added = update[positions]
    if velocity is not None:
        sped = np.multiply(velocity[positions], velocity.dtype.type(momentum))
        added = np.add(sped, added, out=sped)
    total: np.ndarray = np.add(residual[positions], added, out=added)
    return total
