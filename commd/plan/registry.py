"""Planners by name: what the daemon's settings and ``commd simulate --planners`` accept."""

from __future__ import annotations

import functools
from collections.abc import Sequence

from commd.plan.cost import LinearCost
from commd.plan.mgwfbp import mgwfbp
from commd.plan.optimal import optimal
from commd.plan.simple import ddp, fixed, horovod, syncea, wfbp
from commd.plan.timeline import Groups, Planner
from commd.plan.units import parse_size

__all__ = ["PLANNER_NAMES", "get_planner", "plan_with"]

_BY_NAME: dict[str, Planner] = {
    "wfbp": wfbp,
    "syncea": syncea,
    "ddp": ddp,
    "horovod": horovod,
    "mgwfbp": mgwfbp,
    "optimal": optimal,
}
# The plain names; "fixed:SIZE" (e.g. fixed:25MB, fixed:128MiB, fixed:1048576) is accepted too.
PLANNER_NAMES: tuple[str, ...] = tuple(_BY_NAME)
_FIXED_PREFIX = "fixed:"
_FIXED_PREFIXES = (_FIXED_PREFIX, "fixed-")


def get_planner(name: str) -> Planner:
    """The planner called ``name``; ValueError listing the valid names when there is none."""
    key = name.strip().lower()
    if key in _BY_NAME:
        return _BY_NAME[key]
    if key.startswith(_FIXED_PREFIXES):  # "fixed:25MB", or "fixed-25MB" as in reports
        threshold = parse_size(name.strip()[len(_FIXED_PREFIX) :])
        return functools.partial(fixed, threshold_bytes=threshold)
    valid = ", ".join([*PLANNER_NAMES, "fixed:SIZE (e.g. fixed:25MB, fixed:128MiB)"])
    raise ValueError(f"unknown planner {name!r}; valid planners: {valid}")


def plan_with(
    name: str, sizes_bytes: Sequence[int], backward_s: Sequence[float], cost: LinearCost
) -> Groups:
    """Plan with the planner called ``name``: the one call the daemon and simulate share."""
    return get_planner(name)(sizes_bytes, backward_s, cost)
