"""What the ``Replanner`` asks of the owner of what a job's groups exchange.

The ``Replanner`` owns the dense re-planning: a and b fitted from the rounds' collectives,
the backward profile, the groups planned with the pure ``commd.plan`` code, the measured plan
search, the plan's version. What the groups exchange is a ``PlanChoice``'s: a dense job's is
``DenseChoice`` (every group all-reduced, nothing to choose), a compressed job's
``CompressedChoice`` (the top-k ratio, the candidate exchanges and their trials). The
``Replanner`` reaches it only through this interface, once per round in this order:
``network``, ``observe``, ``search``, ``searched`` (when a search ends), ``overhead_s`` and
``plan``, ``applied`` (when the plan changed), ``status``.

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from commd.coordinator.plan_search import PlanSearch
from commd.plan import LinearCost, evaluate, plan_with
from commd_protocol import PeerProfile


@dataclass(frozen=True)
class RoundPlanner:
    """The job's planner over one round's backward profile (the pure ``commd.plan`` code):
    what a choice plans and predicts its candidates with."""

    planner: str
    sizes_bytes: Sequence[int]
    backward_s: Sequence[float]

    def plan(self, cost: LinearCost) -> list[list[int]]:
        """The planner's groups for per-group cost ``cost``."""
        return plan_with(self.planner, self.sizes_bytes, self.backward_s, cost)

    def seconds(self, groups: Sequence[Sequence[int]], cost: LinearCost) -> float:
        """The model's seconds per iteration of ``groups`` under ``cost``."""
        return evaluate(groups, self.sizes_bytes, self.backward_s, cost).iteration_s


class Planned(NamedTuple):
    """A plan made: groups, per-group exchanges ([]: all dense), the cost line it was made
    with (the measured a plus the plan search's per-group overhead, for a dense plan) and
    the top-k ratio (0: dense)."""

    groups: list[list[int]]
    exchanges: list[str]
    line: LinearCost
    ratio: float = 0.0


@dataclass(frozen=True)
class ChoiceStatus:
    """What a round's decision says of the choice: how the exchange was chosen (forced,
    exploring, measuring, measured; "" for a dense job), (candidate, predicted s, measured s
    or -1) per candidate, and a decision that changed no plan, for the log."""

    selection: str = ""
    candidates: list[tuple[str, float, float]] = field(default_factory=list)
    note: str = ""
    why: str = ""  # what runs and why, with the numbers, kept for status every round


def dense_plan(planner: RoundPlanner, measured: LinearCost, overhead_s: float,
               ratio: float = 0.0) -> Planned:
    """Every group all-reduced, planned with the plan search's overhead on a."""
    line = LinearCost(measured.alpha_s + overhead_s, measured.beta_s_per_byte)
    return Planned(planner.plan(line), [], line, ratio)


class PlanChoice(Protocol):
    """The one interface between the ``Replanner`` and what the groups exchange."""

    @property
    def replans_on_drift(self) -> bool:
        """Whether a drift of a, b or the backward profile re-plans a plan in force."""
        ...

    def resize(self, nodes: int) -> None:
        """A tolerant job's new membership."""

    def network(self, fitted: LinearCost | None, reports: Sequence[PeerProfile],
                version: int) -> LinearCost | None:
        """The network's a, b for this round, from ``fitted`` (this round's collectives)."""
        ...

    def observe(self, reports: Sequence[PeerProfile], measurable: bool,
                groups: list[list[int]], cost: LinearCost, planner: RoundPlanner) -> str:
        """A round's reports (``measurable``: every node ran the plan in force, not a plan
        search's trial); ``groups``: the plan in force. Returns why the plan changes ("")."""
        ...

    def search(self, current: PlanSearch) -> PlanSearch:
        """The plan search this round feeds (a job whose planner searches, on two nodes or
        more)."""
        ...

    def searched(self, step_s: float) -> str:
        """The plan search ended on a plan measuring ``step_s``; why that re-plans ("")."""
        ...

    def overhead_s(self, search: PlanSearch, running: bool) -> float:
        """The per-group overhead the plan being made (``running``: the plan in force) is
        planned with."""
        ...

    def plan(self, measured: LinearCost, overhead_s: float, planner: RoundPlanner) -> Planned:
        """The plan of what the next plan runs, with ``overhead_s`` on a."""
        ...

    def applied(self, overhead_s: float) -> None:
        """The plan made with ``overhead_s`` is now in force."""

    def status(self) -> ChoiceStatus:
        """For the round's decision (its note is said once)."""
        ...


class DenseChoice:
    """A dense job's: every group all-reduced, planned as the model and the search say."""

    replans_on_drift = True

    def resize(self, nodes: int) -> None:
        pass

    def network(self, fitted: LinearCost | None, reports: Sequence[PeerProfile],
                version: int) -> LinearCost | None:
        return fitted

    def observe(self, reports: Sequence[PeerProfile], measurable: bool,
                groups: list[list[int]], cost: LinearCost, planner: RoundPlanner) -> str:
        return ""

    def search(self, current: PlanSearch) -> PlanSearch:
        return current

    def searched(self, step_s: float) -> str:
        return ""

    def overhead_s(self, search: PlanSearch, running: bool) -> float:
        return search.overhead_s

    def plan(self, measured: LinearCost, overhead_s: float, planner: RoundPlanner) -> Planned:
        return dense_plan(planner, measured, overhead_s)

    def applied(self, overhead_s: float) -> None:
        pass

    def status(self) -> ChoiceStatus:
        return ChoiceStatus()
