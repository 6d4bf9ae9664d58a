"""Merge planning: which adjacent layers to all-reduce together, and when.

Pure functions only (no I/O, globals, logging or ranks), shared by the daemon and
``commd simulate``. A planner maps ``(sizes_bytes, backward_s, cost)`` (layers in forward
order) to groups of layer indices in communication order, highest layers first.
"""

from commd.plan.cost import (
    MGWFBP_SIM,
    NETWORK_PRESETS,
    LinearCost,
    NetworkPreset,
    mgwfbp_sim_cost,
    network_cost,
    ring_allreduce_cost,
)
from commd.plan.mgwfbp import mgwfbp
from commd.plan.optimal import optimal
from commd.plan.registry import PLANNER_NAMES, get_planner, plan_with
from commd.plan.simple import (
    DDP_BUCKET_CAP_BYTES,
    DDP_FIRST_BUCKET_BYTES,
    HOROVOD_FUSION_THRESHOLD_BYTES,
    ddp,
    fixed,
    horovod,
    syncea,
    wfbp,
)
from commd.plan.timeline import (
    Groups,
    Planner,
    PlanTiming,
    check_layers,
    evaluate,
    ready_times,
    validate_plan,
)
from commd.plan.units import parse_bandwidth, parse_duration, parse_nodes, parse_size

__all__ = [
    "DDP_BUCKET_CAP_BYTES",
    "DDP_FIRST_BUCKET_BYTES",
    "HOROVOD_FUSION_THRESHOLD_BYTES",
    "MGWFBP_SIM",
    "NETWORK_PRESETS",
    "PLANNER_NAMES",
    "Groups",
    "LinearCost",
    "NetworkPreset",
    "PlanTiming",
    "Planner",
    "check_layers",
    "ddp",
    "evaluate",
    "fixed",
    "get_planner",
    "horovod",
    "mgwfbp",
    "mgwfbp_sim_cost",
    "network_cost",
    "optimal",
    "parse_bandwidth",
    "parse_duration",
    "parse_nodes",
    "parse_size",
    "plan_with",
    "ready_times",
    "ring_allreduce_cost",
    "syncea",
    "validate_plan",
    "wfbp",
]
