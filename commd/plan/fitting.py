"""Fitting the planner's inputs to measurements: a and b from timed collectives, backward
times from ready offsets, and how far a new fit moved from the last.

Pure functions: the nodes time their collectives and stamp their ready marks (the clients stamp
each layer; see ``commd.job.measurements``), the coordinator fits what every node reported.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from commd.plan.cost import LinearCost
from commd_protocol.peer import ALLGATHER, ALLREDUCE

__all__ = [
    "ALLGATHER",
    "ALLREDUCE",
    "allreduce_terms",
    "backward_from_offsets",
    "combine_comm",
    "fit_cost",
    "fit_terms",
    "profile_drift",
    "relative_change",
]


def allreduce_terms(kind: int, nbytes: int, nodes: int) -> tuple[float, float]:
    """A collective's time as ca·a + cb·b, in the job's ring all-reduce model a + b·M.

    With a = 2(N−1)α and b = 2(N−1)/N·β, Table I's allgather α·log N + (N−1)·M·β becomes
    log N / (2(N−1))·a + N/2·M·b — so allgathers measure the same two numbers.
    """
    if kind == ALLGATHER and nodes > 1:
        return math.log2(nodes) / (2 * (nodes - 1)), nodes / 2 * nbytes
    return 1.0, float(nbytes)


def fit_cost(samples: Sequence[tuple[int, float]]) -> LinearCost | None:
    """Least-squares a + b·M over all-reduce (bytes, seconds); None if underdetermined."""
    return fit_terms([(1.0, float(nbytes), seconds) for nbytes, seconds in samples])


def fit_terms(rows: Sequence[tuple[float, float, float]]) -> LinearCost | None:
    """Least-squares a, b over rows (ca, cb, seconds) with seconds ≈ ca·a + cb·b, a, b ≥ 0.

    Each distinct (ca, cb) is first reduced to its median, so that many samples of one size
    do not drown the others and outliers (a scheduler hiccup) are damped. The fit minimises
    relative errors: with plain least squares a few milliseconds of noise on a 4 MiB
    all-reduce would swamp the start-up cost a, which only small messages show. None when
    fewer than two distinct rows leave a and b undetermined.
    """
    by_terms: dict[tuple[float, float], list[float]] = {}
    for ca, cb, seconds in rows:
        by_terms.setdefault((ca, cb), []).append(float(seconds))
    if len(by_terms) < 2:
        return None
    terms = sorted(by_terms)
    design = np.array(terms, dtype=np.float64)
    times = np.array([np.median(by_terms[t]) for t in terms])
    weights = 1.0 / np.maximum(times, 1e-9)
    (alpha, beta), *_ = np.linalg.lstsq(design * weights[:, None], times * weights, rcond=None)
    if beta < 0:  # noise on a flat curve: all latency
        return LinearCost(alpha_s=float(np.median(times / design[:, 0])), beta_s_per_byte=0.0)
    if alpha < 0:  # noise near the origin: a line through zero
        sizes = design[:, 1]
        beta = float(np.dot(sizes, times) / np.dot(sizes, sizes))
        return LinearCost(alpha_s=0.0, beta_s_per_byte=beta)
    return LinearCost(alpha_s=float(alpha), beta_s_per_byte=float(beta))


def backward_from_offsets(offsets: np.ndarray) -> list[float]:
    """Per-layer backward times (forward order) from ready offsets, the last layer first.

    ready(l) = Σ backward[l..L-1]; offsets are made monotone first (a median per layer can
    be out of order by noise).
    """
    in_backward_order = np.maximum.accumulate(np.asarray(offsets, dtype=np.float64)[::-1])
    durations = np.diff(in_backward_order, prepend=0.0)
    return [float(x) for x in durations[::-1]]


def combine_comm(reports: Sequence[Sequence[Sequence[float]]]) -> list[tuple[int, int, float]]:
    """One (kind, bytes, seconds) per collective over all nodes: the shortest measurement.

    A node that reached a collective early also measured its wait for the others; the node
    that arrived last measured the wire alone. Rows are [iteration, group, bytes, seconds]
    with an optional fifth element, the kind (all-reduce when absent).
    """
    best: dict[tuple[int, int, int], tuple[int, int, float]] = {}
    for report in reports:
        for row in report:
            iteration, group, nbytes, seconds = row[:4]
            kind = int(row[4]) if len(row) > 4 else ALLREDUCE
            key = (int(iteration), int(group), kind)
            if key not in best or seconds < best[key][2]:
                best[key] = (kind, int(nbytes), float(seconds))
    return list(best.values())


def relative_change(old: float, new: float) -> float:
    scale = max(abs(old), abs(new))
    return 0.0 if scale == 0 else abs(new - old) / scale


def profile_drift(old: Sequence[float], new: Sequence[float]) -> float:
    """How much a backward profile moved: Σ|Δ| over Σ, 0 when both are empty."""
    total = max(float(np.sum(old)), float(np.sum(new)))
    if total == 0:
        return 0.0
    return float(np.sum(np.abs(np.asarray(new) - np.asarray(old)))) / total
