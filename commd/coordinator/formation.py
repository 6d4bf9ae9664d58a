"""One job as its coordinator holds it: the nodes that joined, its plans' state, its
liveness, and (fault_tolerance="continue") its membership; and the coordinator's deadlines."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from commd.coordinator.compressed_choice import choice_for
from commd.coordinator.membership import Membership, Takeover
from commd.coordinator.replanner import Replanner
from commd.coordinator.watch import JobWatch
from commd_protocol import PeerJoin, PeerPlan, PeerProfile
from commd_protocol.dtypes import itemsize


@dataclass
class Formation:
    """One job as its coordinator holds it: the nodes that joined and their ranks, whether it has
    formed, its ``Replanner`` and the rounds reported so far, the watch over its nodes and,
    under fault_tolerance="continue", its membership and the change under way."""

    job: str
    world_size: int
    joins: dict[bytes, PeerJoin] = field(default_factory=dict)
    generation: int = 0
    formed: bool = False
    replanner: Replanner | None = None
    reports: dict[int, dict[bytes, PeerProfile]] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)  # forming has a deadline
    watch: JobWatch = field(default_factory=JobWatch)  # liveness of its nodes, its stall
    # Kept as joins come, so that a join is checked in its own size (Coordinator._check):
    rank_hosts: dict[int, str] = field(default_factory=dict)  # rank -> its node's engine host
    lowest: PeerJoin | None = None  # the join holding the lowest rank so far
    # fault_tolerance="continue": its epochs (None: a lost node fails the job)
    membership: Membership | None = None
    store_port: int = 0  # where its engines' rendezvous store listens (0: one node)
    joining: set[bytes] = field(default_factory=set)  # nodes joining in the change under way
    # ranks joining in the change under way on nodes already in the job (replacements)
    rejoining: set[int] = field(default_factory=set)
    first_round: dict[bytes, int] = field(default_factory=dict)  # a joiner's first report
    plans: list[PeerPlan] = field(default_factory=list)  # the latest decisions, for joiners
    deciding: set[int] = field(default_factory=set)  # rounds whose plan is being decided
    takeover: Takeover | None = None  # taking over from a lost coordinator, gathering nodes

    @property
    def ranks_joined(self) -> int:
        return len(self.rank_hosts)

    def add(self, node: bytes, join: PeerJoin) -> None:
        self.joins[node] = join
        self.rank_hosts.update(dict.fromkeys(join.ranks, join.host))
        if self.lowest is None or min(join.ranks) < min(self.lowest.ranks):
            self.lowest = join

    def forget(self, join: PeerJoin) -> None:
        for rank in join.ranks:
            self.rank_hosts.pop(rank, None)
        if self.lowest is join:  # rare (a node joining twice): found again among the rest
            self.lowest = min(self.joins.values(), key=lambda j: min(j.ranks), default=None)


@dataclass(frozen=True)
class Deadlines:
    """The coordinator's time limits, from the daemon's settings: to form a job, for a node's
    silence, and for a stall to be named or to fail the job."""

    form_s: float = 300.0  # a job must form within this
    peer_s: float = 10.0  # a node silent this long fails the job
    stall_warn_s: float = 60.0  # a stall this long is named
    stall_s: float = 0.0  # a stall this long fails the job (0: never)


def replanner_for(join: PeerJoin, nodes: int) -> Replanner:
    """The plans' owner of a job whose layers ``join`` gives, among ``nodes`` nodes (a job
    formed here, or taken over here from a lost coordinator): the dense re-planning, composed
    with the choice of what its groups exchange."""
    size = itemsize(join.dtype)
    return Replanner(join.planner, [layer.size * size for layer in join.layers], nodes=nodes,
                     choice=choice_for(join.compression, nodes, size,
                                       [layer.size for layer in join.layers],
                                       [layer.rows for layer in join.layers], join.device))
