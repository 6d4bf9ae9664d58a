"""Batching of ready marks: one notification per completed group instead of one per layer.

Every notification wakes the daemon (~0.1 ms of its CPU on a busy two-core machine), and the
daemon cannot start a group before all of its layers are ready anyway. So the client keeps
its ready marks, each with the time it was made, and sends them when they complete a group
of the plan the daemon announced (or at ``wait()``). The stamps keep the daemon's per-layer
profile exact. The groups are a hint: if the plan changes under us, a group may start a
little later for one iteration, never wrongly.
"""

from __future__ import annotations

import time
from collections.abc import Sequence


class ReadyBatcher:
    """Collects ready marks; ``add`` returns True when the pending ones should be sent."""

    def __init__(self, layer_count: int) -> None:
        self.layer_count = layer_count
        self.plan = 0  # version of the groups in use (0: none known: send every mark)
        # Plain lists: add() runs once per layer per iteration, numpy calls cost more.
        self._group_of: list[int] = []
        self._group_size: list[int] = []
        self._missing: list[int] = []  # per group: layers not yet marked
        self._told: tuple[int, list[list[int]]] = (0, [])  # the last groups we were sent
        self.layers: list[int] = []  # pending marks, oldest first
        self.stamps: list[float] = []

    def _use_groups(self, plan: int, groups: Sequence[Sequence[int]]) -> None:
        """Batch by these groups from the next iteration on (plan 0 or bad groups: don't)."""
        group_of = [-1] * self.layer_count
        for index, group in enumerate(groups):
            for layer in group:
                if not 0 <= layer < self.layer_count or group_of[layer] != -1:
                    plan = 0  # not a partition of our layers: a stale or foreign plan
                    break
                group_of[layer] = index
        if plan == 0 or -1 in group_of:
            self.plan = 0
            return
        self.plan, self._group_of = plan, group_of
        self._group_size = [len(group) for group in groups]
        self._missing = list(self._group_size)

    def announce(self, plan: int, groups: Sequence[Sequence[int]] | None) -> None:
        """The daemon's word on the next iteration: its plan (0: undecided) and, when new to
        us, that plan's groups."""
        if groups is not None:
            self._told = (plan, [list(group) for group in groups])
        if plan != self.plan:
            known_plan, known_groups = self._told
            self._use_groups(plan, known_groups if plan == known_plan else [])

    def add(self, layers: Sequence[int]) -> bool:
        now = time.monotonic()
        self.layers.extend(layers)
        self.stamps.extend([now] * len(layers))
        if self.plan == 0:
            return True
        complete = False
        for layer in layers:
            group = self._group_of[layer]
            self._missing[group] -= 1
            complete = complete or self._missing[group] == 0
        return complete

    def take(self) -> tuple[list[int], list[float]]:
        """The pending marks, which are then forgotten."""
        layers, stamps = self.layers, self.stamps
        self.layers, self.stamps = [], []
        return layers, stamps

    def next_iteration(self) -> None:
        if self.plan:
            self._missing = list(self._group_size)
