"""A PowerSGD job's choice of what its groups exchange, as the ``Replanner`` plans it.

Every group runs the low-rank exchange (before the spec's start iteration the nodes run it
dense on their own, as torch's hook does). The groups are the job's planner's, made for the
exchange's own cost: two all-reduces per group (the P matrices with the uncompressed
layers, then the Q matrices), so twice the start-up a, and on the wire only the low-rank
factors' share of the dense bytes, plus the daemon's own work per group and per byte. Like
a dense job's plan, it follows a, b and the backward profile as they drift, and the plan
search tunes its per-group overhead.

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from commd.compression.lowrank import LOW_RANK, layer_wire_elements
from commd.compression.spec import HALF, LowRankSpec
from commd.coordinator.choice import ChoiceStatus, DenseChoice, Planned, RoundPlanner
from commd.plan import LinearCost
from commd_protocol import PeerProfile

COLLECTIVES_PER_GROUP = 2
# What a low-rank group costs the step beyond its two collectives, measured on the 2-core
# development machine (two daemons, text_lm's 3.3 M parameters at 1 Gbit/s): the daemon's
# hops and products compete with the backward pass for the cores, so more groups overlap
# nothing and each adds its own cost. Planned with 1.5 ms a group (the hops alone, no
# compute), the job ran 17 groups at 389 ms a step; with 30 ms, 4 groups at 252 ms (torch's
# PowerSGD: 251). The plan search tunes it from there. Per byte: the products' passes over
# the gradients, 30 ms for 13.3 MB.
GROUP_S = 30e-3
CPU_S_PER_BYTE = 2.5e-9


@dataclass
class LowRankChoice(DenseChoice):
    """A dense job's choice (re-planned as a, b and the backward profile drift, its plan
    searched) whose every group runs the low-rank exchange, planned for its cost."""

    spec: LowRankSpec
    sizes: Sequence[int]  # elements per layer, forward order
    rows: Sequence[int]  # matrix rows per layer (0: a vector)

    _network_cost: LinearCost | None = None  # a, b from the start-up probe

    @property
    def wire_share(self) -> float:
        """Elements on the wire per iteration over the dense elements."""
        dense = sum(self.sizes)
        if dense <= 0:
            return 1.0
        rows = list(self.rows) + [0] * (len(self.sizes) - len(self.rows))
        wired = sum(layer_wire_elements(size, r, self.spec)
                    for size, r in zip(self.sizes, rows, strict=True))
        return min(1.0, wired / dense)

    def network(self, fitted: LinearCost | None, reports: Sequence[PeerProfile],
                version: int) -> LinearCost | None:
        """The network's a, b from the start-up probe: a low-rank group's collectives are
        timed between CPU work on nodes that reach them at different moments, so their
        seconds hold the other node's products as much as the wire (fitted from them, b
        fell to 0 and the plan to a single group)."""
        if fitted is not None and (reports[0].round == 0 or self._network_cost is None):
            self._network_cost = fitted
        return self._network_cost

    def plan(self, measured: LinearCost, overhead_s: float, planner: RoundPlanner) -> Planned:
        """The planner's groups for the low-rank exchange's cost line."""
        line = LinearCost(COLLECTIVES_PER_GROUP * measured.alpha_s + GROUP_S,
                          measured.beta_s_per_byte * self.wire_share + CPU_S_PER_BYTE)
        groups = planner.plan(LinearCost(line.alpha_s + overhead_s, line.beta_s_per_byte))
        return Planned(groups, [LOW_RANK] * len(groups), line)

    def status(self) -> ChoiceStatus:
        return ChoiceStatus("forced")


class HalfChoice(DenseChoice):
    """``fp16``: a dense job's choice whose every group runs in float16 on the wire: half
    the bytes a group, the same start-up."""

    def plan(self, measured: LinearCost, overhead_s: float, planner: RoundPlanner) -> Planned:
        line = LinearCost(measured.alpha_s, measured.beta_s_per_byte / 2)
        groups = planner.plan(LinearCost(line.alpha_s + overhead_s, line.beta_s_per_byte))
        return Planned(groups, [HALF] * len(groups), line)

    def status(self) -> ChoiceStatus:
        return ChoiceStatus("forced")
