"""A tolerant job's membership on this node: its epochs, its roster, who coordinates it, its
replacements, and the steps of a change (``commd.coordinator.membership`` decides; this
carries it out). Only jobs registered with ``fault_tolerance="continue"`` change it.

``Membership`` owns that state and the order of a change's steps: stop for a change, answer
where the iteration stands, go on in the new epoch, take replacements in, turn to the
roster's next node when the coordinator falls silent. What a step does to the job itself
(stop its data plane, run in the new epoch, set up as a joiner, fail) it asks of the job
through ``JobSide``'s methods; the job alone changes its state (``commd.job.lifecycle``).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Coroutine
from typing import Any, Protocol

import msgspec

from commd.engines import Engine
from commd.engines.buffer_ops import BufferOps
from commd.job import setup as set_up
from commd.job.members import Members
from commd.job.state import Epochs, JobContext, LocalRank
from commd.job.tolerant import ResumeError, TolerantPipeline
from commd_protocol import (
    Done,
    ErrorCode,
    Joining,
    PeerFault,
    PeerJoin,
    PeerPlan,
    PeerReform,
    PeerReformState,
    PeerResume,
    PeerSetup,
    PeerTakeover,
)
from commd_protocol.address import split_host_port
from commd_protocol.checks import address_problem, roster_problem
from commd_protocol.status import JobState

log = logging.getLogger("commd.jobs")

MAX_CHANGE_CHARS = 2000  # of the coordinator's words on a change, kept and passed on
MAX_CHANGES_KEPT = 64
# How Gloo words a peer whose process is gone (its connections reset or closed), as opposed
# to one out of reach (a timeout): the coordinator may then take a node that does not answer
# as dead, not as cut off (``TolerantCoordination._lose``).
_PEER_CLOSED = re.compile(r"connection (reset|closed) by peer|broken pipe|end of file",
                          re.IGNORECASE)


class JobSide(Protocol):
    """What a membership change asks of its job (``Job``): what it reads, and the steps that
    change the job, each a method of the job."""

    @property
    def state(self) -> JobState: ...

    @property
    def tolerant_pipeline(self) -> TolerantPipeline | None: ...

    @property
    def setup(self) -> PeerSetup | None: ...

    @property
    def ops(self) -> BufferOps | None: ...

    @property
    def plans_kept(self) -> list[PeerPlan]: ...

    def stop_data_plane(self) -> tuple[int, bool]:
        """Running → reforming: the data plane suspended, the engine let go; returns the
        iterations delivered and whether the current one waits only for its commit."""
        ...

    def run_in_epoch(self, engine: Engine | None, place: PeerSetup) -> None:
        """Reforming → running with the new epoch's engine and place."""
        ...

    async def start_as_joiner(self, place: PeerSetup) -> bool:
        """Joining → starting a running job at ``place``; whether it is set up."""
        ...

    def fail(self, code: ErrorCode, message: str, *, tell_coordinator: bool = True) -> None: ...

    def join_request(self, *, replacements: bool = False) -> PeerJoin: ...

    def welcome(self, member: LocalRank, message: PeerResume) -> None: ...

    def on_plan(self, decision: PeerPlan) -> None: ...

    def heard_from_coordinator(self) -> None: ...


class Membership:
    """The membership of one job on this node and the steps of its changes."""

    def __init__(self, job_id: str, world_size: int, coordinator: str, ctx: JobContext,
                 members: Members, job: JobSide) -> None:
        self.id = job_id
        self.world_size = world_size  # the job's first world size
        self.coordinator = coordinator  # the launch-time address until a takeover
        self.epochs = Epochs()
        self._ctx = ctx
        self._members = members
        self._job = job
        self.plans_waiting: list[PeerPlan] = []  # plans that came before a joiner's pipeline

    @property
    def coordinator_host(self) -> str:
        return split_host_port(self.coordinator)[0]

    def _send(self, message: msgspec.Struct) -> None:
        self._ctx.send_peer(self.coordinator, message)

    def _stand(self, pipeline: TolerantPipeline) -> tuple[int, bool]:
        """Stopped (now, if it still ran): iterations delivered, and whether the current one
        waits only for its commit."""
        if self._job.state is JobState.RUNNING:
            return self._job.stop_data_plane()
        return pipeline.iteration, pipeline.committing

    # --- faults seen on this node ----------------------------------------------------------------

    def on_collective_failure(self, problem: BaseException) -> None:
        """A collective failed (a peer vanished?): stop and tell the coordinator, which reforms
        the job; nothing fails here."""
        if self._job.state is not JobState.RUNNING:
            return  # stopped already: an abandoned collective's late failure
        self._job.stop_data_plane()
        log.warning("job %s: a collective failed in epoch %d (%s); waiting for the coordinator",
                    self.id, self.epochs.epoch, problem)
        words = str(problem)
        closed = _PEER_CLOSED.search(words) is not None
        self.epochs.crash_seen = self.epochs.crash_seen or closed
        self._send(PeerFault(job=self.id, epoch=self.epochs.epoch,
                             message=words[:MAX_CHANGE_CHARS], closed=closed))

    def on_local_loss(self, local_index: int, rank: int, why: str) -> None:
        """A local rank is gone while others of this node live: stop, go on without it (zeros
        for its gradients), and ask the coordinator for the change."""
        pipeline = self._job.tolerant_pipeline
        assert pipeline is not None
        if self._job.state is JobState.RUNNING:
            self._job.stop_data_plane()
        pipeline.drop_local(local_index)
        log.warning("job %s: rank %d is gone (%s); this node goes on without it", self.id, rank,
                    why)
        self._send(PeerFault(job=self.id, epoch=self.epochs.latest,
                             message=why[:MAX_CHANGE_CHARS], lost_ranks=[rank]))

    # --- a change the coordinator runs -----------------------------------------------------------

    def on_reform(self, message: PeerReform) -> None:
        """The coordinator starts epoch ``message.epoch``: stop, and say where we stand."""
        epochs, state = self.epochs, self._job.state
        if message.epoch <= epochs.latest:
            return  # an old or repeated change
        self._ctx.membership_changing(self.id, message.epoch)
        if state is JobState.JOINING:  # it joins the running job in this change
            epochs.stopping_for = message.epoch
            self._send(PeerReformState(job=self.id, epoch=message.epoch, delivered=0,
                                       joining=True))
            return
        if state is JobState.STARTING:
            self._job.fail(ErrorCode.RANK_LOST, f"a node was lost while the job started: "
                           f"{message.change[:MAX_CHANGE_CHARS]}")
            return
        pipeline = self._job.tolerant_pipeline
        if state not in (JobState.RUNNING, JobState.REFORMING) or pipeline is None:
            return
        delivered, committing = self._stand(pipeline)
        epochs.stopping_for = message.epoch
        self._send(PeerReformState(job=self.id, epoch=message.epoch, delivered=delivered,
                                   committing=committing))

    def resume_problem(self, message: PeerResume) -> str:
        """'' when a resume fits this node's job, else what is wrong with it."""
        state, epochs = self._job.state, self.epochs
        stopped = state in (JobState.REFORMING, JobState.JOINING)
        # a new coordinator chooses its epoch: any later one will do
        awaited = (message.epoch > epochs.epoch if epochs.taking_over
                   else message.epoch == epochs.stopping_for)
        if not stopped or not awaited:
            return (f"a resume for epoch {message.epoch} while the job is {state} "
                    f"(stopped for epoch {epochs.stopping_for})")
        if not 0 <= message.node_index < message.nodes:
            return f"node index {message.node_index} of {message.nodes} nodes"
        if not message.members or message.members != sorted(set(message.members)):
            return "its ranks must be distinct and sorted"
        if message.members[0] < 0 or message.members[-1] >= self.world_size:
            return f"its ranks must lie in 0..{self.world_size - 1}"
        return roster_problem(message.roster, message.nodes, self.world_size)

    def on_resume(self, message: PeerResume) -> Coroutine[Any, Any, None] | None:
        """Check a resume where it stands on the wire, then hand back what joins the new
        epoch (its engine forms asynchronously, so it runs as a task); None when there is
        nothing to run. The check cannot wait for the task: the coordinator may fold this
        change into a later one at once, and that later reform, handled as it arrives, would
        make this resume look out of turn and fail the job."""
        problem = self.resume_problem(message)
        if problem:
            if self._job.state in (JobState.REFORMING, JobState.JOINING):
                self._job.fail(ErrorCode.INVALID, f"the coordinator sent a bad resume: {problem}")
            return None
        return self._enter_epoch(message)

    async def _enter_epoch(self, message: PeerResume) -> None:
        """Join the new epoch's group and go on from the coordinator's iteration."""
        job = self._job
        if self.resume_problem(message):
            return  # a later change began before this task ran: its own resume follows
        if job.state is JobState.JOINING:
            await self._join_running(message)
            return
        assert job.setup is not None
        place = msgspec.structs.replace(job.setup, node_index=message.node_index,
                                        nodes=message.nodes, store_port=message.store_port,
                                        store_prefix=message.store_prefix,
                                        generation=job.setup.generation)
        engine: Engine | None = None
        if message.nodes > 1:
            assert job.ops is not None
            try:
                engine = await set_up.start_engine(self._ctx, self.coordinator_host, self.id,
                                                   job.ops, place)
            except set_up.SetupError as exc:
                if job.state is JobState.REFORMING and not self.resume_problem(message):
                    self._send(PeerFault(job=self.id, epoch=message.epoch,
                                         message=str(exc)[:MAX_CHANGE_CHARS]))
                return
        if job.state is not JobState.REFORMING or self.resume_problem(message):
            if engine is not None:  # failed, closed or changed again while the group formed
                engine.close()
            return
        pipeline = job.tolerant_pipeline
        assert pipeline is not None
        taken_in = [m for m in self._members.ranks.values()
                    if m.rejoining and m.rank in message.members]
        order = self._members.in_order()
        try:
            # Replacements first: the iteration the resume runs counts their gradients.
            for member in taken_in:
                if not member.left:
                    pipeline.readmit(order.index(member), member.buffer)
            # Delivers the iteration committed in the old epoch (its Done tells the old epoch).
            pipeline.resume(engine=engine, node_index=message.node_index, nodes=message.nodes,
                            world_size=len(message.members), iteration=message.iteration)
        except ResumeError as exc:
            if engine is not None:
                engine.close()
            job.fail(ErrorCode.INVALID, str(exc))
            return
        job.run_in_epoch(engine, place)
        arrived = [m for m in taken_in if not m.left]
        self._enter(message, local_joiners=[m.rank for m in arrived])
        for member in arrived:
            job.welcome(member, message)
        for member in taken_in:
            if member.left:  # taken in, but gone before the change was through: lost again
                member.rejoining = False
                self.on_local_loss(order.index(member), member.rank,
                                   f"replacement rank {member.rank} left before it joined")
        # replacements that registered while the change ran (none while another change begins)
        self.ask_to_rejoin()

    async def _join_running(self, message: PeerResume) -> None:
        """This node joins the running job at ``message.iteration``: set up as a formed job
        would be, minus the probe; the plans in force follow, and the first starts it."""
        registration = self._members.first_registration()
        place = PeerSetup(job=self.id, generation=message.epoch, node_index=message.node_index,
                          nodes=message.nodes, store_port=message.store_port,
                          planner=registration.planner, store_prefix=message.store_prefix)
        if not await self._job.start_as_joiner(place):
            return
        pipeline = self._job.tolerant_pipeline
        assert pipeline is not None
        pipeline.join_at(message.iteration, world_size=len(message.members),
                         expect=message.expect)
        self.epochs.source = message.source
        self._enter(message, "joined")
        waiting, self.plans_waiting = self.plans_waiting, []
        for plan in waiting:  # the first starts the job
            self._job.on_plan(plan)

    def keep_early_plan(self, decision: PeerPlan) -> None:
        """A plan for a node joining a running job, come before its pipeline (the plans in
        force follow its resume while its engine still forms): kept for ``_join_running``."""
        self.plans_waiting = [*self.plans_waiting[-7:], decision]

    def _enter(self, message: PeerResume, kind: str = "",
               local_joiners: list[int] | None = None) -> None:
        """The node runs in ``message``'s epoch now: record it and say so. ``kind`` for the
        metrics: "joined" when ranks came in (given by a joining node, whose own arrival it
        is), else "lost". ``local_joiners``: replacements on this node taken in by the change
        (they hear of it in their ``Registered``, not here)."""
        change = message.change[:MAX_CHANGE_CHARS]
        epochs = self.epochs
        before = set(epochs.members) if epochs.epoch else set(range(self.world_size))
        joined = sorted(set(message.members) - before)
        kind = kind or ("joined" if joined else "lost")
        if joined and before & set(message.members) and self._job.state is JobState.RUNNING:
            # This node was in the job: its ranks hear of the joiners, the lowest old one
            # gives them the training state.
            notice = Joining(epoch=message.epoch, ranks=joined, iteration=message.iteration,
                             source=min(before & set(message.members)),
                             local=sorted(local_joiners or []), coordinator=self.coordinator)
            for member in self._members.ranks.values():
                if not member.left and not member.rejoining:
                    self._ctx.send_client(member.identity, notice)
        epochs.epoch, epochs.members, epochs.stopping_for = message.epoch, message.members, 0
        if epochs.taking_over:  # resumed by the successor: the takeover went through
            for lost in epochs.given_up:  # (one that fails leaves nothing to follow)
                self._ctx.successions.record(self.id, lost, self.coordinator)
        epochs.roster, epochs.taking_over, epochs.crash_seen = message.roster, False, False
        epochs.dead = []  # of the old roster: an address may hold a fresh daemon later
        epochs.changes = [*epochs.changes,
                          (message.epoch, message.members, change)][-MAX_CHANGES_KEPT:]
        if self._ctx.on_membership_change is not None:
            self._ctx.on_membership_change(self.id, kind)
        pipeline = self._job.tolerant_pipeline
        if pipeline is not None and pipeline.trace is not None:  # `commd trace` armed: marked
            pipeline.trace.membership(message.epoch, message.members, change,
                                      (message.node_index, message.nodes), message.iteration)
        log.warning("job %s: epoch %d: %s; node %d of %d, %d rank(s), from iteration %d",
                    self.id, message.epoch, change, message.node_index, message.nodes,
                    len(message.members), message.iteration)

    # --- replacements ----------------------------------------------------------------------------

    def ask_to_rejoin(self) -> None:
        """Ask the coordinator to take in the replacements registered here, once this node
        runs in an epoch without their ranks (the loss each replaces is through: a rank the
        coordinator still counts cannot be joined), else after the change under way."""
        pending = [m for m in self._members.ranks.values()
                   if m.rejoining and not m.left and not m.rejoin_asked and m.registration]
        if not pending or self._job.state is not JobState.RUNNING or self.epochs.stopping_for:
            return
        current = (set(self.epochs.members) if self.epochs.epoch
                   else set(range(self.world_size)))
        if any(member.rank in current for member in pending):
            return
        for member in pending:
            member.rejoin_asked = True
        log.warning("job %s: replacement rank(s) %s registered here; asking to take them in",
                    self.id, sorted(m.rank for m in pending))
        self._send(self._job.join_request(replacements=True))

    # --- the coordinator lost --------------------------------------------------------------------

    def redirect(self, coordinator: str) -> bool:
        """The daemon this node asked to join at started after the job was taken over there
        (a fresh daemon where the lost coordinator ran) and names the successor: this node
        asks there from now on. False, and nothing changes, for an address that is not one or
        is ours already."""
        problem = address_problem("a redirect's coordinator", coordinator)
        if problem or coordinator == self.coordinator:
            log.warning("job %s: ignoring a redirect from %s: %s", self.id, self.coordinator,
                        problem or "it names itself")
            return False
        lost, self.coordinator = self.coordinator, coordinator
        self._ctx.successions.record(self.id, lost, coordinator)
        log.warning("job %s: the daemon at %s started after the job was taken over; joining "
                    "the job where it runs now, at %s", self.id, lost, coordinator)
        return True

    def take_over(self, problem: str, *, crash: bool = False) -> bool:
        """The coordinator is lost: stop, and ask the roster's next node to coordinate (the
        node holding the lowest rank, past those given up on); False when there is none.
        ``crash``: its process is known to have ended (its link closed), not only silent."""
        pipeline = self._job.tolerant_pipeline
        if self._job.state not in (JobState.RUNNING, JobState.REFORMING) or pipeline is None:
            return False
        epochs = self.epochs
        gone = {*epochs.given_up, self.coordinator}
        successor = next((entry.peer for entry in sorted(epochs.roster,
                                                         key=lambda e: min(e.ranks))
                          if entry.peer and entry.peer not in gone), None)
        if successor is None:
            return False
        delivered, committing = self._stand(pipeline)
        pipeline.forget_expected_decisions()
        self._ctx.membership_changing(self.id, epochs.latest + 1)
        lost, self.coordinator = self.coordinator, successor
        epochs.given_up = [*epochs.given_up, lost][-MAX_CHANGES_KEPT:]
        if crash:
            epochs.dead = [*epochs.dead, lost][-MAX_CHANGES_KEPT:]
        epochs.taking_over = True
        epochs.crash_seen = epochs.crash_seen or crash
        self._job.heard_from_coordinator()  # the new coordinator's silence counts from now
        log.warning("job %s: %s; asking %s to coordinate", self.id, problem, successor)
        self._send(PeerTakeover(
            job=self.id, epoch=epochs.latest, delivered=delivered,
            committing=committing, join=self._job.join_request(), roster=epochs.roster,
            lost=lost, plan=pipeline.plan.version if pipeline.plan else 0,
            crash=epochs.crash_seen, plans=list(self._job.plans_kept),
            dead=[address for address in epochs.dead
                  if any(entry.peer == address for entry in epochs.roster)]))
        return True


def stamp(done: Done, epochs: Epochs, told: int, ran_in: int) -> int:
    """Put the epoch ``ran_in`` on a Done (its ranks and what changed, for a rank last told
    ``told``); the epoch the rank has now been told."""
    if ran_in == 0 or not epochs.members_of(ran_in):  # epoch 0, or one no longer kept
        return told
    done.epoch = ran_in
    if told < ran_in:
        done.members = epochs.members_of(ran_in)
        done.change = epochs.words_since(told, ran_in)
    return max(told, ran_in)
