"""The two ways to exchange top-k compressed groups between nodes, with error feedback.

Both run at node level on E = S + R, where S is the node's sum of its local ranks and R its
residual (zero at the start), and leave R = E with the sent positions zeroed:

* ``allreduce`` (AR-compatible top-k, STAR): the iteration's leader broadcasts its top-k
  indices of |E|; every node all-reduces its E at those indices; the sums are scattered
  into a zero buffer. k values and k indices move, and the result is one dense sum.
* ``allgather``: every node sends its own top-k values and int32 indices; every node adds
  all received pairs into a zero buffer.

The arithmetic runs on a worker thread (the event loop never blocks); the collectives are
issued from the loop in the same order on every node.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Executor
from dataclasses import dataclass

import numpy as np

from commd.compression.topk import accumulate_pairs, select_topk
from commd.engines import Engine


@dataclass
class GroupExchange:
    """One compressed group of one iteration on this node."""

    engine: Engine | None  # None: a single-node job, nothing to exchange
    executor: Executor
    node_index: int
    nodes: int
    dtype: str

    async def _run(self, function, *args):  # type: ignore[no-untyped-def]
        return await asyncio.get_running_loop().run_in_executor(self.executor, function, *args)

    async def allreduce(self, target: np.ndarray, residual: np.ndarray, k: int,
                        leader: int) -> tuple[float, float]:
        """STAR top-k; returns the compression gain ‖E at the sent indices‖² / ‖E‖² and the
        seconds its all-reduce of k values took."""
        await self._run(np.add, residual, target, residual)  # residual now holds E
        indices = np.zeros(k, dtype=np.int32)
        if self.node_index == leader:
            indices[:] = await self._run(select_topk, residual, k)
        if self.engine is not None:
            await self.engine.broadcast(indices, leader, "int32")
        values, gain = await self._run(_take, residual, indices)
        began = time.perf_counter()
        if self.engine is not None:
            await self.engine.allreduce(values, self.dtype)
        wire = time.perf_counter() - began
        await self._run(_scatter, target, indices, values)
        return gain, wire

    async def allgather(self, target: np.ndarray, residual: np.ndarray,
                        k: int) -> tuple[float, float]:
        """Every node's own top-k pairs, summed; returns this node's compression gain and the
        seconds its two allgathers took."""
        await self._run(np.add, residual, target, residual)
        indices = await self._run(select_topk, residual, k)
        values, gain = await self._run(_take, residual, indices)
        began = time.perf_counter()
        if self.engine is None:
            all_values, all_indices = values, indices
        else:
            all_values = np.empty(k * self.nodes, dtype=values.dtype)
            all_indices = np.empty(k * self.nodes, dtype=np.int32)
            await self.engine.allgather(all_values, values, self.dtype)
            await self.engine.allgather(all_indices, indices, "int32")
        wire = time.perf_counter() - began
        await self._run(accumulate_pairs, target, all_indices, all_values)
        return gain, wire


def _take(error: np.ndarray, indices: np.ndarray) -> tuple[np.ndarray, float]:
    """The values to send, the gain, and the residual update R = E with them zeroed."""
    values = error[indices]
    total = float(np.dot(error, error))
    gain = 1.0 if total == 0 else float(np.dot(values, values)) / total
    error[indices] = 0
    return values, gain


def _scatter(target: np.ndarray, indices: np.ndarray, values: np.ndarray) -> None:
    target[...] = 0
    target[indices] = values
