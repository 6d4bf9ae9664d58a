"""Runtime profiling: timings in, the planner's inputs out (alpha, beta, backward times).

Pure functions plus one small accumulator per job and node; nothing here does I/O.
Backward times come from the moments each layer became ready on the node (the daemon stamps
ready notifications as they arrive — same node, well under a millisecond late). a and b come
from the job's own collectives, fitted by least squares, plus a probe over a range of sizes
when the job starts.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.ma

from commd.plan import LinearCost

# The start-up probe: float32 element counts (1 KiB … 4 MiB), each run PROBE_REPEATS times;
# the first round is a warm-up that also absorbs the nodes' arrival skew.
PROBE_ELEMENTS = (256, 4096, 65536, 262144, 1048576)
PROBE_REPEATS = 4
REPORT_EVERY = 10  # iterations per report round: each node sends its profile, the
DECISION_LAG = 2  # coordinator answers with the plan for iteration last + 1 + DECISION_LAG


ALLREDUCE, ALLGATHER = 0, 1  # kinds of timed collectives in a report


@dataclass(frozen=True)
class CommSample:
    """One collective: the wire time from when it could start to when it finished."""

    key: tuple[int, int]  # (iteration, group) — the same collective on every node
    nbytes: int  # all-reduce: the buffer; allgather: what each node contributes
    seconds: float
    kind: int = ALLREDUCE


def allreduce_terms(kind: int, nbytes: int, nodes: int) -> tuple[float, float]:
    """A collective's time as ca·a + cb·b, in the job's ring all-reduce model a + b·M.

    With a = 2(N−1)α and b = 2(N−1)/N·β, Table I's allgather α·log N + (N−1)·M·β becomes
    log N / (2(N−1))·a + N/2·M·b — so allgathers measure the same two numbers.
    """
    if kind == ALLGATHER and nodes > 1:
        return math.log2(nodes) / (2 * (nodes - 1)), nodes / 2 * nbytes
    return 1.0, float(nbytes)


@dataclass
class IterationRecord:
    iteration: int
    ready_offsets_s: np.ndarray  # per layer, after the first layer became ready
    comm: list[CommSample]
    exposed_comm_s: float  # end of the last collective minus the last layer's ready time
    iteration_s: float
    gain: float = 1.0  # compression gain ‖sent‖²/‖E‖² (1: dense)
    ratio: float = 1.0  # top-k ratio used (1: dense)
    plan: int = 0  # the plan version the iteration ran with
    period_s: float = 0.0  # since the previous iteration finished (0: first): the step time


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


@dataclass(frozen=True)
class RoundSummary:
    ready_offsets_s: list[float]
    comm: list[list[float]]
    exposed_comm_s: float
    iteration_s: float
    gains: list[list[float]]  # [ratio, mean gain] per ratio used (compressed rounds only)
    plan: int = 0  # the plan version of the round's last iteration
    step_s: float = 0.0  # median step time under that plan (0: fewer than two iterations)


@dataclass
class NodeProfiler:
    """Accumulates one node's iteration records between two reports."""

    layers: int
    records: list[IterationRecord] = field(default_factory=list)

    def add(self, record: IterationRecord) -> None:
        self.records.append(record)

    def summary(self) -> RoundSummary:
        """Medians and means over the records since the last summary, which it consumes."""
        records, self.records = self.records, []
        if not records:
            return RoundSummary([], [], 0.0, 0.0, [])
        plan = records[-1].plan
        # Periods that began and ended under the round's last plan.
        periods = [r.period_s for before, r in itertools.pairwise(records)
                   if before.plan == r.plan == plan and r.period_s > 0]
        offsets = np.median(np.stack([r.ready_offsets_s for r in records]), axis=0)
        return RoundSummary(
            ready_offsets_s=[float(x) for x in offsets],
            comm=[[s.key[0], s.key[1], s.nbytes, s.seconds, s.kind]
                  for r in records for s in r.comm],
            exposed_comm_s=float(np.mean([r.exposed_comm_s for r in records])),
            iteration_s=float(np.mean([r.iteration_s for r in records])),
            gains=_gains_by_ratio(records),
            plan=plan,
            step_s=float(np.median(periods)) if periods else 0.0,
        )


def _gains_by_ratio(records: Sequence[IterationRecord]) -> list[list[float]]:
    by_ratio: dict[float, list[float]] = {}
    for record in records:
        if record.ratio < 1.0:
            by_ratio.setdefault(record.ratio, []).append(record.gain)
    return [[ratio, float(np.mean(gains))] for ratio, gains in sorted(by_ratio.items())]
