"""Membership epochs of a ``fault_tolerance="continue"`` job: who is in, what changed, and
where the survivors go on after a loss.

A change runs in two steps. ``PeerReform`` stops every survivor's data plane; each answers
with where its iteration stands (``PeerReformState``). Then ``PeerResume`` gives each its new
place and the iteration all run next. The rule that keeps replicas identical: an iteration's
results reach a node's ranks only after a job-wide commit (a one-element all-reduce every node
enters once every group of the iteration is whole on it). So if any survivor delivered
iteration ``D - 1``, every survivor holds its whole results (they all entered the commit),
and those that had not delivered it deliver them now; iteration ``D``, which nobody
delivered, runs again among the survivors from the ranks' untouched gradients.

Pure bookkeeping: the coordinator sends what this decides.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from commd_protocol import PeerJoin, PeerPlan, PeerReformState, PeerTakeover, RosterEntry

# A surviving daemon answers a reform from its event loop within milliseconds; one that has
# not answered in this long is taken as lost too (a killed daemon never answers, and its
# heartbeat silence would take the whole --peer-timeout-s).
REFORM_ANSWER_S = 2.0
# Reforms in a row that end without any node delivering an iteration in between: a fault
# that every new epoch meets again (a link that stays cut between two live nodes) fails the
# job instead of reforming forever.
MAX_FRUITLESS_REFORMS = 4
MAX_HISTORY = 64  # changes kept for status
# A node taking over a job waits this long for the roster's other nodes: they notice the old
# coordinator's silence within a heartbeat of each other; one that has not asked by then is
# taken as lost with it.
TAKEOVER_WAIT_S = 4.0


@dataclass
class Reform:
    """One change in progress: the epoch it leads to and the survivors' answers."""

    epoch: int
    change: str
    started: float
    states: dict[bytes, PeerReformState] = field(default_factory=dict)
    crash: bool = False  # a peer closed its connections: a node that does not answer is dead


@dataclass
class Takeover:
    """This daemon coordinates a job whose coordinator was lost, from its nodes' word."""

    lost: str  # the lost coordinator's peer address
    expected: set[str]  # the roster's other nodes' peer addresses
    started: float
    roster_nodes: int = 0  # the epoch's nodes, the lost coordinator's included if in it
    crash: bool = True  # every node that asked saw a peer close its connections
    states: dict[bytes, PeerReformState] = field(default_factory=dict)
    peers: dict[bytes, str] = field(default_factory=dict)  # node -> its peer address
    plan: int = 0  # the highest plan version in force on a node
    plans: list[PeerPlan] = field(default_factory=list)  # the latest decisions a node holds
    dead: set[str] = field(default_factory=set)  # roster nodes an asking node knows died

    def add(self, node: bytes, message: PeerTakeover) -> None:
        self.states[node] = PeerReformState(job=message.job, epoch=message.epoch,
                                            delivered=message.delivered,
                                            committing=message.committing)
        self.peers[node] = message.join.peer
        self.plan = max(self.plan, message.plan)
        self.crash = self.crash and message.crash
        self.dead |= set(message.dead) - {message.join.peer}  # an asking node is no dead one
        latest = max((plan.version for plan in message.plans), default=0)
        if latest > max((plan.version for plan in self.plans), default=0):
            self.plans = sorted(message.plans, key=lambda plan: plan.effective_iteration)

    @property
    def decisive(self) -> bool:
        """Whether those who asked may go on: a strict majority of the epoch's nodes, or every
        other node of it not known dead, all having seen a crash (a process that died, not a
        split: a killed daemon's links close, a cut-off one's go silent)."""
        asked = len(self.peers)
        return 2 * asked > self.roster_nodes or (
            self.crash and self.expected - self.dead <= set(self.peers.values()))

    def complete(self, now: float) -> bool:
        """Every live node of the roster asked (those known dead are not waited for), or the
        wait is over."""
        return (self.expected - self.dead <= set(self.peers.values())
                or now - self.started > TAKEOVER_WAIT_S)


def expected_peers(roster: list[RosterEntry], lost: str) -> set[str]:
    return {entry.peer for entry in roster if entry.peer and entry.peer != lost}


@dataclass
class Membership:
    """A tolerant job's epochs, on its coordinator."""

    min_world_size: int
    epoch: int = 0
    reform: Reform | None = None
    history: list[str] = field(default_factory=list)  # "epoch N: change", oldest first
    fruitless: int = 0  # reforms since an iteration was last delivered
    delivered: int = 0  # the highest iteration count any node reported

    def begin(self, change: str, now: float) -> Reform:
        """A new epoch starts; any change still in progress is folded into it."""
        crash = False
        if self.reform is not None:
            change, crash = f"{self.reform.change}; {change}", self.reform.crash
        self.epoch += 1
        self.fruitless += 1
        self.reform = Reform(self.epoch, change, now, crash=crash)
        return self.reform

    def answer(self, node: bytes, state: PeerReformState) -> bool:
        """Record a survivor's answer; whether it belongs to the change in progress."""
        reform = self.reform
        if reform is None or state.epoch != reform.epoch:
            return False
        reform.states[node] = state
        return True

    def unanswered(self, joins: Iterable[bytes], now: float) -> list[bytes]:
        """Survivors that have not answered the change in progress within REFORM_ANSWER_S."""
        reform = self.reform
        if reform is None or now - reform.started <= REFORM_ANSWER_S:
            return []
        return [node for node in joins if node not in reform.states]

    def complete(self, joins: Iterable[bytes]) -> bool:
        reform = self.reform
        return reform is not None and all(node in reform.states for node in joins)

    def finish(self) -> tuple[Reform, int | str]:
        """End the change in progress: it, and the iteration every survivor runs next (or
        what makes the answers impossible, which fails the job)."""
        reform = self.reform
        assert reform is not None
        self.reform = None
        self.history = [*self.history, f"epoch {reform.epoch}: {reform.change}"][-MAX_HISTORY:]
        resume = resume_iteration(list(reform.states.values()), self.delivered)
        if isinstance(resume, int):
            if resume > self.delivered:
                self.fruitless = 0
            self.delivered = max(self.delivered, resume)
        return reform, resume

    def left_having_delivered(self, delivered: int) -> None:
        """A node that left had delivered ``delivered`` iterations: the others have every
        iteration before that whole (its commit needed them all), and deliver it."""
        self.delivered = max(self.delivered, delivered)

    @property
    def exhausted(self) -> bool:
        return self.fruitless > MAX_FRUITLESS_REFORMS


def resume_iteration(states: list[PeerReformState], known: int = 0) -> int | str:
    """The iteration every survivor runs next, from their answers; or why there is none.

    ``D``, the most iterations any survivor delivered (or a node that left had, ``known``):
    the others stand at ``D - 1`` with iteration ``D - 1`` whole and only its commit
    outstanding (they deliver it), or at ``D``.
    """
    states = [state for state in states if not state.joining]  # joiners ran nothing yet
    if not states:
        return "no node of the running job answered"
    most = max(known, *(state.delivered for state in states))
    for state in states:
        if state.delivered == most or (state.delivered == most - 1 and state.committing):
            continue
        return (f"a node delivered {state.delivered} iterations (committing: "
                f"{state.committing}) while another delivered {most}")
    return most


def survivors_order(joins: dict[bytes, PeerJoin]) -> list[bytes]:
    """The nodes of the new epoch by their lowest rank: its node 0 holds its lowest rank."""
    return sorted(joins, key=lambda node: min(joins[node].ranks))


def node_name(join: PeerJoin) -> str:
    """A node in words: its daemon's peer address, which tells nodes apart where several
    share a host (its engine's host for an older daemon that gives none)."""
    return join.peer or join.host


def describe_nodes(joins: dict[bytes, PeerJoin], nodes: Iterable[bytes], why: str) -> str:
    """'node HOST (ranks [..]) lost: WHY' for the nodes leaving."""
    parts = [f"node {node_name(joins[node])} (ranks {joins[node].ranks[:20]})"
             for node in nodes if node in joins]
    return f"{', '.join(parts) or 'a node'} lost: {why}"
