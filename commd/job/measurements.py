"""This node's measurements of a job: one record per iteration, summarised per report round.

The pipeline times each collective (``CommSample``) and, from the clients' per-layer stamps,
when each layer became ready; a record per iteration goes to the job's ``NodeProfiler``, which
sums up a round for the coordinator (``PeerProfile``). Nothing here does I/O.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from commd.compression.planning import mean_gain_per_ratio
from commd.job.schedule import Plan
from commd_protocol.peer import ALLREDUCE

# The start-up probe: float32 element counts (1 KiB … 4 MiB), each run PROBE_REPEATS times;
# the first round is a warm-up that also absorbs the nodes' arrival skew.
PROBE_ELEMENTS = (256, 4096, 65536, 262144, 1048576)
PROBE_REPEATS = 4


@dataclass(frozen=True)
class CommSample:
    """One collective: the wire time from when it could start to when it finished."""

    key: tuple[int, int]  # (iteration, group) — the same collective on every node
    nbytes: int  # all-reduce: the buffer; allgather: what each node contributes
    seconds: float
    kind: int = ALLREDUCE


class WireClock:
    """Wire times of collectives that queue one behind another on the job's engine."""

    def __init__(self) -> None:
        self._last_end = 0.0  # perf_counter when the previous collective finished

    def span(self, launched: float) -> float:
        """A collective launched at ``launched`` (perf_counter) has just finished: its wire
        time, from when it could start (launched, or the previous one's end, whichever is
        later)."""
        ended = time.perf_counter()
        begin = max(launched, self._last_end)
        self._last_end = ended
        return ended - begin

    def timed(self, wire: asyncio.Future[Any], key: tuple[int, int], nbytes: int,
              samples: list[CommSample]) -> asyncio.Future[Any]:
        """Append ``wire``'s sample to ``samples`` when it completes; returns ``wire``."""
        # A collective waits behind the previous one on the engine's queue: its wire time
        # starts when it was launched or when the previous one finished, whichever is later.
        launched = time.perf_counter()

        def record(done: asyncio.Future[Any]) -> None:
            wall = self.span(launched)
            # A device engine measures the collective itself (timing events on its stream):
            # the wall clock would also count the wait for the producers' events.
            measured = None if done.cancelled() or done.exception() else done.result()
            took = measured if isinstance(measured, float) else wall
            samples.append(CommSample(key, nbytes, took))

        wire.add_done_callback(record)
        return wire


class StepClock:
    """Makes each iteration's record, with the step time since the previous one finished."""

    def __init__(self) -> None:
        self._last_finished = 0.0

    def record(self, plan: Plan, iteration: int, ready_at: np.ndarray,
               samples: list[CommSample], gains: IterationGains,
               finished: float) -> IterationRecord:
        """``ready_at``: when each layer became ready; ``finished``: when the iteration's last
        group was done."""
        start = float(ready_at.min())
        period = finished - self._last_finished if self._last_finished else 0.0
        self._last_finished = finished
        return IterationRecord(
            plan=plan.version,
            period_s=period,
            gain=gains.gain,
            # a top-k plan's ratio; 1 for a dense or low-rank one (its gain stands alone)
            ratio=plan.ratio if plan.ratio > 0 and not plan.dense else 1.0,
            iteration=iteration,
            ready_offsets_s=ready_at - start,
            comm=samples,
            exposed_comm_s=max(0.0, finished - float(ready_at.max())),
            iteration_s=finished - start,
            cpu=list(gains.cpu),
            lower_gains=list(gains.lower),
        )


@dataclass(frozen=True)
class IterationGains:
    """What a compressed job's iteration reports besides its timings."""

    gain: float = 1.0  # mean compression gain of its compressed groups (1: none)
    # per compressed group: (dense elements, selection s, update s, overhead s)
    cpu: list[tuple[int, float, float, float]] = field(default_factory=list)
    # (ratio, mean gain) a smaller ratio would have had, from this iteration's selections
    lower: list[tuple[float, float]] = field(default_factory=list)


@dataclass
class IterationRecord:
    """One iteration as this node measured it: when each layer became ready, each collective's
    sample, the exposed communication, the iteration and step times, and what its compression
    measured. The ``NodeProfiler`` sums a round of them up."""

    iteration: int
    ready_offsets_s: np.ndarray  # per layer, after the first layer became ready
    comm: list[CommSample]
    exposed_comm_s: float  # end of the last collective minus the last layer's ready time
    iteration_s: float
    gain: float = 1.0  # compression gain ‖sent‖²/‖E‖² (1: dense)
    ratio: float = 1.0  # top-k ratio used (1: dense)
    plan: int = 0  # the plan version the iteration ran with
    period_s: float = 0.0  # since the previous iteration finished (0: first): the step time
    # per compressed group: (dense elements, selection s (0: not selected here), update s,
    # overhead s: the group's time that is neither CPU work, wire, nor waiting for its turn)
    cpu: list[tuple[int, float, float, float]] = field(default_factory=list)
    lower_gains: list[tuple[float, float]] = field(default_factory=list)  # IterationGains'


@dataclass(frozen=True)
class RoundSummary:
    """A round of ``IterationRecord``s summed up for the coordinator's ``PeerProfile``."""

    ready_offsets_s: list[float]
    comm: list[list[float]]
    exposed_comm_s: float
    iteration_s: float
    gains: list[list[float]]  # [ratio, mean gain] per ratio used (compressed rounds only)
    plan: int = 0  # the plan version of the round's last iteration
    step_s: float = 0.0  # median step time under that plan (0: fewer than two iterations)
    # [selection s per element, update s per element, overhead s per group] of compressed
    # groups ([]: none ran)
    cpu_s_per_element: list[float] = field(default_factory=list)


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
            cpu_s_per_element=_cpu_per_element(records),
        )


def _gains_by_ratio(records: Sequence[IterationRecord]) -> list[list[float]]:
    def observed() -> Iterator[tuple[float, float]]:
        for record in records:
            if record.ratio < 1.0:
                yield record.ratio, record.gain
            yield from record.lower_gains

    return [[ratio, gain] for ratio, gain in mean_gain_per_ratio(observed())]


def _cpu_per_element(records: Sequence[IterationRecord]) -> list[float]:
    """[selection s per element, update s per element, median overhead s per group] over the
    round ([]: nothing compressed; a selection cost of 0: this node selected nothing, e.g.
    never the leader)."""
    rows = [row for record in records for row in record.cpu]
    elements = sum(row[0] for row in rows)
    if not elements:
        return []
    selected = sum(row[0] for row in rows if row[1] > 0)
    select = sum(row[1] for row in rows) / selected if selected else 0.0
    return [select, sum(row[2] for row in rows) / elements,
            float(np.median([row[3] for row in rows]))]
