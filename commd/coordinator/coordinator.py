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

import msgspec

from commd.coordinator.formation import Deadlines, Formation, replanner_for
from commd.coordinator.membership import Membership
from commd.coordinator.replanner import Decision, Replanner
from commd.coordinator.tolerance import Tolerance, roster_of
from commd.coordinator.validation import (
    JoinLimits,
    comm_problem,
    heartbeat_problem,
    join_problem,
    profile_problem,
)
from commd_protocol import (
    ErrorCode,
    PeerAbort,
    PeerFault,
    PeerHeartbeat,
    PeerJoin,
    PeerLeave,
    PeerPlan,
    PeerProfile,
    PeerReformState,
    PeerSetup,
    PeerStatus,
    PeerSuccession,
    PeerTakeover,
)
from commd_protocol.agreement import describe_difference
from commd_protocol.errors import prefixed
from commd_protocol.status import CoordinatedJob

log = logging.getLogger("commd.coordinator")

SendNode = Callable[[bytes, msgspec.Struct], None]


# A node's abort with one of these means the node is gone from the job (its ranks died, its
# daemon stops), not that the job is wrong: a tolerant job goes on without it.
LOSS_CODES = frozenset({ErrorCode.RANK_LOST, ErrorCode.SHUTDOWN, ErrorCode.ENGINE,
                        ErrorCode.TIMEOUT})
DEFAULT_DEADLINES = Deadlines()
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
    """The coordinator of every job whose nodes join on this daemon's peer endpoint: it gathers a
    job's joins and checks that they agree, sets the job up on every node (``PeerSetup``),
    plans each round from the nodes' reports (``PeerPlan``), watches the nodes' liveness and
    stalls, and aborts the job on every node when it fails. A tolerant job's membership
    changes go to its ``Tolerance``."""

    def __init__(self, send: SendNode, store_port: Callable[[str], int],
                 deadlines: Deadlines = DEFAULT_DEADLINES, limits: JoinLimits | None = None,
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
        # the tolerant jobs' membership changes: a collaborator lent the jobs and the sockets
        self._tolerance = Tolerance(self._jobs, self._limits, store_port, send, self)

    def node_closed(self, node: bytes) -> None:
        """``node``'s daemon closed its connection to us: it died (see Tolerance)."""
        self._tolerance.node_closed(node)

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
            self._tolerance.on_reform_state(node, message)
        elif isinstance(message, PeerFault):
            self._tolerance.on_fault(node, message)
        elif isinstance(message, PeerTakeover):
            self._tolerance.on_takeover(node, message)
        elif isinstance(message, PeerSuccession):
            self._tolerance.on_succession(node, message)
        elif isinstance(message, PeerHeartbeat):
            formation = self._jobs.get(message.job)
            if formation is not None and node in formation.joins:
                problem = heartbeat_problem(message, formation.joins[node])
                if problem:
                    self.abort_all(formation, ErrorCode.INVALID,
                                    f"a node's heartbeat is refused: {problem}")
                    return
                formation.watch.heard(node, time.monotonic(), message)

    def _on_join(self, node: bytes, join: PeerJoin) -> None:
        problem, code = join_problem(join, self._limits)
        if problem:
            self.refuse(node, join.job, problem, code)
            return
        if self._tolerance.redirected(node, join):
            return
        formation = self._jobs.get(join.job)
        if formation is not None and formation.formed and formation.membership is not None:
            self._tolerance.admit(formation, node, join)
            return
        if formation is not None and formation.formed:
            # A second run under the id of a running one would take its place and stall it.
            self.refuse(node, join.job, f"a run with this id is already running on "
                         f"{len(formation.joins)} node(s); use a new job id for a new run")
            return
        if formation is None:
            limit = self.forming_limit(node)
            if limit:
                self.refuse(node, join.job, limit, ErrorCode.LIMIT)
                return
            formation = self._jobs[join.job] = Formation(join.job, join.world_size)
        problem = self._check(formation, node, join)
        if problem:
            formation.joins[node] = join  # told of the abort with the others
            self.abort_all(formation, ErrorCode.MISMATCH, problem)
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
        formation.replanner = replanner_for(first, len(order))
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
                    roster=roster_of(order) if formation.membership is not None else [],
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
            self.abort_all(formation, ErrorCode.INVALID, f"a node's report is refused: {problem}")
            return
        formation.reports.setdefault(profile.round, {})[node] = profile
        self.decide_if_whole(formation, profile.round)

    def decide_if_whole(self, formation: Formation, round_number: int) -> None:
        """Once every node of the job has reported ``round_number``, decide its plan."""
        round_reports = formation.reports[round_number]
        # A joiner reports from its first round on, which its resume fixes; until then it
        # runs nothing and reports nothing, so a round closing while it joins is not its.
        reporting = [node for node in formation.joins if node not in formation.joining
                     and formation.first_round.get(node, 0) <= round_number]
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
            self.abort_all(formation, ErrorCode.INVALID, f"planning failed: {problem!r}")
            return
        self._decided(formation, round_number, future.result())

    def _decided(self, formation: Formation, round_number: int,
                 decision: Decision | str) -> None:
        formation.deciding.discard(round_number)
        if isinstance(decision, str):
            self.abort_all(formation, ErrorCode.INVALID,
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
            choice=decision.choice,
        )
        formation.plans = [*formation.plans[-2:], message]
        for member in formation.joins:
            if member not in formation.joining:  # a joiner gets the plans with its resume
                self._send(member, message)

    def abort_all(self, formation: Formation, code: str, message: str) -> None:
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
            self._tolerance.lose(formation, [node],
                       abort.message.removeprefix(f"commd: job {abort.job!r}: "))
            return
        del self._jobs[abort.job]
        for other in formation.joins:
            if other != node:
                self._send(other, abort)

    def refuse(self, node: bytes, job: str, reason: str,
               code: ErrorCode = ErrorCode.INVALID) -> None:
        """Fail one node's part of a job it joined wrongly; other nodes are not touched."""
        text = prefixed(reason, f"job {job!r}: the coordinator refused this node's join: ")
        log.warning("%s", text)
        self._send(node, PeerAbort(job=job, code=code, message=text))

    def forming_limit(self, node: bytes) -> str:
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
                    self._tolerance.take_over(formation)
                continue
            if formation.membership is not None:
                membership = formation.membership
                unanswered = membership.unanswered(formation.joins, now)
                if unanswered:
                    crash = membership.reform is not None and membership.reform.crash
                    self._tolerance.lose(formation, unanswered,
                                         "its daemon did not answer the reform", certain=crash)
            if self._jobs.get(formation.job) is not formation:
                continue  # the loss ended it
            problem, code = self._overdue(formation, now)
            if problem:
                self.abort_all(formation, code, problem)
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
            self._tolerance.lose(formation,
                                 formation.watch.silent_nodes(joined, now, limits.peer_s),
                                 f"its daemon has sent nothing for over {limits.peer_s:g}s",
                                 certain=False)
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
            formation.membership.left_having_delivered(leave.delivered)
            # Its ranks closed while the others may still train: they go on without it.
            self._tolerance.lose(formation, [node], "its ranks closed their clients")
            return
        join = formation.joins.pop(node, None)
        if join is not None:
            formation.forget(join)
        if not formation.joins:
            del self._jobs[leave.job]

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

