"""``commd trace``: the events of a job's next N whole iterations on this node, for a timeline.

A ``TraceRequest`` arms a ``TraceRecorder`` on the job's pipeline (``Job.trace``). The pipeline
holds it in ``Pipeline.trace`` (None when no one traces) and calls it from a few hooks, each
behind one ``if self.trace is not None:``: a group's marks are complete (its local sum
begins), the group is summed, it is on the wire, its write-back is done, the iteration ended
(the per-layer ready stamps, the plan); and, for a ``fault_tolerance="continue"`` job, the
job resumed in a new membership epoch (``membership``, from
``commd.job.membership.Membership``: an instant on the "membership" row). The recorder
starts at the pipeline's next whole iteration, keeps at most ``MAX_EVENTS`` events, answers
the requester once N iterations are recorded or the request's timeout passed, and detaches
itself.

Times are CLOCK_MONOTONIC seconds: the clock of the clients' ready stamps, one per machine.
On a device (NCCL) the spans show when the work was issued, not when the stream ran it.
"""

from __future__ import annotations

import asyncio
import functools
import math
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, Protocol

import msgspec
import numpy as np

from commd.compression.costs import EXCHANGES as TOPK_EXCHANGES
from commd.compression.topk import topk_count
from commd.job.schedule import Plan
from commd.job.state import JobError
from commd_protocol import (
    Error,
    ErrorCode,
    PeerSetup,
    Register,
    TraceEvent,
    TraceReply,
    TraceRequest,
)
from commd_protocol.checks import job_id_problem
from commd_protocol.dtypes import itemsize
from commd_protocol.errors import prefixed

MAX_ITERATIONS = 1000  # per trace
MAX_EVENTS = 16_000  # per trace and node: a reply stays under the 4 MiB message limit
# A trace holds the job's one trace slot (and its user's share of traces, shares.TRACES) until
# it ends: ten minutes bounds how long one request can keep the job's own user from tracing it.
MAX_TIMEOUT_S = 600.0
MAX_NAME = 48  # characters of a layer's name kept in its ready events
# Characters of a membership change's words (and of its ranks, written out) kept in its mark:
# a change names nodes and ranks, and MAX_EVENTS marks must still fit a reply.
MAX_CHANGE = 200

Reply = Callable[[msgspec.Struct], None]


class Traced(Protocol):
    """What a recorder needs of the pipeline it records (``commd.job.pipeline.Pipeline``)."""

    trace: TraceRecorder | None
    iteration: int

    @property
    def in_flight(self) -> bool: ...


class TraceRecorder:
    """Collects one job's trace events on this node for the next N whole iterations."""

    def __init__(self, request: TraceRequest, reply: Reply) -> None:
        """Checks ``request`` (JobError naming the field); ``reply`` answers the requester."""
        check_request(request)
        self.request = request
        self.events: list[TraceEvent] = []
        self.iterations: list[int] = []  # recorded, each whole
        self.done = False
        self._reply = reply
        self._first = 0  # the first iteration to record
        self._pipeline: Traced | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._truncated = ""
        self._names: list[str] = []
        self._itemsize = 4
        self._node = (0, 1)
        self._plan: Plan | None = None  # the plan of the iteration being recorded
        self._plan_version = -1  # the plan of the last iteration recorded
        self._group_of: list[int] = []  # layer -> its group in that plan
        self._at: dict[tuple[str, int, int], float] = {}  # (event, iteration, group) -> when
        self._mark = 0  # len(events) when the iteration being recorded began
        self._wire_free = 0.0  # when this node's previous collective finished

    def arm(self, pipeline: Traced, registration: Register, setup: PeerSetup | None) -> None:
        """Record ``pipeline`` from its next whole iteration on (one under way is skipped);
        JobError while another trace of the job runs."""
        running = pipeline.trace
        if running is not None:
            raise JobError(
                f"job {self.request.job!r} is being traced already (for up to "
                f"{running.left_s():.0f} s more); one trace of a job at a time: retry after it",
                ErrorCode.LIMIT)
        self._first = pipeline.iteration + (1 if pipeline.in_flight else 0)
        self._names = [layer.name[:MAX_NAME] for layer in registration.layers]
        self._itemsize = itemsize(registration.dtype)
        if setup is not None:
            self._node = (setup.node_index, setup.nodes)
        self._pipeline = pipeline
        pipeline.trace = self
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self.request.timeout_s, self._expire)

    def left_s(self) -> float:
        """Seconds until this trace answers at the latest (its timeout)."""
        if self._timer is None:
            return self.request.timeout_s
        return max(0.0, self._timer.when() - asyncio.get_running_loop().time())

    # --- hooks of the pipeline -------------------------------------------------------------------

    def group(self, iteration: int, plan: Plan, index: int) -> None:
        """Group ``index``'s marks are complete: its local sum begins."""
        if iteration >= self._first:
            self._plan = plan
            self._at["start", iteration, index] = time.monotonic()

    def launched(self, iteration: int, index: int, wire: asyncio.Future[Any] | None) -> None:
        """A dense group is summed and its all-reduce issued (``wire``; None: one node)."""
        if iteration < self._first or self._plan is None:
            return
        now = self._local_sum(iteration, self._plan, index)
        if wire is None:
            self._wire_done(iteration, self._plan, index, now, None)
        else:
            wire.add_done_callback(
                functools.partial(self._wire_done, iteration, self._plan, index, now))

    def summed(self, iteration: int, index: int) -> None:
        """A top-k group's local sum is done: its selection and exchange begin."""
        if iteration < self._first or self._plan is None:
            return
        self._at["summed", iteration, index] = self._local_sum(iteration, self._plan, index)

    def exchanged(self, iteration: int, index: int, gain: float, wire_s: float) -> None:
        """A compressed group's exchange (top-k, low-rank or float16) is done; ``wire_s``:
        its collectives' share of it."""
        plan = self._plan
        if iteration < self._first or plan is None:
            return
        now = self._at["wire", iteration, index] = time.monotonic()
        began = self._at.get(("summed", iteration, index), now)
        exchange, (start, stop) = plan.exchanges[index], plan.spans[index]
        # k and the ratio are top-k's; a low-rank or float16 group has neither.
        topk: dict[str, int] = (
            {"k": topk_count(stop - start, plan.ratio)} if exchange in TOPK_EXCHANGES else {})
        ratio: dict[str, float] = {"ratio": plan.ratio} if topk else {}
        self._span("compression", iteration, plan, index, began, now, exchange=exchange,
                   **topk, **ratio, gain=round(gain, 6), wire_ms=round(wire_s * 1e3, 6))
        # The collectives run between the arithmetic before and after: drawn at the end.
        wire_began, self._wire_free = max(began, now - wire_s, self._wire_free), now
        self._span("wire", iteration, plan, index, wire_began, now, exchange=exchange, **topk)

    def finishing(self, iteration: int, index: int, written: asyncio.Future[Any]) -> None:
        """``written`` completes when the group is back in every local rank's buffer."""
        if iteration >= self._first and self._plan is not None:
            written.add_done_callback(
                functools.partial(self._written, iteration, self._plan, index))

    def iteration(self, iteration: int, plan: Plan, ready_at: np.ndarray) -> None:
        """``iteration`` ended; ``ready_at``: when each layer became ready on this node."""
        if iteration < self._first or self.done:
            return
        start, now = float(ready_at.min()), time.monotonic()
        if plan.version != self._plan_version:
            self._plan_changed(iteration, plan, start)
        for layer, at in enumerate(ready_at.tolist()):
            name = self._names[layer] if layer < len(self._names) else f"layer {layer}"
            self._add(TraceEvent(row="ready", name=name, start_s=at, iteration=iteration,
                                 args={"layer": layer, "group": self._group_of[layer]}))
        self._add(TraceEvent(row="iteration", name=f"iteration {iteration}", start_s=start,
                             duration_s=now - start, iteration=iteration,
                             args={"plan": plan.version, "groups": len(plan.groups)}))
        self.iterations.append(iteration)
        self._at.clear()
        size, self._mark = len(self.events) - self._mark, len(self.events)
        remaining = self.request.iterations - len(self.iterations)
        if remaining and not self._truncated and len(self.events) + size > MAX_EVENTS:
            self._truncated = (f"{len(self.iterations)} of {self.request.iterations} iterations: "
                               f"a trace keeps at most {MAX_EVENTS} events per node")
        if self._truncated or not remaining:
            self._finish()

    def membership(self, epoch: int, members: list[int], change: str, node: tuple[int, int],
                   iteration: int) -> None:
        """The job resumed in membership epoch ``epoch`` with ranks ``members`` because of
        ``change``; this node is now ``node`` (index, nodes) and runs ``iteration`` next.
        Marked whenever it happens while armed, even before the first recorded iteration:
        a change is what a trace around a fault is for."""
        if self.done:
            return
        self._node = node
        ranks = ",".join(str(rank) for rank in members)
        self._add(TraceEvent(
            row="membership", name=f"epoch {epoch}", start_s=time.monotonic(),
            iteration=iteration,
            args={"epoch": epoch, "change": change[:MAX_CHANGE], "ranks": ranks[:MAX_CHANGE],
                  "world_size": len(members), "node": f"{node[0]}/{node[1]}"}))

    # --- inside --------------------------------------------------------------------------------

    def _plan_changed(self, iteration: int, plan: Plan, start: float) -> None:
        self._plan_version = plan.version
        self._group_of = [0] * sum(len(group) for group in plan.groups)
        for index, group in enumerate(plan.groups):
            for layer in group:
                self._group_of[layer] = index
        kinds = Counter(plan.exchanges)
        self._add(TraceEvent(
            row="plan", name=f"plan v{plan.version}", start_s=start, iteration=iteration,
            args={"version": plan.version, "groups": len(plan.groups),
                  "exchanges": ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items()))}))

    def _local_sum(self, iteration: int, plan: Plan, index: int) -> float:
        now = time.monotonic()
        self._span("local sum", iteration, plan, index,
                   self._at.get(("start", iteration, index), now), now)
        return now

    def _wire_done(self, iteration: int, plan: Plan, index: int, issued: float,
                   _wire: asyncio.Future[Any] | None) -> None:
        """A collective queues behind the previous one on the engine: it is on the wire from
        when it was issued or the previous one finished, whichever is later."""
        end = self._at["wire", iteration, index] = time.monotonic()
        began, self._wire_free = max(issued, self._wire_free), end
        self._span("wire", iteration, plan, index, began, end,
                   queued_ms=round(max(0.0, began - issued) * 1e3, 6))

    def _written(self, iteration: int, plan: Plan, index: int, _done: asyncio.Future[Any]) -> None:
        end = time.monotonic()
        began = min(self._at.get(("wire", iteration, index), end), end)
        self._span("write back", iteration, plan, index, began, end)

    def _span(self, row: str, iteration: int, plan: Plan, index: int, start: float, end: float,
              **args: str | int | float) -> None:
        group, (first, stop) = plan.groups[index], plan.spans[index]
        layers = f"{group[0]}-{group[-1]}" if len(group) > 1 else str(group[0])
        self._add(TraceEvent(
            row=row, name=f"group {index}", start_s=start, duration_s=max(0.0, end - start),
            iteration=iteration,
            args={"group": index, "layers": layers, "bytes": (stop - first) * self._itemsize,
                  **args}))

    def _add(self, event: TraceEvent) -> None:
        if self.done:
            return
        if len(self.events) >= MAX_EVENTS:
            self._truncated = (f"an iteration of more than {MAX_EVENTS} events: the rest of "
                               "it was dropped")
            return
        self.events.append(event)

    def _expire(self) -> None:
        """The request's timeout passed: answer with the whole iterations recorded, if any."""
        if self.done:
            return
        # The iteration under way goes, but not a membership change marked in it: the
        # change happened, whether or not an iteration finished after it.
        marks = [e for e in self.events[self._mark:] if e.row == "membership"]
        self.events[self._mark:] = marks
        request = self.request
        if self.iterations:
            self._truncated = (f"{len(self.iterations)} of {request.iterations} iterations: "
                               f"the trace's timeout of {request.timeout_s:g} s passed")
            self._finish()
            return
        self._detach()
        self._reply(Error(code=ErrorCode.TIMEOUT, ref="trace", message=prefixed(
            f"no iteration of job {request.job!r} finished within the trace's timeout of "
            f"{request.timeout_s:g} s (from iteration {self._first} on); is it training? "
            "`commd status` shows it")))

    def _finish(self) -> None:
        self._detach()
        node_index, nodes = self._node
        self._reply(TraceReply(job=self.request.job, node_index=node_index, nodes=nodes,
                               iterations=self.iterations, events=self.events,
                               truncated=self._truncated))

    def _detach(self) -> None:
        self.done = True
        if self._timer is not None:
            self._timer.cancel()
        if self._pipeline is not None and self._pipeline.trace is self:
            self._pipeline.trace = None
        self._pipeline = None


def check_request(request: TraceRequest) -> None:
    """JobError naming what is wrong with a trace request's values."""
    if job_id_problem(request.job):
        raise JobError(f"trace: invalid job id {request.job[:140]!r}: use 1-128 of "
                       "A-Z a-z 0-9 _.:@/+-")
    if not 1 <= request.iterations <= MAX_ITERATIONS:
        code = ErrorCode.LIMIT if request.iterations > MAX_ITERATIONS else ErrorCode.INVALID
        raise JobError(f"trace of job {request.job!r}: iterations must be 1 to {MAX_ITERATIONS}, "
                       f"got {request.iterations}", code)
    if not (math.isfinite(request.timeout_s) and 0 < request.timeout_s <= MAX_TIMEOUT_S):
        over = math.isfinite(request.timeout_s) and request.timeout_s > MAX_TIMEOUT_S
        code = ErrorCode.LIMIT if over else ErrorCode.INVALID
        raise JobError(f"trace of job {request.job!r}: timeout_s must be over 0 and at most "
                       f"{MAX_TIMEOUT_S:g}, got {request.timeout_s!r}", code)
