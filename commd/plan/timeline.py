"""The timeline of one iteration under a merge plan, and the checks every plan must pass.

Layers are indexed in forward order 0..L-1. Backward computes L-1 first and 0 last, so layer
l's gradient is ready at ready(l) = sum(backward_s[l:]) (times from the start of backward).
A plan is a list of groups of adjacent layers in communication (= backward) order; a group's
all-reduce starts when its lowest layer is ready and the previous all-reduce has finished.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from commd.plan.cost import LinearCost

__all__ = [
    "Groups",
    "PlanTiming",
    "Planner",
    "check_layers",
    "evaluate",
    "ready_times",
    "validate_plan",
]

Groups = list[list[int]]
Planner = Callable[[Sequence[int], Sequence[float], LinearCost], Groups]


def check_layers(sizes_bytes: Sequence[int], backward_s: Sequence[float]) -> None:
    """Raise ValueError unless both sequences describe the same layers with sane values."""
    if len(sizes_bytes) != len(backward_s):
        raise ValueError(
            f"sizes_bytes has {len(sizes_bytes)} layers but backward_s has {len(backward_s)}"
        )
    for layer, size in enumerate(sizes_bytes):
        # operator.index accepts int and numpy integers but not floats; bool is an int, so
        # it is refused by name.
        try:
            valid = not isinstance(size, bool) and operator.index(size) >= 0
        except TypeError:
            valid = False
        if not valid:
            raise ValueError(f"sizes_bytes[{layer}] must be an integer >= 0, got {size!r}")
    for layer, seconds in enumerate(backward_s):
        real = isinstance(seconds, numbers.Real) and not isinstance(seconds, bool)
        if not (real and math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"backward_s[{layer}] must be finite and >= 0, got {seconds!r}")


def ready_times(backward_s: Sequence[float]) -> list[float]:
    """ready[l] = time (from the start of backward) at which layer l's gradient exists."""
    ready = [0.0] * len(backward_s)
    elapsed = 0.0
    for layer in range(len(backward_s) - 1, -1, -1):
        elapsed += backward_s[layer]
        ready[layer] = elapsed
    return ready


def validate_plan(groups: Sequence[Sequence[int]], num_layers: int) -> None:
    """Raise ValueError naming the problem unless ``groups`` is a valid plan.

    Valid: every layer 0..num_layers-1 in exactly one group, each group a run of adjacent
    layers, groups in backward order (the first group holds layer num_layers-1).
    """
    owner: dict[int, int] = {}
    for k, group in enumerate(groups):
        if len(group) == 0:
            raise ValueError(f"group {k} is empty")
        for layer in group:
            if isinstance(layer, bool) or not isinstance(layer, int):
                raise ValueError(f"group {k} holds {layer!r}, which is not a layer index")
            if not 0 <= layer < num_layers:
                raise ValueError(
                    f"group {k} holds layer {layer}, but layers are 0..{num_layers - 1}"
                )
            if layer in owner:
                where = "twice" if owner[layer] == k else f"in groups {owner[layer]} and {k}"
                raise ValueError(f"layer {layer} appears {where}")
            owner[layer] = k
    missing = [layer for layer in range(num_layers) if layer not in owner]
    if missing:
        raise ValueError(f"layers {missing[:10]} are in no group")
    next_top = num_layers - 1  # the highest layer the next group must start from
    for k, group in enumerate(groups):
        low, high = min(group), max(group)
        if high - low + 1 != len(group):
            raise ValueError(f"group {k} {sorted(group)} is not a run of adjacent layers")
        if high != next_top:
            raise ValueError(
                f"groups are not in backward order: group {k} holds layers {low}..{high}, "
                f"but the next group must start at layer {next_top}"
            )
        next_top = low - 1


@dataclass(frozen=True)
class PlanTiming:
    """When things happen in one iteration. Times of groups count from the start of backward."""

    iteration_s: float  # forward + max(backward end, last all-reduce end)
    forward_s: float
    backward_end_s: float
    comm_end_s: float  # end of the last all-reduce (0 when there are no layers)
    exposed_comm_s: float  # communication not hidden by backward: iteration - forward - backward
    group_start_s: tuple[float, ...]
    group_end_s: tuple[float, ...]

    @property
    def num_groups(self) -> int:
        return len(self.group_start_s)


def evaluate(
    groups: Sequence[Sequence[int]],
    sizes_bytes: Sequence[int],
    backward_s: Sequence[float],
    cost: LinearCost,
    forward_s: float = 0.0,
) -> PlanTiming:
    """Simulate one iteration of ``groups`` (validated first) under ``cost``."""
    check_layers(sizes_bytes, backward_s)
    real = isinstance(forward_s, numbers.Real) and not isinstance(forward_s, bool)
    if not (real and math.isfinite(forward_s) and forward_s >= 0):
        raise ValueError(f"forward_s must be finite and >= 0, got {forward_s!r}")
    validate_plan(groups, len(sizes_bytes))
    ready = ready_times(backward_s)
    backward_end = ready[0] if ready else 0.0
    starts: list[float] = []
    ends: list[float] = []
    previous_end = 0.0
    for group in groups:
        # Same arithmetic, in the same order, as the planners use: their predicted end times
        # then match this simulation bit for bit.
        start = max(previous_end, ready[min(group)])
        previous_end = start + cost(sum(int(sizes_bytes[layer]) for layer in group))
        starts.append(start)
        ends.append(previous_end)
    comm_end = previous_end
    return PlanTiming(
        iteration_s=forward_s + max(backward_end, comm_end),
        forward_s=forward_s,
        backward_end_s=backward_end,
        comm_end_s=comm_end,
        exposed_comm_s=max(0.0, comm_end - backward_end),
        group_start_s=tuple(starts),
        group_end_s=tuple(ends),
    )
