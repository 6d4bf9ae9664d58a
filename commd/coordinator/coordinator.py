"""The coordinator's side of job formation: gather every node, validate, order, plan.

Whichever daemon receives a job's joins on its peer endpoint coordinates that job: the
clients name it (the daemon on rank 0's node), so no election is needed.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import logging
import secrets
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import msgspec

from commd.coordinator.membership import (
    Membership,
    Takeover,
    describe_nodes,
    expected_peers,
    survivors_order,
)
from commd.coordinator.replanner import Decision, Replanner
from commd.coordinator.validation import (
    JoinLimits,
    comm_problem,
    heartbeat_problem,
    join_problem,
    profile_problem,
)
from commd.coordinator.watch import JobWatch
from commd_protocol import (
    ErrorCode,
    PeerAbort,
    PeerFault,
    PeerHeartbeat,
    PeerJoin,
    PeerLeave,
    PeerPlan,
    PeerProfile,
    PeerReform,
    PeerReformState,
    PeerResume,
    PeerSetup,
    PeerStatus,
    PeerTakeover,
    RosterEntry,
)
from commd_protocol.agreement import describe_difference
from commd_protocol.checks import roster_problem
from commd_protocol.dtypes import itemsize
from commd_protocol.errors import prefixed
from commd_protocol.limits import count_problem
from commd_protocol.peer import DECISION_LAG, REPORT_EVERY
from commd_protocol.status import CoordinatedJob

log = logging.getLogger("commd.coordinator")

SendNode = Callable[[bytes, msgspec.Struct], None]


@dataclass
class Formation:
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
    form_s: float = 300.0  # a job must form within this
    peer_s: float = 10.0  # a node silent this long fails the job
    stall_warn_s: float = 60.0  # a stall this long is named
    stall_s: float = 0.0  # a stall this long fails the job (0: never)


# A node's abort with one of these means the node is gone from the job (its ranks died, its
# daemon stops), not that the job is wrong: a tolerant job goes on without it.
LOSS_CODES = frozenset({ErrorCode.RANK_LOST, ErrorCode.SHUTDOWN, ErrorCode.ENGINE,
                        ErrorCode.TIMEOUT})
STATUS_EVERY_S = 2.0  # PeerStatus to every node of every job: liveness, joined ranks, stall
MAX_FORMING = 256  # jobs forming on this coordinator at a time
MAX_FORMING_PER_NODE = 32  # of those, joined by one node connection


def _give_back_memory() -> None:
    """Hand freed heap pages back to the kernel: the joins of jobs that expired while forming
    (up to --max-layers layers each) are freed together, and glibc would keep the pages."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


def _checked_decision(replanner: Replanner, reports: list[PeerProfile],
                      around: Callable[[], AbstractContextManager[object]]) -> Decision | str:
    """The round's plan, or what is wrong with a report's comm rows (checked here, with the
    planning, where their cost does not hold the event loop); inside ``around()``."""
    with around():
        for report in reports:
            problem = comm_problem(report)
            if problem:
                return problem
        return replanner.decide(reports)


class Coordinator:
    def __init__(self, send: SendNode, store_port: Callable[[str], int],
                 deadlines: Deadlines = Deadlines(), limits: JoinLimits | None = None,
                 plan_in_thread: bool = False,
                 while_planning: Callable[[], AbstractContextManager[object]] = nullcontext,
                 ) -> None:
        self._deadlines = deadlines
        # The daemon pauses the cyclic collector while a plan is decided: the planning's
        # allocations would start collections over the whole heap, holding the loop meanwhile.
        self._while_planning = while_planning
        # plan_in_thread: decide plans off the event loop (the daemon); else in the call
        self._planner = ThreadPoolExecutor(1, thread_name_prefix="commd-planner") \
            if plan_in_thread else None
        self._limits = limits or JoinLimits()  # what one join may ask the coordinator to hold
        self._send = send
        self._store_port = store_port
        self._jobs: dict[str, Formation] = {}
        self._generation = 0

    def on_message(self, node: bytes, message: msgspec.Struct) -> None:
        if isinstance(message, PeerJoin):
            self._on_join(node, message)
        elif isinstance(message, PeerAbort):
            self._on_abort(node, message)
        elif isinstance(message, PeerLeave):
            self._on_leave(node, message)
        elif isinstance(message, PeerProfile):
            self._on_profile(node, message)
        elif isinstance(message, PeerReformState):
            self._on_reform_state(node, message)
        elif isinstance(message, PeerFault):
            self._on_fault(node, message)
        elif isinstance(message, PeerTakeover):
            self._on_takeover(node, message)
        elif isinstance(message, PeerHeartbeat):
            formation = self._jobs.get(message.job)
            if formation is not None and node in formation.joins:
                problem = heartbeat_problem(message, formation.joins[node])
                if problem:
                    self._abort_all(formation, ErrorCode.INVALID,
                                    f"a node's heartbeat is refused: {problem}")
                    return
                formation.watch.heard(node, time.monotonic(), message)

    def _on_join(self, node: bytes, join: PeerJoin) -> None:
        problem, code = join_problem(join, self._limits)
        if problem:
            self._refuse(node, join.job, problem, code)
            return
        formation = self._jobs.get(join.job)
        if formation is not None and formation.formed and formation.membership is not None:
            self._admit(formation, node, join)
            return
        if formation is not None and formation.formed:
            # A second run under the id of a running one would take its place and stall it.
            self._refuse(node, join.job, f"a run with this id is already running on "
                         f"{len(formation.joins)} node(s); use a new job id for a new run")
            return
        if formation is None:
            limit = self._forming_limit(node)
            if limit:
                self._refuse(node, join.job, limit, ErrorCode.LIMIT)
                return
            formation = self._jobs[join.job] = Formation(join.job, join.world_size)
        problem = self._check(formation, node, join)
        if problem:
            formation.joins[node] = join  # told of the abort with the others
            self._abort_all(formation, ErrorCode.MISMATCH, problem)
            return
        formation.watch.heard(node, time.monotonic())
        if formation.ranks_joined == formation.world_size:
            self._form(formation)

    def _check(self, formation: Formation, node: bytes, join: PeerJoin) -> str:
        """'' and ``join`` recorded when it agrees with the joins so far, else the mismatch.
        Only the new join is compared (with the lowest-ranked one): the others agreed with
        that one when they came, so a join costs its own size, not the job's so far."""
        previous = formation.joins.pop(node, None)
        if previous is not None:  # the node joined again: its earlier ranks are free again
            formation.forget(previous)
        first = formation.lowest
        if first is None:  # the first join (or every earlier one was taken back)
            formation.world_size = join.world_size
        else:
            if join.world_size != formation.world_size:
                return (f"ranks {join.ranks} say world size {join.world_size}, ranks "
                        f"{first.ranks} say {formation.world_size}")
            for rank in join.ranks:
                host = formation.rank_hosts.get(rank)
                if host is not None:
                    return (f"rank {rank} joined from two nodes, {host} and {join.host}: "
                            "check RANK on those nodes")
            low, high = (join, first) if min(join.ranks) < min(first.ranks) else (first, join)
            difference = describe_difference(low, high)
            if difference:
                return f"ranks {low.ranks} and ranks {high.ranks} differ: {difference}"
            # Equal layers: one list per job, so N nodes' joins hold one copy, not N.
            join = msgspec.structs.replace(join, layers=first.layers)
        formation.add(node, join)
        return ""

    def _form(self, formation: Formation) -> None:
        # Nodes ordered by their lowest process rank: node 0 holds rank 0.
        order = sorted(formation.joins.items(), key=lambda item: min(item[1].ranks))
        self._generation += 1
        formation.generation, formation.formed = self._generation, True
        first = order[0][1]
        sizes = [layer.size * itemsize(first.dtype) for layer in first.layers]
        formation.replanner = Replanner(first.planner, sizes, nodes=len(order),
                                        compression=first.compression,
                                        itemsize=itemsize(first.dtype))
        # The store is reached at the address the first node's engine reaches us by.
        store_port = self._store_port(first.host) if len(order) > 1 else 0
        formation.store_port = store_port
        if first.fault_tolerance == "continue":
            formation.membership = Membership(first.min_world_size)
        prefix = secrets.token_hex(16)  # 128 bits: nobody guesses where the job's keys are
        for index, (node, _join) in enumerate(order):
            self._send(
                node,
                PeerSetup(
                    job=formation.job,
                    generation=formation.generation,
                    node_index=index,
                    nodes=len(order),
                    store_port=store_port,
                    store_prefix=prefix,
                    planner=first.planner,
                    roster=_roster(order) if formation.membership is not None else [],
                ),
            )
        log.info("job %s formed: %d nodes, %d ranks", formation.job, len(order),
                 formation.world_size)

    def _on_profile(self, node: bytes, profile: PeerProfile) -> None:
        """Once every node has reported a round, decide its plan and tell every node."""
        formation = self._jobs.get(profile.job)
        if formation is None or formation.replanner is None or node not in formation.joins:
            return
        formation.watch.heard(node, time.monotonic())
        problem = profile_problem(profile, len(formation.joins[node].layers))
        if problem:
            self._abort_all(formation, ErrorCode.INVALID, f"a node's report is refused: {problem}")
            return
        formation.reports.setdefault(profile.round, {})[node] = profile
        self._decide_if_whole(formation, profile.round)

    def _decide_if_whole(self, formation: Formation, round_number: int) -> None:
        """Once every node of the job has reported ``round_number``, decide its plan."""
        round_reports = formation.reports[round_number]
        reporting = [node for node in formation.joins  # a joiner reports from its first round
                     if formation.first_round.get(node, 0) <= round_number]
        if any(node not in round_reports for node in reporting) or formation.replanner is None:
            return
        del formation.reports[round_number]
        formation.deciding.add(round_number)
        work = functools.partial(_checked_decision, formation.replanner,
                                 list(round_reports.values()), self._while_planning)
        if self._planner is None:
            self._decided(formation, round_number, work())
            return
        # Planning a job of --max-layers layers takes longer than a loop turn may: it runs on
        # the planner thread (one, so a job's rounds are decided in order), the loop serves on.
        future = asyncio.get_running_loop().run_in_executor(self._planner, work)
        future.add_done_callback(functools.partial(self._planned, formation, round_number))

    def _planned(self, formation: Formation, round_number: int,
                 future: asyncio.Future[Decision | str]) -> None:
        if future.cancelled() or self._jobs.get(formation.job) is not formation:
            return  # the job ended while it was planned
        problem = future.exception()
        if problem is not None:
            log.error("job %s: planning round %d failed", formation.job, round_number,
                      exc_info=problem)
            self._abort_all(formation, ErrorCode.INVALID, f"planning failed: {problem!r}")
            return
        self._decided(formation, round_number, future.result())

    def _decided(self, formation: Formation, round_number: int,
                 decision: Decision | str) -> None:
        formation.deciding.discard(round_number)
        if isinstance(decision, str):
            self._abort_all(formation, ErrorCode.INVALID,
                            f"a node's report is refused: {decision}")
            return
        if decision.reason != "no drift":
            log.info("job %s plan v%d from iteration %d: %d groups (%s)", formation.job,
                     decision.version, decision.effective_iteration, len(decision.groups),
                     decision.reason)
        message = PeerPlan(
            job=formation.job, round=round_number,
            effective_iteration=decision.effective_iteration, version=decision.version,
            groups=decision.groups, alpha_s=decision.cost.alpha_s,
            beta_s_per_byte=decision.cost.beta_s_per_byte,
            predicted_comm_s=decision.predicted_comm_s, reason=decision.reason,
            exchanges=decision.exchanges, ratio=decision.ratio,
            overhead_s=decision.overhead_s, search=decision.search,
            selection=decision.selection, candidates=decision.candidates,
        )
        formation.plans = [*formation.plans[-2:], message]
        for member in formation.joins:
            if member not in formation.joining:  # a joiner gets the plans with its resume
                self._send(member, message)

    def _abort_all(self, formation: Formation, code: str, message: str) -> None:
        text = prefixed(message, f"job {formation.job!r}: ")
        log.error("%s", text)
        for node in formation.joins:
            self._send(node, PeerAbort(job=formation.job, code=code, message=text))
        del self._jobs[formation.job]

    def _on_abort(self, node: bytes, abort: PeerAbort) -> None:
        formation = self._jobs.get(abort.job)
        if formation is None or node not in formation.joins:
            return  # only a node of the job may abort it
        if formation.membership is not None and abort.code in LOSS_CODES:
            self._lose(formation, [node],
                       abort.message.removeprefix(f"commd: job {abort.job!r}: "))
            return
        del self._jobs[abort.job]
        for other in formation.joins:
            if other != node:
                self._send(other, abort)

    def _refuse(self, node: bytes, job: str, reason: str,
                code: ErrorCode = ErrorCode.INVALID) -> None:
        """Fail one node's part of a job it joined wrongly; other nodes are not touched."""
        text = prefixed(reason, f"job {job!r}: the coordinator refused this node's join: ")
        log.warning("%s", text)
        self._send(node, PeerAbort(job=job, code=code, message=text))

    def _forming_limit(self, node: bytes) -> str:
        """'' when a new job may start forming here for ``node``, else which limit it hits."""
        forming = [f for f in self._jobs.values() if not f.formed or f.takeover is not None]
        if len(forming) >= MAX_FORMING:
            return f"{MAX_FORMING} jobs are forming on this coordinator already"
        if sum(node in f.joins for f in forming) >= MAX_FORMING_PER_NODE:
            return f"this node has {MAX_FORMING_PER_NODE} jobs forming here already"
        return ""

    def tick(self, now: float) -> None:
        """Every second: deadlines, silent nodes, stalls, and every node's ``PeerStatus``."""
        expired = False
        for formation in list(self._jobs.values()):
            if formation.takeover is not None:
                if formation.takeover.complete(now):
                    self._take_over(formation)
                continue
            if formation.membership is not None:
                unanswered = formation.membership.unanswered(formation.joins, now)
                if unanswered:
                    self._lose(formation, unanswered, "its daemon did not answer the reform")
            if self._jobs.get(formation.job) is not formation:
                continue  # the loss ended it
            problem, code = self._overdue(formation, now)
            if problem:
                self._abort_all(formation, code, problem)
                expired = True
                continue
            if self._jobs.get(formation.job) is formation:  # a loss may have ended it
                self._tell_status(formation, now)
        if expired:
            _give_back_memory()

    def _overdue(self, formation: Formation, now: float) -> tuple[str, ErrorCode]:
        limits, joined = self._deadlines, formation.joins
        if not formation.formed and now - formation.started > limits.form_s:
            ranks = sorted(r for join in joined.values() for r in join.ranks)
            return (f"the job did not form within {limits.form_s:g}s: ranks {ranks[:20]} of "
                    f"{formation.world_size} joined; start the missing ones with the same job "
                    "id and coordinator"), ErrorCode.TIMEOUT
        silent = formation.watch.silent(joined, now, limits.peer_s)
        if silent and formation.membership is not None:
            self._lose(formation, formation.watch.silent_nodes(joined, now, limits.peer_s),
                       f"its daemon has sent nothing for over {limits.peer_s:g}s")
            return "", ErrorCode.TIMEOUT
        if silent:
            return silent, ErrorCode.RANK_LOST
        before = formation.watch.stall
        stall = formation.watch.update_stall(joined, limits.stall_warn_s)
        if stall is not None and (before is None or before.key != stall.key):
            log.warning("job %s: %s", formation.job, stall.message)
        if stall is not None and 0 < limits.stall_s <= stall.seconds:
            return (f"{stall.message}; the job fails after {limits.stall_s:g}s of stall "
                    "(stall_timeout_s)"), ErrorCode.TIMEOUT
        return "", ErrorCode.TIMEOUT

    def _tell_status(self, formation: Formation, now: float) -> None:
        if now - formation.watch.status_at < STATUS_EVERY_S:
            return
        formation.watch.status_at = now
        stall = formation.watch.stall
        ranks = sorted(r for join in formation.joins.values() for r in join.ranks)
        message = PeerStatus(job=formation.job, joined=ranks,
                             stall=stall.message if stall else "",
                             stall_s=stall.seconds if stall else 0.0,
                             marks_pending=formation.watch.marks_pending(),
                             waiting_for=formation.watch.waiting_for(formation.joins))
        for node in formation.joins:
            self._send(node, message)

    def _on_leave(self, node: bytes, leave: PeerLeave) -> None:
        formation = self._jobs.get(leave.job)
        if formation is None:
            return
        if formation.membership is not None and node in formation.joins \
                and len(formation.joins) > 1:
            # Its ranks closed while the others may still train: they go on without it.
            self._lose(formation, [node], "its ranks closed their clients")
            return
        join = formation.joins.pop(node, None)
        if join is not None:
            formation.forget(join)
        if not formation.joins:
            del self._jobs[leave.job]

    # --- membership (fault_tolerance="continue") ---------------------------------------------

    def _lose(self, formation: Formation, nodes: list[bytes], why: str) -> None:
        """``nodes`` are gone from a tolerant job: the survivors move to a new epoch, or the
        job fails when fewer than min_world_size ranks remain."""
        membership = formation.membership
        assert membership is not None
        change = describe_nodes(formation.joins, nodes, why)
        for node in nodes:
            join = formation.joins.pop(node, None)
            if join is not None:
                formation.forget(join)
            formation.watch.nodes.pop(node, None)
            formation.joining.discard(node)
            formation.first_round.pop(node, None)
            for reports in formation.reports.values():
                reports.pop(node, None)
        ranks = sum(len(join.ranks) for join in formation.joins.values())
        if not formation.joins or ranks < membership.min_world_size:
            if formation.joins:
                self._abort_all(formation, ErrorCode.RANK_LOST,
                                f"{change}; {ranks} rank(s) remain, fewer than min_world_size "
                                f"{membership.min_world_size}")
            else:
                del self._jobs[formation.job]
            return
        self._reform(formation, change)
        for round_number in sorted(formation.reports):  # rounds that waited for the lost
            self._decide_if_whole(formation, round_number)

    def _reform(self, formation: Formation, change: str) -> None:
        membership = formation.membership
        assert membership is not None
        if membership.exhausted:
            self._abort_all(formation, ErrorCode.ENGINE,
                            f"{change}; the job reformed {membership.fruitless} times without "
                            "finishing an iteration")
            return
        reform = membership.begin(change, time.monotonic())
        log.warning("job %s: epoch %d: %s", formation.job, reform.epoch, reform.change)
        for node in formation.joins:
            self._send(node, PeerReform(job=formation.job, epoch=reform.epoch,
                                        change=reform.change))

    def _on_fault(self, node: bytes, fault: PeerFault) -> None:
        """A node's collective failed: unless a change already runs, reform the same nodes
        (a peer that vanished without a word is then found by its silence to the reform)."""
        formation = self._jobs.get(fault.job)
        if formation is None or formation.membership is None or node not in formation.joins:
            return
        membership = formation.membership
        if fault.lost_ranks:
            self._lose_ranks(formation, node, fault)
            return
        if membership.reform is not None or fault.epoch != membership.epoch:
            return  # the change in progress, or one already made, covers it
        host = formation.joins[node].host
        self._reform(formation, f"a collective failed on node {host}: {fault.message[:300]}")

    def _admit(self, formation: Formation, node: bytes, join: PeerJoin) -> None:
        """A node asks to join a running tolerant job (a replacement, or more ranks): it is
        taken in at the next change if it fits, else refused alone; the job runs on."""
        problem = _admission_problem(formation, node, join)
        if problem:
            self._refuse(node, join.job, problem, ErrorCode.MISMATCH)
            return
        assert formation.lowest is not None
        formation.add(node, msgspec.structs.replace(join, layers=formation.lowest.layers))
        formation.joining.add(node)
        formation.watch.heard(node, time.monotonic())
        self._reform(formation, f"node {join.host} (ranks {join.ranks[:20]}) joined")

    def _on_takeover(self, node: bytes, message: PeerTakeover) -> None:
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
                           or count_problem("delivered", message.delivered))
            if not problem:
                problem, code = self._forming_limit(node), ErrorCode.LIMIT
            if problem:
                self._refuse(node, message.job, problem, code)
                return
            formation = self._jobs[message.job] = Formation(message.job, join.world_size)
            formation.formed = True
            formation.membership = Membership(join.min_world_size, epoch=message.epoch)
            formation.store_port = self._store_port(join.host)
            sizes = [layer.size * itemsize(join.dtype) for layer in join.layers]
            formation.replanner = Replanner(join.planner, sizes, nodes=len(message.roster),
                                            compression=join.compression,
                                            itemsize=itemsize(join.dtype))
            formation.takeover = Takeover(message.lost,
                                          expected_peers(message.roster, message.lost),
                                          time.monotonic())
            log.warning("job %s: its coordinator %s is lost; coordinating it here",
                        message.job, message.lost)
        takeover = formation.takeover
        if takeover is None:  # formed here already: this node was given up on, or is late
            self._refuse(node, message.job, "the job was taken over without this node")
            return
        problem = "" if formation.lowest is None else _admission_problem(formation, node, join)
        if problem:
            self._refuse(node, message.job, problem, ErrorCode.MISMATCH)
            return
        formation.add(node, join)
        formation.watch.heard(node, time.monotonic())
        takeover.add(node, message)
        assert formation.membership is not None
        formation.membership.epoch = max(formation.membership.epoch, message.epoch)
        if takeover.complete(time.monotonic()):
            self._take_over(formation)

    def _take_over(self, formation: Formation) -> None:
        """Every node of the roster asked (or the wait is over): a new epoch from here."""
        takeover, membership = formation.takeover, formation.membership
        assert takeover is not None and membership is not None and formation.replanner
        formation.takeover = None
        missing = sorted(takeover.expected - set(takeover.peers.values()))
        change = f"the coordinator {takeover.lost} lost; {len(takeover.peers)} node(s) go on"
        if missing:
            change += f" ({', '.join(missing[:10])} did not ask within the wait: lost too)"
        ranks = sum(len(join.ranks) for join in formation.joins.values())
        if ranks < membership.min_world_size:
            self._abort_all(formation, ErrorCode.RANK_LOST,
                            f"{change}; {ranks} rank(s) remain, fewer than min_world_size "
                            f"{membership.min_world_size}")
            return
        formation.replanner.version = takeover.plan  # its plans come after those in force
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
            self._lose(formation, [node], why)
            return
        formation.forget(join)
        formation.add(node, msgspec.structs.replace(join, ranks=left))
        change = f"rank(s) {lost} on node {join.host} lost: {why}"
        ranks = sum(len(j.ranks) for j in formation.joins.values())
        if ranks < membership.min_world_size:
            self._abort_all(formation, ErrorCode.RANK_LOST,
                            f"{change}; {ranks} rank(s) remain, fewer than min_world_size "
                            f"{membership.min_world_size}")
            return
        self._reform(formation, change)

    def _on_reform_state(self, node: bytes, state: PeerReformState) -> None:
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
            self._abort_all(formation, ErrorCode.INVALID, f"the reform failed: {resume}")
            return None
        order = survivors_order(formation.joins)
        members = sorted(rank for join in formation.joins.values() for rank in join.ranks)
        store_port = formation.store_port if len(order) > 1 else 0
        prefix = secrets.token_hex(16)  # a new group under new keys: the old one is abandoned
        if formation.replanner is not None:
            formation.replanner.resize(len(order))
        joiners, formation.joining = formation.joining, set()
        source = min((rank for node, join in formation.joins.items() if node not in joiners
                      for rank in join.ranks), default=-1)
        expect = sorted(round_number * REPORT_EVERY + DECISION_LAG
                        for round_number in {*formation.reports, *formation.deciding}
                        if round_number * REPORT_EVERY + DECISION_LAG >= resume)
        for index, node in enumerate(order):
            self._send(node, PeerResume(
                job=formation.job, epoch=reform.epoch, node_index=index, nodes=len(order),
                store_port=store_port, store_prefix=prefix, members=members,
                iteration=resume, change=reform.change,
                expect=expect if node in joiners else [], source=source,
                roster=_roster([(n, formation.joins[n]) for n in order])))
            if node in joiners:
                # It reports from the round its first iteration is in; it runs the plans
                # in force from there, as the others do.
                formation.first_round[node] = resume // REPORT_EVERY + 1
                for plan in _plans_from(formation.plans, resume):
                    self._send(node, plan)
        log.warning("job %s: epoch %d resumes at iteration %d with %d node(s), %d rank(s)",
                    formation.job, reform.epoch, resume, len(order), len(members))
        return resume

    def close(self) -> None:
        """Stop the planner thread; a plan being decided is dropped."""
        if self._planner is not None:
            self._planner.shutdown(wait=False, cancel_futures=True)

    def status(self) -> list[CoordinatedJob]:
        return [CoordinatedJob(
            job=f.job, formed=f.formed, nodes=len(f.joins), world_size=f.world_size,
            epoch=f.membership.epoch if f.membership else 0,
            membership_changes=f.membership.history if f.membership else [])
            for f in self._jobs.values()]


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


def _plans_from(plans: list[PeerPlan], iteration: int) -> list[PeerPlan]:
    """The decisions a joiner at ``iteration`` needs: the one in force there and any later."""
    in_force = [plan for plan in plans if plan.effective_iteration <= iteration]
    later = [plan for plan in plans if plan.effective_iteration > iteration]
    return in_force[-1:] + later


def _roster(order: list[tuple[bytes, PeerJoin]]) -> list[RosterEntry]:
    """The nodes of an epoch, for each node to find the next coordinator if this one is lost."""
    return [RosterEntry(peer=join.peer, ranks=list(join.ranks)) for _, join in order]
