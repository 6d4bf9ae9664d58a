"""A measured check on the cost model: search the per-group overhead it does not see.

The planner's a + b·M comes from timing the collectives alone. Each group also costs work
that no collective timing shows: the daemon's wake-ups and completion callbacks, the scaling
pass, and, where the cores are shared, CPU taken from the backward pass it overlaps. Where
that is large (many small layers on a few busy cores) the optimum of the model is not the
fastest plan in practice.

So the coordinator measures. Each report round gives the job's median step time under the
plan it ran. Starting from the model's plan (overhead 0), the per-group overhead added to a
grows geometrically (a, 4a, 16a, …: fewer, larger groups) until the plan is one group. The
search does not stop at the first slower plan: step times need not fall steadily as groups
merge (97 groups and 40 may both be slower than 1), and one round is noisy on a shared
machine; at most ~7 trials of one round each, once per job. Then it keeps the trial with the
fewest groups among those within ``TIE`` of the fastest, and stops: that trial's groups run
from then on as measured (``Trial.plan``), not the model's plan for its overhead, which moves
with the profile. A plan the model would not change is skipped without a round. While the
model's own plan is one group there is nothing to search; the search starts when it first
proposes more. A search may start from a given overhead (a plan measured before, see
``CompressedChoice.search``) and goes up from there. Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

TIE = 0.03  # within 3 % of the fastest counts as no slower: fewer groups win the tie
GROWTH = 4.0  # each trial's overhead over the previous one
FIRST_OVERHEAD_S = 200e-6  # the first trial's overhead when a is smaller
MAX_OVERHEAD_S = 1.0  # beyond this every plan is one group anyway

Groups = Sequence[Sequence[int]]


def _key(groups: Groups) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(sorted(group)) for group in groups)


def _plan(groups: Groups) -> tuple[tuple[int, ...], ...]:
    """The groups as run, in their order (immutable: a trial outlives the plan in force)."""
    return tuple(tuple(group) for group in groups)


@dataclass(frozen=True)
class Trial:
    """One plan the search measured: the per-group overhead it was made with, its number of
    groups, the step it measured and the groups it ran."""

    overhead_s: float
    groups: int
    step_s: float
    # the groups the round ran: what is kept is the plan measured, not the overhead alone
    # (the model's plan for one overhead moves with the profile, so the same overhead may
    # later give other groups, which were never measured)
    plan: tuple[tuple[int, ...], ...] = ()


@dataclass
class PlanSearch:
    """One search (the module's docstring): the overhead plans are made with now, the trials so
    far and whether it is done; ``enabled=False`` where there is nothing to search."""

    enabled: bool = True
    overhead_s: float = 0.0  # the per-group overhead plans are made with now
    done: bool = False
    trials: list[Trial] = field(default_factory=list)

    @property
    def best(self) -> Trial | None:
        """The trial kept: the one with fewest groups within TIE of the fastest."""
        if not self.trials:
            return None
        fastest = min(t.step_s for t in self.trials)
        near = [t for t in self.trials if t.step_s <= fastest * (1 + TIE)]
        return min(near, key=lambda t: (t.groups, t.step_s))

    @property
    def trying(self) -> bool:
        """Whether plans are being tried: the rounds run plans other than the model's (not
        while waiting for the model to propose more than one group, which can be forever)."""
        return self.enabled and not self.done and self.overhead_s > 0

    @property
    def state(self) -> str:
        if not self.enabled:
            return "off"
        return "done" if self.done else "measuring"

    def observe(self, groups: Groups, step_s: float, alpha_s: float,
                plan_for: Callable[[float], Groups]) -> str:
        """One round measured ``step_s`` per iteration with ``groups``, planned with the current
        overhead. Returns why the overhead changed ("" if it did not); ``plan_for(overhead)``
        is the plan the model would make with that overhead."""
        if not self.enabled or self.done or step_s <= 0:
            return ""
        if len(groups) <= 1:
            # One group is what any overhead from MAX_OVERHEAD_S on gives, whatever a and b
            # are fitted later. Until the model proposes more groups there is nothing to
            # search: keep the newest one-group measurement and wait.
            self.trials = [t for t in self.trials if t.groups > 1]
            self.trials.append(Trial(MAX_OVERHEAD_S, 1, step_s, _plan(groups)))
            waiting = len(self.trials) == 1 and self.overhead_s < MAX_OVERHEAD_S
            return "" if waiting else self._finish()  # (started at one group: nothing above)
        self.trials.append(Trial(self.overhead_s, len(groups), step_s, _plan(groups)))
        overhead = self._next_overhead(groups, alpha_s, plan_for)
        if overhead is None:
            return self._finish()
        self.overhead_s = overhead
        return f"plan search: trying per-group overhead {overhead * 1e6:.0f} µs"

    def _next_overhead(self, groups: Groups, alpha_s: float,
                       plan_for: Callable[[float], Groups]) -> float | None:
        """The next overhead whose plan differs from ``groups`` (None: none left)."""
        overhead = self.overhead_s
        while True:
            overhead = max(overhead * GROWTH, alpha_s, FIRST_OVERHEAD_S)
            if overhead >= MAX_OVERHEAD_S:
                return None
            if _key(plan_for(overhead)) != _key(groups):
                return overhead

    def _finish(self) -> str:
        self.done = True
        best = self.best
        assert best is not None
        changed = best.overhead_s != self.overhead_s
        self.overhead_s = best.overhead_s
        if not changed:
            return ""
        return (f"plan search: {best.groups} group(s) measured fastest "
                f"({best.step_s * 1e3:.1f} ms/step): keeping overhead "
                f"{best.overhead_s * 1e6:.0f} µs")


def kept_groups(search: PlanSearch | None, overhead_s: float) -> list[list[int]]:
    """The groups a finished ``search`` kept, as they ran, where the plan is made with its
    kept trial's overhead ``overhead_s``; [] otherwise."""
    best = search.best if search is not None and search.done else None
    if best is None or not best.plan or best.overhead_s != overhead_s:
        return []
    return [list(group) for group in best.plan]
