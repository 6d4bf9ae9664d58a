"""The coordinator's side of a ``fault_tolerance="continue"`` job's membership: a lost node
or rank starts a change, the survivors' answers finish it (``membership`` decides where they
go on), a fitting join comes in, and a job whose coordinator was lost is taken over here.

``Tolerance`` is the ``Coordinator``'s collaborator for them: it owns these decisions, the
coordinator the sockets, the jobs and the rounds, which it lends through ``CoordinatorSide``.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

import msgspec

from commd.coordinator.formation import Formation, replanner_for
from commd.coordinator.membership import (
    Membership,
    Takeover,
    describe_nodes,
    expected_peers,
    node_name,
    survivors_order,
)
from commd.coordinator.validation import JoinLimits, join_problem
from commd_protocol import (
    ErrorCode,
    PeerAbort,
    PeerFault,
    PeerJoin,
    PeerPlan,
    PeerRedirect,
    PeerReform,
    PeerReformState,
    PeerResume,
    PeerSuccession,
    PeerTakeover,
    RosterEntry,
)
from commd_protocol.agreement import describe_difference
from commd_protocol.checks import address_problem, job_id_problem, roster_problem
from commd_protocol.limits import count_problem
from commd_protocol.peer import DECISION_LAG, REPORT_EVERY

log = logging.getLogger("commd.coordinator")

MAX_PLANS_HANDED_OVER = 3  # a node keeps its latest three decisions (``Job.plans_kept``)
MAX_REDIRECTS = 256  # jobs taken over elsewhere from this address that joins are sent on to


class CoordinatorSide(Protocol):
    """What a membership change asks of the coordinator (``Coordinator``)."""

    def abort_all(self, formation: Formation, code: str, message: str) -> None:
        """Fail the job on every node of it, with ``message``."""
        ...

    def refuse(self, node: bytes, job: str, reason: str,
               code: ErrorCode = ErrorCode.INVALID) -> None:
        """Refuse ``node``'s request for ``job`` alone."""
        ...

    def decide_if_whole(self, formation: Formation, round_number: int) -> None:
        """Decide ``round_number``'s plan if every node of the job has reported it."""
        ...

    def forming_limit(self, node: bytes) -> str:
        """'' while ``node`` may start one more job here, else why not."""
        ...


class Tolerance:
    """What a coordinator does for its tolerant jobs: losses, reforms, joins into a running
    job, takeovers."""

    def __init__(self, jobs: dict[str, Formation], limits: JoinLimits,
                 store_port: Callable[[str], int],
                 send: Callable[[bytes, msgspec.Struct], None],
                 coordinator: CoordinatorSide) -> None:
        self._jobs = jobs  # the coordinator's, shared: a takeover adds a job to it
        self._limits = limits
        self._store_port = store_port
        self._send = send
        self._coordinator = coordinator
        # job -> its coordinator now, for jobs taken over elsewhere from the daemon that had
        # this address before this one (``PeerSuccession``), oldest first
        self._redirects: OrderedDict[str, str] = OrderedDict()

    def lose(self, formation: Formation, nodes: list[bytes], why: str, *,
              certain: bool = True) -> None:
        """``nodes`` are gone from a tolerant job: the survivors move to a new epoch, or the
        job fails when fewer than min_world_size ranks remain.

        ``certain``: the loss is known (a process exit its daemon saw, a node's own word, a
        peer that closed its connections). Silence is not: a node cut off by the network
        looks the same from here as a dead one, and it may go on with the nodes on its side
        of the split. So a silent loss leaves the job running only where it keeps a strict
        majority of its nodes, or exactly half of them with the coordinator: a split into two
        halves goes on on the coordinator's side, which is always this one. The other side
        cannot take over with a half (``_take_over`` needs a strict majority), so no job ever
        trains as two, and a two-node job survives its other node falling silent."""
        membership = formation.membership
        assert membership is not None
        change = describe_nodes(formation.joins, nodes, why)
        before = len(formation.joins)
        for node in nodes:
            join = formation.joins.pop(node, None)
            if join is not None:
                formation.forget(join)
                if not certain:  # a silent node that is only cut off hears it when back
                    self._send(node, PeerAbort(
                        job=formation.job, code=ErrorCode.RANK_LOST,
                        message=f"commd: job {formation.job!r}: this node was dropped from "
                                f"the job: {why}", dropped=True))
            formation.watch.nodes.pop(node, None)
            formation.joining.discard(node)
            formation.first_round.pop(node, None)
            for reports in formation.reports.values():
                reports.pop(node, None)
        if not formation.joins:
            del self._jobs[formation.job]
            return
        if self._too_few(formation, change):
            return
        if not certain and 2 * len(formation.joins) < before:
            self._coordinator.abort_all(formation, ErrorCode.RANK_LOST, (
                f"{change}; {len(formation.joins)} of the epoch's {before} nodes remain "
                "reachable, not a majority nor a half: silence cannot tell a crash from a "
                "network split, and the other side may go on"))
            return
        self._reform(formation, change)
        for round_number in sorted(formation.reports):  # rounds that waited for the lost
            self._coordinator.decide_if_whole(formation, round_number)

    def _reform(self, formation: Formation, change: str) -> None:
        membership = formation.membership
        assert membership is not None
        if membership.exhausted:
            self._coordinator.abort_all(formation, ErrorCode.ENGINE,
                            f"{change}; the job reformed {membership.fruitless} times without "
                            "finishing an iteration")
            return
        reform = membership.begin(change, time.monotonic())
        log.warning("job %s: epoch %d: %s", formation.job, reform.epoch, reform.change)
        for node in formation.joins:
            self._send(node, PeerReform(job=formation.job, epoch=reform.epoch,
                                        change=reform.change))

    def node_closed(self, node: bytes) -> None:
        """``node``'s daemon closed its connection to us: it died (a split closes nothing).
        Every tolerant job of it goes on without it, at once and for certain."""
        for formation in list(self._jobs.values()):
            if formation.membership is not None and formation.formed \
                    and node in formation.joins and formation.takeover is None:
                self.lose(formation, [node], "its daemon closed its connection (it stopped)")

    def on_fault(self, node: bytes, fault: PeerFault) -> None:
        """A node's collective failed: unless a change already runs, reform the same nodes
        (a peer that vanished without a word is then found by its silence to the reform)."""
        formation = self._jobs.get(fault.job)
        if formation is None or formation.membership is None or node not in formation.joins:
            return
        membership = formation.membership
        if fault.lost_ranks:
            self._lose_ranks(formation, node, fault)
            return
        # Unless the change in progress, or one already made, covers it.
        if membership.reform is None and fault.epoch == membership.epoch:
            host = node_name(formation.joins[node])
            self._reform(formation, f"a collective failed on node {host}: {fault.message[:300]}")
        if fault.closed and membership.reform is not None:
            membership.reform.crash = True  # who does not answer this change is dead

    def admit(self, formation: Formation, node: bytes, join: PeerJoin) -> None:
        """A node asks to join a running tolerant job (a replacement, or more ranks): it is
        taken in at the next change if it fits, else refused alone; the job runs on."""
        if node in formation.joins:
            self._admit_ranks(formation, node, join)
            return
        problem = _admission_problem(formation, node, join)
        if problem:
            self._coordinator.refuse(node, join.job, problem, ErrorCode.MISMATCH)
            return
        assert formation.lowest is not None
        formation.add(node, msgspec.structs.replace(join, layers=formation.lowest.layers))
        formation.joining.add(node)
        formation.watch.heard(node, time.monotonic())
        self._reform(formation, f"node {node_name(join)} (ranks {join.ranks[:20]}) joined")

    def _admit_ranks(self, formation: Formation, node: bytes, join: PeerJoin) -> None:
        """A node of the job asks for replacements of ranks it lost, its other ranks live:
        they come in at the next change. The node checked them against its live ranks; what
        does not fit here (ranks it never lost, ranks live elsewhere, another job's shape)
        is a node claiming what it does not have, ignored: refusing would fail the node's
        live ranks too, and its replacement's own timeout ends its wait."""
        current = formation.joins[node]
        added = sorted(set(join.ranks) - set(current.ranks))
        problem = ""
        if not added or not set(current.ranks) <= set(join.ranks):
            problem = f"ranks {join.ranks[:20]} do not add to its ranks {current.ranks[:20]}"
        elif any(rank in formation.rank_hosts for rank in added):
            problem = f"rank(s) {added[:20]} are in the running job already"
        elif join.world_size != formation.world_size:
            problem = f"world size {join.world_size}, the running job's is {formation.world_size}"
        else:
            problem = describe_difference(current, join)
        if problem:
            log.warning("job %s: ignoring node %s's join of more ranks: %s", formation.job,
                        node_name(current), problem[:300])
            return
        formation.forget(current)
        formation.add(node, msgspec.structs.replace(current, ranks=sorted(join.ranks)))
        formation.rejoining.update(added)
        formation.watch.heard(node, time.monotonic())
        self._reform(formation, f"rank(s) {added[:20]} on node {node_name(current)} joined")

    def on_succession(self, node: bytes, message: PeerSuccession) -> None:
        """A node of a job that was taken over from the daemon at this address before us (this
        one started there since) says where the job runs now: joins of it that come here,
        from ranks started with the old command, are sent there (``redirected``), those
        waiting here now at once. A job formed here is this coordinator's own: untouched."""
        problem = (job_id_problem(message.job)
                   or address_problem("its coordinator", message.coordinator)
                   or address_problem("the lost address", message.lost))
        formation = self._jobs.get(message.job)
        if not problem and formation is not None and formation.formed:
            problem = "that job runs here"
        if problem:
            log.warning("ignoring a succession for job %r: %s", message.job[:200], problem)
            return
        self._redirects.pop(message.job, None)
        self._redirects[message.job] = message.coordinator
        while len(self._redirects) > MAX_REDIRECTS:
            self._redirects.popitem(last=False)
        log.warning("job %s was taken over at %s from the daemon that listened here before; "
                    "its joins here go there", message.job, message.coordinator)
        if formation is not None:  # forming here, from nodes started with the old command
            del self._jobs[message.job]
            for member in formation.joins:
                self._send(member, PeerRedirect(job=message.job,
                                                coordinator=message.coordinator))

    def redirected(self, node: bytes, join: PeerJoin) -> bool:
        """Whether ``join`` is for a job taken over elsewhere from this address: then the node
        is told where (and nothing forms here)."""
        coordinator = self._redirects.get(join.job)
        if coordinator is None or join.job in self._jobs:
            return False
        self._send(node, PeerRedirect(job=join.job, coordinator=coordinator))
        return True

    def on_takeover(self, node: bytes, message: PeerTakeover) -> None:
        """A node of a tolerant job whose coordinator went silent asks this daemon, the
        roster's next, to coordinate it: gather the roster's nodes, then resume them."""
        join = message.join
        formation = self._jobs.get(message.job)
        if formation is None:
            problem, code = join_problem(join, self._limits)
            if not problem and (join.fault_tolerance != "continue" or join.job != message.job):
                problem = "only a fault_tolerance=\"continue\" job can be taken over"
            if not problem:
                problem = (roster_problem(message.roster, join.world_size, join.world_size)
                           or count_problem("epoch", message.epoch)
                           or count_problem("delivered", message.delivered)
                           or _plans_problem(message) or _dead_problem(message))
            if not problem:
                problem, code = self._coordinator.forming_limit(node), ErrorCode.LIMIT
            if problem:
                self._coordinator.refuse(node, message.job, problem, code)
                return
            formation = self._jobs[message.job] = Formation(message.job, join.world_size)
            formation.formed = True
            formation.membership = Membership(join.min_world_size, epoch=message.epoch)
            formation.store_port = self._store_port(join.host)
            formation.replanner = replanner_for(join, len(message.roster))
            formation.takeover = Takeover(message.lost,
                                          expected_peers(message.roster, message.lost),
                                          time.monotonic(), roster_nodes=len(message.roster))
            log.warning("job %s: its coordinator %s is lost; coordinating it here",
                        message.job, message.lost)
        takeover = formation.takeover
        if takeover is None:  # formed here already: this node was given up on, or is late
            self._coordinator.refuse(node, message.job, "the job was taken over without this node")
            return
        problem = ("" if formation.lowest is None else _admission_problem(formation, node, join)
                   ) or _dead_problem(message)
        if problem:
            self._coordinator.refuse(node, message.job, problem, ErrorCode.MISMATCH)
            return
        formation.add(node, join)
        formation.watch.heard(node, time.monotonic())
        takeover.add(node, message)
        assert formation.membership is not None
        formation.membership.epoch = max(formation.membership.epoch, message.epoch)
        if takeover.complete(time.monotonic()):
            self.take_over(formation)

    def take_over(self, formation: Formation) -> None:
        """Every node of the roster asked (or the wait is over): a new epoch from here."""
        takeover, membership = formation.takeover, formation.membership
        assert takeover is not None and membership is not None and formation.replanner
        formation.takeover = None
        missing = sorted(takeover.expected - takeover.dead - set(takeover.peers.values()))
        if not takeover.decisive:
            # A minority cannot tell the coordinator's crash from its own cut-off: the
            # majority may be training on the other side.
            self._coordinator.abort_all(formation, ErrorCode.RANK_LOST, (
                f"the coordinator {takeover.lost} is silent and only {len(takeover.peers)} of "
                f"the epoch's {takeover.roster_nodes} nodes could take over, not a majority: "
                "this side cannot tell the coordinator's crash from its own cut-off"))
            return
        change = f"the coordinator {takeover.lost} lost; {len(takeover.peers)} node(s) go on"
        dead = sorted(takeover.dead & takeover.expected)
        if dead:
            change += f" ({', '.join(dead[:10])} died too: its link closed)"
        if missing:
            change += f" ({', '.join(missing[:10])} did not ask within the wait: lost too)"
        if self._too_few(formation, change):
            return
        formation.replanner.version = takeover.plan  # its plans come after those in force
        formation.plans = takeover.plans  # the ones in force, for a node that joins later
        reform = membership.begin(change, time.monotonic())
        reform.states = dict(takeover.states)
        resume = self._resume(formation)
        if resume is not None:
            # Rounds reported to the lost coordinator are gone: every node reports from the
            # round after the one it resumes in.
            for node in formation.joins:
                formation.first_round[node] = resume // REPORT_EVERY + 1

    def _lose_ranks(self, formation: Formation, node: bytes, fault: PeerFault) -> None:
        """Some ranks of a node are gone, its others live: the node stays with the others."""
        membership = formation.membership
        assert membership is not None
        join = formation.joins[node]
        lost = sorted(set(fault.lost_ranks) & set(join.ranks))  # only its own ranks
        if not lost:
            return
        why = fault.message[:300]
        left = [rank for rank in join.ranks if rank not in lost]
        if not left:
            self.lose(formation, [node], why)
            return
        formation.forget(join)
        formation.add(node, msgspec.structs.replace(join, ranks=left))
        change = f"rank(s) {lost} on node {node_name(join)} lost: {why}"
        if not self._too_few(formation, change):
            self._reform(formation, change)

    def _too_few(self, formation: Formation, change: str) -> bool:
        """Whether fewer than min_world_size ranks remain after ``change``: the job then
        fails on every node, naming both."""
        membership = formation.membership
        assert membership is not None
        ranks = sum(len(join.ranks) for join in formation.joins.values())
        if ranks >= membership.min_world_size:
            return False
        self._coordinator.abort_all(formation, ErrorCode.RANK_LOST,
                        f"{change}; {ranks} rank(s) remain, fewer than min_world_size "
                        f"{membership.min_world_size}")
        return True

    def on_reform_state(self, node: bytes, state: PeerReformState) -> None:
        formation = self._jobs.get(state.job)
        if formation is None or formation.membership is None or node not in formation.joins:
            return
        formation.watch.heard(node, time.monotonic())
        if formation.membership.answer(node, state) \
                and formation.membership.complete(formation.joins):
            self._resume(formation)

    def _resume(self, formation: Formation) -> int | None:
        """Every survivor answered: the new epoch's places, and the iteration it resumes at
        (None: the answers failed the job)."""
        membership = formation.membership
        assert membership is not None
        reform, resume = membership.finish()
        if isinstance(resume, str):
            self._coordinator.abort_all(formation, ErrorCode.INVALID,
                                        f"the reform failed: {resume}")
            return None
        order = survivors_order(formation.joins)
        members = sorted(rank for join in formation.joins.values() for rank in join.ranks)
        if len(order) > 1 and not formation.store_port:
            # Formed on one node, the job had no store: a node joining it needs one now,
            # reached at the address the first node's engine reaches us by (as ``_form``).
            formation.store_port = self._store_port(formation.joins[order[0]].host)
        store_port = formation.store_port if len(order) > 1 else 0
        prefix = secrets.token_hex(16)  # a new group under new keys: the old one is abandoned
        if formation.replanner is not None:
            formation.replanner.resize(len(order))
        joiners, formation.joining = formation.joining, set()
        rejoining, formation.rejoining = formation.rejoining, set()
        source = min((rank for node, join in formation.joins.items() if node not in joiners
                      for rank in join.ranks if rank not in rejoining), default=-1)
        expect = sorted(round_number * REPORT_EVERY + DECISION_LAG
                        for round_number in {*formation.reports, *formation.deciding}
                        if round_number * REPORT_EVERY + DECISION_LAG >= resume)
        for index, node in enumerate(order):
            self._send(node, PeerResume(
                job=formation.job, epoch=reform.epoch, node_index=index, nodes=len(order),
                store_port=store_port, store_prefix=prefix, members=members,
                iteration=resume, change=reform.change,
                expect=expect if node in joiners else [], source=source,
                roster=roster_of([(n, formation.joins[n]) for n in order])))
            if node in joiners:
                # It reports from the round its first iteration is in; it runs the plans
                # in force from there, as the others do.
                formation.first_round[node] = resume // REPORT_EVERY + 1
                for plan in _plans_from(formation.plans, resume):
                    self._send(node, plan)
        log.warning("job %s: epoch %d resumes at iteration %d with %d node(s), %d rank(s)",
                    formation.job, reform.epoch, resume, len(order), len(members))
        return resume



def _admission_problem(formation: Formation, node: bytes, join: PeerJoin) -> str:
    """'' when ``join`` may join the running ``formation``, else why not."""
    if node in formation.joins:
        return "this node is in the job already; start the new rank on another node"
    if join.world_size != formation.world_size:
        return (f"ranks {join.ranks[:20]} say world size {join.world_size}, the running job "
                f"has {formation.world_size}")
    taken = sorted(rank for rank in join.ranks if rank in formation.rank_hosts)
    if taken:
        return (f"rank(s) {taken[:20]} are in the running job already (on "
                f"{formation.rank_hosts[taken[0]]}); a replacement takes a lost rank's place")
    first = formation.lowest
    assert first is not None
    difference = describe_difference(first, join)
    if difference:
        return f"ranks {join.ranks[:20]} differ from the running job: {difference}"
    return ""


def _dead_problem(message: PeerTakeover) -> str:
    """'' when the nodes a takeover names dead are addresses."""
    return next((problem for address in message.dead
                 if (problem := address_problem("a dead node", address))), "")


def _plans_problem(message: PeerTakeover) -> str:
    """'' when the decisions a node hands over fit: a few, of this job (their groups are
    checked by a node that is given them, as every plan is)."""
    if len(message.plans) > MAX_PLANS_HANDED_OVER:
        return f"{len(message.plans)} plans handed over, at most {MAX_PLANS_HANDED_OVER}"
    if any(plan.job != message.job for plan in message.plans):
        return "a plan handed over is of another job"
    return ""


def _plans_from(plans: list[PeerPlan], iteration: int) -> list[PeerPlan]:
    """The decisions a joiner at ``iteration`` needs: the one in force there and any later."""
    in_force = [plan for plan in plans if plan.effective_iteration <= iteration]
    later = [plan for plan in plans if plan.effective_iteration > iteration]
    return in_force[-1:] + later


def roster_of(order: list[tuple[bytes, PeerJoin]]) -> list[RosterEntry]:
    """The nodes of an epoch, for each node to find the next coordinator if this one is lost."""
    return [RosterEntry(peer=join.peer, ranks=list(join.ranks)) for _, join in order]
