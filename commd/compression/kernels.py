"""Fused, chunked numpy kernels for the compressed path of one group
(see docs/design/compression.md).

Each kernel walks its buffer once in chunks of ``CHUNK`` elements, so the temporaries of one
chunk stay in the CPU cache and nothing the size of the buffer is allocated. Buffers of at
least ``PARALLEL_MIN`` elements are split, on chunk boundaries, over a thread pool owned by
this module (numpy releases the GIL in its loops). Results never depend on the split: every
partial sum is per chunk and the chunk sums are added in chunk order.

Where the compiled loops are built (``native.py``), each function below hands its whole
step to one of them, after the same checks; numpy's chunked code runs otherwise.

The pool is never the caller's: the daemon already runs these functions inside its own
executor, and a task that waited on that executor from inside it could deadlock. Pool tasks
never wait on anything, and the calling thread always works one part itself.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from types import ModuleType
from typing import TypeVar

import numpy as np

from commd.compression import native

__all__ = [
    "CHUNK",
    "PARALLEL_MIN",
    "WORKERS",
    "accumulate_pairs",
    "add_and_energy",
    "check_float_buffer",
    "check_update",
    "ordered_sum",
    "put",
    "run_parts",
    "take_and_clear",
    "top_energies",
]

CHUNK = 131_072  # elements: 512 KiB of float32, a chunk's temporaries stay in L2
INDEX_CHUNK = 32_768  # indices per step of the gather/put kernels
WORKERS = min(4, os.cpu_count() or 1)
# Elements from which a kernel splits its buffer over the pool. Off below 4 CPUs: on 2 cores
# the daemon's own 2-worker executor already fills them, and a split gains nothing the
# whole path can see (docs/design/compression.md, "Fast top-k, measured"). From 4 CPUs a split
# of >= 4 M elements is expected to help. Tests lower it.
PARALLEL_MIN = 4_000_000 if (os.cpu_count() or 1) >= 4 else sys.maxsize
MAX_RUNS = 1024  # ascending runs in accumulate_pairs' input before it falls back to np.add.at

_T = TypeVar("_T")
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="commd-kernels")
        return _pool


def split(n: int, parts: int, chunk: int = CHUNK) -> list[tuple[int, int]]:
    """[0, n) as up to ``parts`` contiguous ranges whose inner edges are chunk multiples."""
    chunks = max(1, -(-n // chunk))
    parts = max(1, min(parts, chunks))
    edges = [min(n, chunks * p // parts * chunk) for p in range(parts + 1)]
    return [(edges[p], edges[p + 1]) for p in range(parts)]


def run_parts(n: int, work: Callable[[int, int, int], _T], chunk: int = CHUNK) -> list[_T]:
    """``work(part, lo, hi)`` over a split of [0, n); the results in part order."""
    parts = WORKERS if n >= PARALLEL_MIN else 1
    ranges = split(n, parts, chunk)
    if len(ranges) == 1:
        return [work(0, 0, n)]
    pool = _executor()
    futures: list[Future[_T]] = [pool.submit(work, part, lo, hi)
                                 for part, (lo, hi) in enumerate(ranges) if part]
    try:
        first = work(0, *ranges[0])
    finally:  # never return (or raise) while a part still writes into the caller's buffers
        wait(futures)
    return [first, *(future.result() for future in futures)]


def check_float_buffer(name: str, array: object) -> np.ndarray:
    """A 1-D float32/float64 ndarray, or TypeError/ValueError naming ``name``."""
    if not isinstance(array, np.ndarray):
        raise TypeError(f"{name} must be a numpy array, got {type(array).__name__}")
    if array.dtype not in (np.float32, np.float64):
        raise TypeError(f"{name} must be float32 or float64, got {array.dtype}")
    if array.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got {array.ndim} dimensions")
    return array


def _check_indices(name: str, indices: object) -> np.ndarray:
    if not isinstance(indices, np.ndarray):
        raise TypeError(f"{name} must be a numpy array, got {type(indices).__name__}")
    if indices.dtype.kind not in "iu" or indices.dtype == np.uint64:  # uint64: no intp cast
        raise TypeError(f"{name} must hold integers (not uint64), got {indices.dtype}")
    if indices.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got {indices.ndim} dimensions")
    return indices


def _check_pairs(target: np.ndarray, indices: np.ndarray, values: np.ndarray) -> None:
    check_float_buffer("target", target)
    _check_indices("indices", indices)
    check_float_buffer("values", values)
    if values.dtype != target.dtype:
        raise TypeError(f"values are {values.dtype}, target is {target.dtype}")
    if values.size != indices.size:
        raise ValueError(f"{values.size} values for {indices.size} indices")


def _check_ascending(piece: np.ndarray, lo: int, hi: int) -> None:
    """Strictly ascending and inside [lo, hi): anything else could write out of place."""
    if piece.size and (piece[0] < lo or piece[-1] >= hi or
                       (piece.size > 1 and not np.all(piece[1:] > piece[:-1]))):
        raise ValueError(f"indices must be strictly ascending and in [0, size); the ones "
                         f"for elements [{lo}, {hi}) are not")


def _check_all_ascending(indices: np.ndarray, size: int) -> None:
    """All of ``indices`` strictly ascending in [0, size), checked step by step (a step's last
    index is the next one's first)."""
    for start in range(0, indices.size, INDEX_CHUNK):
        _check_ascending(indices[start:start + INDEX_CHUNK + 1], 0, size)


def check_update(residual: object, update: object, name: str = "update",
                 reference: str = "residual") -> None:
    """Two 1-D float buffers of one dtype and size, or TypeError/ValueError naming them
    (``reference``: the first one's name)."""
    residual = check_float_buffer(reference, residual)
    update = check_float_buffer(name, update)
    if update.dtype != residual.dtype:
        raise TypeError(f"{name} is {update.dtype}, {reference} is {residual.dtype}")
    if update.shape != residual.shape:
        raise ValueError(f"{name} has {update.size} elements, {reference} {residual.size}")


def add_and_energy(residual: np.ndarray, update: np.ndarray, clear: bool = False,
                   velocity: np.ndarray | None = None, momentum: float = 0.0) -> float:
    """residual += update in place; returns ‖residual‖² after the addition. ``clear``: also
    zero ``update``, chunk by chunk while it is in cache — the write-back into it (``put``,
    ``accumulate_pairs(zeroed=True)``) then needs no pass of its own. With ``velocity``
    (momentum correction): velocity = momentum·velocity + update, then residual += velocity.

    Each chunk's sum of squares is accumulated in the buffer's dtype (numpy's einsum loop, no
    BLAS, so no BLAS threads); the chunk sums are added in float64, in chunk order.
    """
    check_update(residual, update)
    if velocity is not None:
        check_update(residual, velocity, "velocity")
        check_momentum(momentum)
    loops = native.active()
    if loops is not None and native.contiguous(residual, update, velocity):
        return _add_and_energy_compiled(loops, residual, update, clear, velocity, momentum)

    def work(_part: int, lo: int, hi: int) -> list[float]:
        sums = []
        for start in range(lo, hi, CHUNK):
            chunk = residual[start:min(hi, start + CHUNK)]
            source = update[start:start + chunk.size]
            added = source if velocity is None else accelerate(
                velocity[start:start + chunk.size], source, momentum)
            np.add(chunk, added, out=chunk)
            if clear:
                zero(source)
            sums.append(float(np.einsum("i,i->", chunk, chunk)))
        return sums

    return ordered_sum(run_parts(residual.size, work))


def _add_and_energy_compiled(loops: ModuleType, residual: np.ndarray, update: np.ndarray,
                             clear: bool, velocity: np.ndarray | None, momentum: float) -> float:
    chunk = loops.CHUNK  # the compiled loops' own: one energy partial sum per chunk
    sums = np.empty(-(-residual.size // chunk))
    wide = residual.dtype == np.float64

    def work(_part: int, lo: int, hi: int) -> None:  # lo: a multiple of chunk
        loops.add_energy(residual[lo:hi], update[lo:hi],
                         None if velocity is None else velocity[lo:hi], momentum, clear, wide,
                         sums[lo // chunk:-(-hi // chunk)], 0, 0, 0, None, None)

    run_parts(residual.size, work, chunk)
    return ordered_sum([sums.tolist()])


def check_momentum(momentum: float) -> None:
    if not 0 <= momentum < 1:  # also refuses NaN
        raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")


def accelerate(velocity: np.ndarray, update: np.ndarray, momentum: float) -> np.ndarray:
    """velocity = momentum·velocity + update, in place (in the buffers' dtype)."""
    np.multiply(velocity, velocity.dtype.type(momentum), out=velocity)
    np.add(velocity, update, out=velocity)
    return velocity


def ordered_sum(parts: list[list[float]]) -> float:
    """Per-chunk sums added in chunk order (not sum(): Python 3.12's compensates)."""
    total = 0.0
    for sums in parts:
        for value in sums:
            total += value
    return total


def take_and_clear(error: np.ndarray, indices: np.ndarray,
                   out: np.ndarray | None = None) -> tuple[np.ndarray, float]:
    """values = error[indices] (into ``out`` if given), then error[indices] = 0.

    ``indices`` must be strictly ascending (as select_topk returns them), checked before
    anything is written: the gather and the clear of one step touch the same cache lines.
    Returns (values, ‖values‖²), the sum as in add_and_energy.
    """
    check_float_buffer("error", error)
    _check_indices("indices", indices)
    if out is None:
        out = np.empty(indices.size, dtype=error.dtype)
    check_float_buffer("out", out)
    if out.dtype != error.dtype or out.size != indices.size:
        raise ValueError(f"out must be {error.dtype} of {indices.size} elements, "
                         f"got {out.dtype} of {out.size}")
    loops = native.active()
    if loops is not None and _compiled_pairs(error, indices, out):
        return out, loops.take_clear(error, indices, out, error.dtype == np.float64)
    _check_all_ascending(indices, error.size)

    def work(_part: int, lo: int, hi: int) -> list[float]:
        sums = []
        for start in range(lo, hi, INDEX_CHUNK):
            stop = min(hi, start + INDEX_CHUNK)
            step, values = indices[start:stop].astype(np.intp), out[start:stop]
            # intp: numpy would convert int32 for each of the two; "clip": checked above, and
            # it skips take's own bounds check
            np.take(error, step, out=values, mode="clip")
            error[step] = 0
            sums.append(float(np.einsum("i,i->", values, values)))
        return sums

    return out, ordered_sum(run_parts(indices.size, work, INDEX_CHUNK))


def top_energies(values: np.ndarray, counts: list[int]) -> list[float]:
    """For each ``count``, the sum of squares of the ``count`` largest ``|values|`` (in
    float64; a count beyond ``values.size`` takes them all). With the values top-k sent,
    this is exactly the energy a smaller top-k of the same E would have sent: the gains of
    smaller ratios without running them. One partition, no full sort."""
    check_float_buffer("values", values)
    if any(not isinstance(c, int) or c < 0 for c in counts):
        raise ValueError(f"counts must be non-negative integers, got {counts!r}")
    squares = np.square(values, dtype=np.float64)
    cuts = sorted({squares.size - min(c, squares.size) for c in counts})
    if squares.size:
        squares.partition([c for c in cuts if c < squares.size] or [0])
    return [float(squares[squares.size - min(c, squares.size):].sum()) for c in counts]


def zero(chunk: np.ndarray) -> None:
    if chunk.flags.c_contiguous:  # a byte fill is a memset: faster than numpy's float fill
        chunk.view(np.uint8).fill(0)
    else:
        chunk.fill(0)


def _bounds(run: np.ndarray, starts: np.ndarray) -> list[int]:
    """Where each chunk's part of ascending ``run`` begins (and the end), monotone."""
    found = np.searchsorted(run, starts)
    found[0], found[-1] = 0, run.size  # every index lands in some chunk, checked there
    bounds: list[int] = np.maximum.accumulate(found).tolist()
    return bounds


def _compiled_pairs(target: np.ndarray, indices: np.ndarray, values: np.ndarray) -> bool:
    """What the compiled pair loops take: int32 indices, contiguous buffers (a ValueError
    or IndexError from them names the indices, as numpy's checks do)."""
    return indices.dtype == np.int32 and native.contiguous(target, indices, values)


def put(target: np.ndarray, indices: np.ndarray, values: np.ndarray) -> None:
    """target[indices] = values into an already zeroed ``target`` (``add_and_energy(...,
    clear=True)``), so no zeroing pass. ``indices`` strictly ascending, checked before anything
    is written."""
    _check_pairs(target, indices, values)
    loops = native.active()
    if loops is not None and _compiled_pairs(target, indices, values):
        loops.scatter(target, indices, values, target.dtype == np.float64, 0)
        return
    _check_all_ascending(indices, target.size)
    for start in range(0, indices.size, INDEX_CHUNK):
        stop = start + INDEX_CHUNK
        target[indices[start:stop].astype(np.intp)] = values[start:stop]


def _run_starts(indices: np.ndarray) -> list[int]:
    """Where each strictly ascending run of ``indices`` begins (N blocks of top-k indices
    concatenated form at most N runs)."""
    starts = [0]
    for lo in range(0, max(0, indices.size - 1), CHUNK):
        hi = min(indices.size, lo + CHUNK + 1)
        drops = np.flatnonzero(indices[lo + 1:hi] <= indices[lo:hi - 1])
        starts.extend((drops + lo + 1).tolist())
        if len(starts) > MAX_RUNS:
            break
    return starts


def accumulate_pairs(target: np.ndarray, indices: np.ndarray, values: np.ndarray,
                     zeroed: bool = False) -> None:
    """target = 0, then target[i] += v for every (i, v) pair; repeated indices add up.
    ``zeroed``: ``target`` is all zeros already (``add_and_energy(..., clear=True)``).

    The input is read as ascending runs (an allgather of N nodes' top-k gives N). Each element
    is summed in input order, ((0 + v_first) + v_second) + ..., exactly as np.add.at does, so
    the result is bit-identical to it and the same on every node. Chunk by chunk: zero the
    chunk, then add each run's pairs that fall in it. More than MAX_RUNS runs: np.add.at.
    """
    _check_pairs(target, indices, values)
    loops = native.active()
    if loops is not None and _compiled_pairs(target, indices, values):
        loops.scatter(target, indices, values, target.dtype == np.float64, 1 if zeroed else 2)
        return
    starts = _run_starts(indices)
    if len(starts) > MAX_RUNS:  # not blocks of top-k indices: the general (slow) way
        if indices.size and (indices.min() < 0 or indices.max() >= target.size):
            raise IndexError(f"indices must be in [0, {target.size})")
        if not zeroed:
            target.fill(0)
        np.add.at(target, indices, values)
        return
    ends = [*starts[1:], indices.size]
    for first, last in zip(starts, ends, strict=True):
        if last > first and (indices[first] < 0 or indices[last - 1] >= target.size):
            raise IndexError(f"indices must be in [0, {target.size}); a run spans "
                             f"{indices[first]}..{indices[last - 1]}")
    chunk_starts = np.arange(0, target.size + CHUNK, CHUNK, dtype=np.int64)
    chunk_starts[-1] = max(target.size, 1)
    runs = [(indices[a:b], values[a:b]) for a, b in zip(starts, ends, strict=True) if b > a]
    bounds = [_bounds(run, chunk_starts) for run, _ in runs]

    def work(_part: int, lo: int, hi: int) -> None:
        for start in range(lo, hi, CHUNK):
            chunk = target[start:min(hi, start + CHUNK)]
            if not zeroed:
                zero(chunk)
            at = start // CHUNK
            for (run, run_values), edge in zip(runs, bounds, strict=True):
                first, last = edge[at], edge[at + 1]
                if last > first:  # np.add.at with intp indices: the fastest scatter-add
                    local = np.subtract(run[first:last], start, dtype=np.intp)
                    np.add.at(chunk, local, run_values[first:last])

    run_parts(target.size, work)
