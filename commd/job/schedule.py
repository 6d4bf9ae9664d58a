"""Which merge plan each iteration of a job runs with.

Plans come from the coordinator ahead of time, each with the iteration it takes effect at,
so that every node switches at the same iteration boundary. After a report round an iteration
waits until the decision for it has arrived (it may keep the plan it has, or not).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from commd_protocol.layout import backward_offsets, group_span
from commd_protocol.status import PlanChange

HISTORY = 10  # plan changes kept for status


@dataclass(frozen=True)
class Plan:
    """One merge plan as the node runs it: the coordinator's version, groups, exchanges and ratio,
    with each group's span in the flat buffer worked out (``make_plan``)."""

    version: int
    groups: list[list[int]]
    spans: list[tuple[int, int]]  # element range of each group in the flat buffer
    exchanges: list[str]  # per group: "dense", or a top-k exchange ("allgather", "allreduce")
    ratio: float  # top-k ratio of the compressed groups
    cost: tuple[float, float] = (0.0, 0.0)  # a (s), b (s/byte) the plan was made with

    @property
    def dense(self) -> bool:
        """No group of this plan runs top-k."""
        return all(exchange == "dense" for exchange in self.exchanges)


def make_plan(version: int, groups: Sequence[Sequence[int]], sizes: Sequence[int],
              exchanges: Sequence[str] = (), ratio: float = 0.0,
              cost: tuple[float, float] = (0.0, 0.0)) -> Plan:
    offsets = backward_offsets(sizes)
    lists = [sorted(g) for g in groups]
    kinds = list(exchanges) or ["dense"] * len(lists)
    if len(kinds) != len(lists):
        raise ValueError(f"{len(kinds)} exchanges for {len(lists)} groups")
    return Plan(version, lists, [group_span(g, sizes, offsets) for g in lists], kinds, ratio,
                cost)


class PlanSchedule:
    """Plans by the iteration they take effect at; ``plan`` is the one running now."""

    def __init__(self) -> None:
        self.plan: Plan | None = None
        self.history: list[PlanChange] = []
        self._scheduled: dict[int, Plan] = {}  # effective iteration -> plan
        self._required: set[int] = set()  # iterations that must not start without a decision
        self._decided = asyncio.Event()

    def expect_decision(self, iteration: int, now: int) -> None:
        """``iteration`` waits until a decision for it has arrived (``now``: the current one)."""
        if iteration >= now:
            self._required.add(iteration)

    def forget_expected(self) -> None:
        """Decisions awaited from a coordinator that is gone: run on the plan in force."""
        self._required.clear()

    def add(self, effective_iteration: int, plan: Plan, now: int) -> None:
        """A decision: ``plan`` from ``effective_iteration`` on (or from ``now``, if later)."""
        self._scheduled[max(effective_iteration, now)] = plan
        self._decided.set()

    def upcoming(self, iteration: int, now: int) -> Plan | None:
        """The plan ``iteration`` will run with, as far as known now (None: undecided)."""
        if iteration in self._scheduled:
            return self._scheduled[iteration]
        if iteration in self._required or iteration < now:
            return None
        return self.plan

    async def plan_for(self, iteration: int) -> Plan:
        """The plan of ``iteration``, once decided; it becomes the running plan."""
        while iteration in self._required and iteration not in self._scheduled:
            self._decided.clear()
            await self._decided.wait()
        self._required.discard(iteration)
        plan = self._scheduled.pop(iteration, None)
        if plan is not None and (self.plan is None or plan.version != self.plan.version):
            change = PlanChange(iteration=iteration, version=plan.version, groups=len(plan.groups))
            self.history = [*self.history[1 - HISTORY:], change]
            self.plan = plan
        assert self.plan is not None, "the first plan must be scheduled before the first iteration"
        return self.plan
