"""A PowerSGD job's state on this node and what a low-rank group does to the node's sum.

The state is per layer, not per group, so a re-plan keeps it: the error E (one float per
element, the node's part of what the low-rank sums missed) and each compressed layer's Q
(warm start). The arithmetic is ``commd.compression.lowrank``'s; this owns the order of a
group's steps around its two all-reduces (the uncompressed values and every P in the first,
every Q in the second) and where each step runs: the products on a worker thread, the
collectives issued from the loop in plan order (``turn``), so every node issues the same
collectives in the same order.

Before the spec's ``start`` iteration a group is all-reduced dense and E stays zero, as
torch's hook does before ``start_powerSGD_iter``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Any, TypeVar

import numpy as np

from commd.compression.lowrank import GroupForm, form_group, initial_q, orthogonalize
from commd.compression.spec import LowRankSpec
from commd.compression.steps import allreduce_in_turn, off_loop
from commd.engines import Engine
from commd.job.measurements import CommSample, IterationGains, WireClock
from commd.job.schedule import Plan
from commd_protocol.layout import backward_offsets
from commd_protocol.peer import ALLREDUCE

T = TypeVar("T")
# Every this many iterations a group also measures its gain (two more passes over its
# matrices): the coordinator reads one mean per report round of 10.
GAIN_EVERY = 5


class NodeLowRank:
    """PowerSGD groups of one job on this node."""

    def __init__(self, spec: LowRankSpec, like: np.ndarray, sizes: Sequence[int],
                 rows: Sequence[int], engine: Engine | None, executor: Executor,
                 clock: WireClock, share: float) -> None:
        """``like``: the node's flat buffer; ``share``: this node's ranks / the job's ranks
        (the part of the sum that stands for this node's own input, for E)."""
        self.spec = spec
        self.engine = engine
        self._executor = executor
        self._clock = clock
        self._share = share
        self._sizes = list(sizes)
        self._rows = list(rows)
        self._offsets = backward_offsets(self._sizes)
        self._dtype = like.dtype
        self.error = np.zeros_like(like) if spec.feedback else None
        self._flat_size = like.size
        self._spare = np.empty(0, dtype=like.dtype)  # share · result, before E takes it
        self._qs: dict[int, np.ndarray] = {}  # layer -> Q (cols × rank), warm start
        self._forms: dict[tuple[int, ...], GroupForm] = {}  # by the group's layers
        self.gains: list[float] = []  # per low-rank group of this iteration
        self.pending = False  # E holds something a dense group has to send
        # the last iteration's dense groups sent E (its ``done`` reply is then not "dense")
        self.carried = False
        self._carrying = False

    @property
    def dense_work(self) -> bool:
        """Whether a dense group must first take E along: after low-rank iterations (an
        ``auto`` job that went back to dense); before ``start`` E is zero."""
        return self.pending

    def flush(self, total: np.ndarray, start: int, stop: int) -> None:
        """A dense group sends what the low-rank sums missed of this node's input: E is
        added to the node's sum and cleared."""
        if self.error is None:
            return
        error = self.error[start:stop]
        total += error
        error[:] = 0
        self._carrying = True

    def form(self, plan: Plan, index: int) -> GroupForm:
        layers = tuple(plan.groups[index])
        form = self._forms.get(layers)
        if form is None:
            form = self._forms[layers] = form_group(layers, self._sizes, self._rows,
                                                    self._offsets, plan.spans[index][0],
                                                    self.spec)
        return form

    async def run(self, plan: Plan, index: int, iteration: int, total: np.ndarray,
                  turn: asyncio.Future[None], issued: asyncio.Future[None]
                  ) -> tuple[float, CommSample]:
        """Group ``index``'s node sum ``total`` exchanged and written back into it (the sum
        over every node); returns the share of M's energy the approximation kept, and the
        sample of its first collective."""
        key = (iteration, index)
        form = self.form(plan, index)
        if iteration < self.spec.start or not form.matrices:
            seconds = await self._allreduce(total, turn, issued, last=True)
            return 1.0, CommSample(key, total.nbytes, seconds, ALLREDUCE)
        start = plan.spans[index][0]
        error = None if self.error is None else self.error[start:start + total.size]
        qs, warm = zip(*(self._q(matrix.layer, iteration, matrix.cols, matrix.rank)
                         for matrix in form.matrices), strict=True)
        first = np.empty(form.first_elements, dtype=total.dtype)
        second = np.empty(form.second_elements, dtype=total.dtype)
        # M = S + E lives in E's slice (or in the sum itself without feedback)
        m = await self._work(_first_products, total, error, form, qs, warm, first,
                             self.spec.epsilon)
        seconds = await self._allreduce(first, turn, issued, last=False)
        await self._work(_second_products, m, total, form, first, second, self.spec.epsilon)
        await self._allreduce(second, None, issued, last=True)
        measure = iteration % GAIN_EVERY == 0
        scratch = (self._scratch(start, total.size)
                   if error is not None and self._share != 1.0 else None)
        gain = await self._work(_decompress, total, error, form, first, second, self._share,
                                scratch, measure)
        for matrix, q in zip(form.matrices, qs, strict=True):
            # the next iteration starts from this Q (warm start; its scale does not matter:
            # it is orthogonalised before use)
            q[...] = second[matrix.q_at:matrix.q_at + matrix.cols * matrix.rank].reshape(
                matrix.cols, matrix.rank)
        if measure:
            self.gains.append(gain)
        self.pending = self.error is not None
        return gain, CommSample(key, first.nbytes, seconds, ALLREDUCE)

    def _scratch(self, start: int, size: int) -> np.ndarray:
        """Working space for the group whose span starts at element ``start``: its own part
        of one buffer as large as the job's (groups' spans never overlap, and two groups'
        last steps may run at once on the worker threads)."""
        if self._spare.size < self._flat_size:
            self._spare = np.empty(self._flat_size, dtype=self._dtype)
        return self._spare[start:start + size]

    def _q(self, layer: int, iteration: int, cols: int, rank: int) -> tuple[np.ndarray, bool]:
        """The layer's Q for this iteration, and whether it is the last one (warm), which
        ``_first_products`` orthogonalises off the loop; else a fresh, orthonormal one."""
        q = self._qs.get(layer)
        if q is None or not self.spec.warm or q.shape != (cols, rank):
            q = initial_q(self.spec.seed, layer, 0 if self.spec.warm else iteration, cols,
                          rank, self.spec.epsilon).astype(self._dtype, copy=False)
            self._qs[layer] = q
            return q, False
        return q, True

    async def _allreduce(self, buffer: np.ndarray, turn: asyncio.Future[None] | None,
                         issued: asyncio.Future[None], last: bool) -> float:
        return await allreduce_in_turn(self.engine, buffer, str(buffer.dtype), turn, issued,
                                       self._clock, last)

    async def _work(self, function: Callable[..., T], buffer: np.ndarray, *args: Any) -> T:
        return await off_loop(self._executor, function, buffer, *args)

    def end_iteration(self, exchanges: Sequence[str]) -> IterationGains:
        gains = IterationGains(float(np.mean(self.gains)) if self.gains else 1.0)
        self.gains = []
        self.carried, self._carrying = self._carrying, False
        if all(exchange == "dense" for exchange in exchanges):
            self.pending = False  # every group of a dense iteration sent its part of E
        return gains


def _first_products(total: np.ndarray, error: np.ndarray | None, form: GroupForm,
                     qs: Sequence[np.ndarray], warm: Sequence[bool], first: np.ndarray,
                     epsilon: float) -> np.ndarray:
    """Every warm Q orthogonalised (as torch's hook does before reusing it); M = S + E; the
    uncompressed values and every P = M Q into ``first``; returns M."""
    for q, reused in zip(qs, warm, strict=True):
        if reused:
            orthogonalize(q, epsilon)
    if error is not None:
        error += total
        m = error
    else:
        m = total
    at = 0
    for start, size in form.vectors:
        first[at:at + size] = m[start:start + size]
        at += size
    for matrix, q in zip(form.matrices, qs, strict=True):
        p = first[matrix.p_at:matrix.p_at + matrix.rows * matrix.rank]
        np.matmul(_matrix(m, matrix.start, matrix.rows, matrix.cols), q,
                  out=p.reshape(matrix.rows, matrix.rank))
    return m


def _second_products(m: np.ndarray, total: np.ndarray, form: GroupForm, first: np.ndarray,
                     second: np.ndarray, epsilon: float) -> None:
    """The uncompressed sums into ``total``; every P (summed) orthogonalised; Q = Mᵀ P into
    ``second``."""
    at = 0
    for start, size in form.vectors:
        total[start:start + size] = first[at:at + size]
        at += size
    for matrix in form.matrices:
        p = first[matrix.p_at:matrix.p_at + matrix.rows * matrix.rank].reshape(
            matrix.rows, matrix.rank)
        orthogonalize(p, epsilon)
        q = second[matrix.q_at:matrix.q_at + matrix.cols * matrix.rank]
        np.matmul(_matrix(m, matrix.start, matrix.rows, matrix.cols).T, p,
                  out=q.reshape(matrix.cols, matrix.rank))


def _decompress(total: np.ndarray, error: np.ndarray | None, form: GroupForm,
                first: np.ndarray, second: np.ndarray, share: float,
                scratch: np.ndarray | None, measure: bool) -> float:
    """Every matrix's sum P Qᵀ into ``total``; E = M − share · sum (uncompressed layers
    included, as torch's error is; ``scratch`` holds share · sum where share is not 1).
    Returns, where ``measure``, the gain 1 − ‖E‖² / ‖M‖² over the matrices (how much of this
    node's input the approximation carried), else 1; 1 without error feedback."""
    measure = measure and error is not None
    energy = 0.0
    for matrix in form.matrices:
        p = first[matrix.p_at:matrix.p_at + matrix.rows * matrix.rank].reshape(
            matrix.rows, matrix.rank)
        q = second[matrix.q_at:matrix.q_at + matrix.cols * matrix.rank].reshape(
            matrix.cols, matrix.rank)
        if measure:
            assert error is not None
            cut = error[matrix.start:matrix.start + matrix.size]
            energy += float(np.vdot(cut, cut))
        np.matmul(p, q.T, out=_matrix(total, matrix.start, matrix.rows, matrix.cols))
    if error is None:
        return 1.0
    if scratch is None:
        error -= total  # E = M − result
    else:
        np.multiply(total, share, out=scratch)
        error -= scratch
    if not measure:
        return 1.0
    missed = sum(float(np.vdot(cut, cut)) for cut in
                 (error[matrix.start:matrix.start + matrix.size] for matrix in form.matrices))
    return 1.0 if energy <= 0 else max(0.0, 1.0 - missed / energy)


def _matrix(flat: np.ndarray, start: int, rows: int, cols: int) -> np.ndarray:
    return flat[start:start + rows * cols].reshape(rows, cols)
