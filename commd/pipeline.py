"""The data plane of one job on one node: readiness tracking and group execution.

Groups run in plan order on every node, so no per-iteration negotiation is needed. Each group
is summed over the local ranks, all-reduced once among the nodes, scaled for avg and written
back to every local rank; group g+1 is summed while group g is on the wire.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .engines import Engine, host_ops

# Below this many bytes a memory op is cheaper inline than a hop to a worker thread.
_INLINE_BYTES = 256 * 1024


class ReadyError(ValueError):
    """A bad ready notification; the job carries on."""


@dataclass
class IterationStats:
    """Measured times of recent iterations, for status and (later) the profiler."""

    completed: int = 0
    last_s: float = 0.0
    mean_s: float = 0.0
    history: list[float] = field(default_factory=list)

    def record(self, seconds: float) -> None:
        self.completed += 1
        self.last_s = seconds
        self.history = [*self.history[-99:], seconds]
        self.mean_s = sum(self.history) / len(self.history)


class Pipeline:
    """Runs iterations for one job: counts ready marks, launches groups, reports completion."""

    def __init__(
        self,
        *,
        groups: Sequence[Sequence[int]],
        spans: Sequence[tuple[int, int]],
        buffers: Sequence[np.ndarray],
        dtype: str,
        op: str,
        world_size: int,
        engine: Engine | None,
        executor: Executor,
        on_complete: Callable[[int], None],
        on_failure: Callable[[BaseException], None],
    ) -> None:
        self.groups = [list(g) for g in groups]
        self.spans = list(spans)
        self.buffers = list(buffers)  # one flat array per local rank, local-rank order
        self.dtype = dtype
        self.op = op
        self.world_size = world_size
        self.engine = engine
        self._executor = executor
        self._on_complete = on_complete
        self._on_failure = on_failure
        layers = sum(len(g) for g in groups)
        self._group_of = np.empty(layers, dtype=np.int64)
        for index, group in enumerate(self.groups):
            self._group_of[group] = index
        self._marked = np.zeros((len(self.buffers), layers), dtype=bool)
        self._missing = [0] * len(self.groups)
        self._ready: list[asyncio.Event] = []
        self.iteration = 0
        self.stats = IterationStats()
        self._started_at = 0.0
        self._task: asyncio.Task[None] | None = None
        self._reset()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="commd-pipeline")

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    # --- readiness (called from the control plane) ---------------------------------------------

    def mark(self, local_index: int, layers: Sequence[int]) -> None:
        """Record ready layers of one local rank; raise ReadyError and change nothing if bad."""
        row = self._marked[local_index]
        count = row.size
        for layer in layers:
            if not 0 <= layer < count:
                raise ReadyError(f"ready for unknown layer {layer}; layers are 0..{count - 1}")
        if len(set(layers)) != len(layers) or row[list(layers)].any():
            twice = sorted({lay for lay in layers if row[lay] or list(layers).count(lay) > 1})
            raise ReadyError(
                f"ready twice in iteration {self.iteration} for layer(s) {twice}; "
                "wait for the iteration to finish before marking again"
            )
        if not row.any() and not self._marked.any():
            self._started_at = time.perf_counter()
        row[list(layers)] = True
        for layer in layers:
            group = int(self._group_of[layer])
            self._missing[group] -= 1
            if self._missing[group] == 0:
                self._ready[group].set()

    def _reset(self) -> None:
        self._marked[:] = False
        self._missing = [len(g) * len(self.buffers) for g in self.groups]
        self._ready = [asyncio.Event() for _ in self.groups]

    # --- execution -------------------------------------------------------------------------------

    async def _run(self) -> None:
        try:
            while True:
                finishing = []
                for index in range(len(self.groups)):
                    await self._ready[index].wait()
                    finishing.append(await self._launch(index))
                await asyncio.gather(*finishing)
                self.stats.record(time.perf_counter() - self._started_at)
                done = self.iteration
                self.iteration += 1
                self._reset()
                self._on_complete(done)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._on_failure(exc)

    async def _launch(self, index: int) -> asyncio.Future[Any]:
        """Sum the local ranks into the first one's buffer, then put the group on the wire."""
        start, stop = self.spans[index]
        views = [buffer[start:stop] for buffer in self.buffers]
        if len(views) > 1:
            await self._memory(host_ops.sum_into, views[0], views[1:], self.dtype)
        wire: asyncio.Future[Any] | None = None
        if self.engine is not None:
            wire = self.engine.allreduce(views[0], self.dtype)
        return asyncio.ensure_future(self._finish(wire, views))

    async def _finish(self, wire: asyncio.Future[Any] | None, views: list[np.ndarray]) -> None:
        if wire is not None:
            await wire
        if self.op == "avg" and self.world_size > 1:
            await self._memory(host_ops.scale, views[0], 1.0 / self.world_size, self.dtype)
        if len(views) > 1:
            await self._memory(host_ops.copy_to, views[1:], views[0])

    async def _memory(self, function: Callable[..., None], *args: Any) -> None:
        nbytes = args[0].nbytes if isinstance(args[0], np.ndarray) else args[1].nbytes
        if nbytes <= _INLINE_BYTES:
            function(*args)
            return
        await asyncio.get_running_loop().run_in_executor(self._executor, function, *args)
