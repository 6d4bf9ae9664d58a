"""The data plane of a ``fault_tolerance="continue"`` job: an iteration that a lost node
cannot corrupt, and that the survivors can finish without it.

Two differences from ``Pipeline``, each so that an iteration in flight can be abandoned:

- **The collectives never touch the ranks' buffers.** Each group's node sum is copied into a
  work buffer of the epoch and reduced there. Gloo reduces in place, so an all-reduce cut off
  by a lost peer leaves partial sums behind, and the abandoned collective may even finish
  later, writing into the memory it was given: that is an old epoch's work buffer, never the
  ranks' gradients, which stay as the ranks wrote them until the iteration commits.
- **Results reach the ranks only after a job-wide commit**: a one-element all-reduce that each
  node enters once every group is whole on it. A node that finished the commit knows every
  node holds the whole results, which is what lets the coordinator decide after a loss who
  delivers and who runs the iteration again (``commd.coordinator.membership``).

The cost, paid only by tolerant jobs: one more pass over the gradients per iteration (the
copy into the work buffer; the write-back replaces avg's in-place scaling), the write-back
after the last group instead of overlapped with it, and one small all-reduce.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from commd.engines import Engine
from commd.engines.buffer_ops import Buffer
from commd.job.pipeline import GroupViews, Pipeline
from commd.job.schedule import Plan


class ResumeError(Exception):
    """The coordinator's resume does not fit where this node stands."""


class TolerantPipeline(Pipeline):
    """The ``Pipeline`` of a ``fault_tolerance="continue"`` job (the module's docstring): its groups
    are reduced in the epoch's work buffer and reach the ranks' buffers only after the commit."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        total = sum(self.sizes)
        self._work = np.empty(total, dtype=self.buffers[0].dtype)
        self._commit_flag = np.zeros(1, dtype=np.float32)
        self.committing = False  # every group of the current iteration is whole here
        self._in_flight: Plan | None = None  # the plan of the iteration being run
        self._gone: set[int] = set()  # local indexes of ranks gone (``drop_local``)

    # --- the strategy ----------------------------------------------------------------------------

    async def _node_sum(self, plan: Plan, index: int, views: list[Buffer]) -> Buffer:
        self._in_flight = plan
        start, stop = plan.spans[index]
        total = self._work[start:stop]
        await self._memory(np.copyto, total, views[0])
        if len(views) > 1:
            await self._memory(self.ops.sum_into, total, views[1:], self.dtype)
        return total

    async def _write_back(self, total: Buffer, views: list[Buffer]) -> None:
        """Deferred to the commit: the ranks' buffers keep their gradients until then."""

    async def _commit(self, plan: Plan) -> None:
        self.committing = True
        if self.engine is not None:
            self._commit_flag[0] = 1.0
            await self.engine.allreduce(self._commit_flag, "float32")
        # Nothing below awaits: once the commit is through, the results reach the ranks and
        # the iteration ends in one turn of the loop; a reform can stop the pipeline only
        # while it waits (before the commit is through), never half-way through this.
        self._publish()
        self.committing = False

    def _publish(self) -> None:
        """The work buffer's results, scaled for avg, into every local rank's buffer."""
        live = [b for index, b in enumerate(self.buffers) if index not in self._gone]
        self.ops.finish(self._work, live, self._factor(), self.dtype)

    def drop_local(self, local_index: int) -> None:
        """A local rank is gone; the node goes on with the others (stopped, before a resume).
        It contributes zeros from now on, its marks are taken as given, and nothing is
        written to its memory (which is unmapped: a stray view would read zeros anyway)."""
        self._gone.add(local_index)
        self.buffers[local_index] = np.zeros_like(self.buffers[local_index])
        self._group_views = GroupViews(self.buffers)
        self._ready.absent(local_index)

    def readmit(self, local_index: int, buffer: Buffer) -> None:
        """A replacement takes a gone local rank's place (stopped, before a resume): from
        the iteration the resume runs, its buffer is reduced and written again, and its
        layers count as marked only once it marks them."""
        self._gone.discard(local_index)
        self.buffers[local_index] = buffer
        self._group_views = GroupViews(self.buffers)
        self._ready.present(local_index)

    # --- a membership change ---------------------------------------------------------------------

    def suspend(self) -> tuple[int, bool]:
        """Stop the data plane where it stands (the collective in flight is abandoned);
        (iterations delivered, whether the current one waits only for its commit)."""
        self.stop()
        for group in self._finishing:  # groups launched before the one awaited when stopped
            group.cancel()
        self._task = None
        return self.iteration, self.committing

    def resume(self, *, engine: Engine | None, node_index: int, nodes: int, world_size: int,
               iteration: int) -> None:
        """Go on in a new epoch from ``iteration``: deliver the committed iteration first if
        this node had not yet, or run the current one again among the new members.
        ResumeError when ``iteration`` does not fit this node's state."""
        if iteration == self.iteration + 1 and self.committing:
            self._publish()
            self._complete_committed()
        elif iteration != self.iteration:
            raise ResumeError(f"the coordinator resumes at iteration {iteration}, but this node "
                              f"delivered {self.iteration} (committing: {self.committing})")
        self.committing = False
        self.engine = engine
        self.world_size = world_size
        # A new work buffer: an abandoned collective of the old epoch may still write into
        # the old one (its engine keeps it alive until Gloo gives up on it).
        self._work = np.empty_like(self._work)
        self._commit_flag = np.zeros(1, dtype=np.float32)
        # Residuals are dropped: what top-k held back on this node before the change is not
        # sent (the iteration runs again from the ranks' own gradients).
        self.compression = self._new_compression(node_index, nodes)
        self._watch.where = f"node {node_index} of {nodes}"
        self.start()

    def forget_expected_decisions(self) -> None:
        """The coordinator that was to decide them is gone (a takeover): no iteration waits
        for them; the next coordinator's rounds decide from here."""
        self._schedule.forget_expected()

    def join_at(self, iteration: int, *, world_size: int, expect: list[int]) -> None:
        """A node that joins a running job starts at its ``iteration`` (before ``start``),
        awaiting the decisions the others await (``expect``)."""
        self.iteration = iteration
        self.world_size = world_size
        for pending in expect:
            self.expect_decision(pending)

    def _complete_committed(self) -> None:
        """The iteration whose commit went through elsewhere: done here too."""
        plan = self._in_flight or self.plan
        assert plan is not None
        done, ready_at, gains = self._advance(plan)
        # Its record too (without the abandoned timings): the report rounds count iterations,
        # and a round this node never reported would hold every node's next plan.
        self._on_record(self._records_clock.record(plan, done, ready_at, [], gains,
                                                   time.monotonic()))
        self._on_complete(done, plan)

