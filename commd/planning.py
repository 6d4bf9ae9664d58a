"""The daemon's bridge to the pure planner: bytes and timings in, groups out."""

from __future__ import annotations

from commd_client.dtypes import itemsize
from commd_protocol import PeerJoin

from .planner import LinearCost, get_planner, plan_with

# Before anything is measured: a loopback-class all-reduce (~100 µs start-up, ~1 GB/s), and
# every layer ready at once — the optimum is then one group. Runtime profiling refines both.
DEFAULT_COST = LinearCost(alpha_s=100e-6, beta_s_per_byte=1e-9)


def validate_planner(name: str) -> None:
    """Raise ValueError naming the valid planners when ``name`` is not one."""
    get_planner(name)


def initial_plan(join: PeerJoin) -> list[list[int]]:
    sizes = [layer.size * itemsize(join.dtype) for layer in join.layers]
    return plan_with(join.planner, sizes, [0.0] * len(sizes), DEFAULT_COST)
