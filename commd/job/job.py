"""One job on this node: its state machine, from the first hello to the last goodbye.

forming (ranks say hello and register) → joining (the coordinator gathers every node) →
starting (engine, device, probe: ``setup``) → running (the pipeline) → failed or closed.
The parts live beside this module: the local ranks (``members``), the checks (``validation``),
the buffers (``buffers``), the data plane (``pipeline``), the reports (``reporting``). A job
never touches another job's state, so one daemon serves many jobs in isolation.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Coroutine
from typing import Any

import msgspec

from commd.engines import Engine
from commd.engines.buffer_ops import BufferOps
from commd.job import buffers, replies, setup, validation
from commd.job.lifecycle import Lifecycle
from commd.job.members import Members
from commd.job.membership import Membership, stamp
from commd.job.pipeline import Pipeline, PipelineSnapshot, Plan, ReadyError, make_plan
from commd.job.reporting import Reporter, job_status, join_request
from commd.job.state import Epochs, JobContext, JobError, JobState, Liveness, LocalRank
from commd.job.tolerant import TolerantPipeline
from commd.job.trace import TraceRecorder
from commd_protocol import (
    Error,
    ErrorCode,
    Hello,
    PeerAbort,
    PeerJoin,
    PeerLeave,
    PeerPlan,
    PeerRedirect,
    PeerReform,
    PeerResume,
    PeerSetup,
    Register,
)
from commd_protocol.address import split_host_port
from commd_protocol.agreement import describe_difference
from commd_protocol.errors import prefixed
from commd_protocol.status import JobStatus

log = logging.getLogger("commd.jobs")


class Job:
    """One job on this node: the owner of its state (``Lifecycle``, moved only here), its
    local ranks (``Members``), its membership (``Membership``), and what set-up built: the
    engine, the data plane and its reporter."""

    def __init__(self, hello: Hello, context: JobContext) -> None:
        self.id = hello.job
        self.world_size = hello.world_size
        self.local_world_size = hello.local_world_size
        self.ctx = context
        self.members = Members(hello)
        self._life = Lifecycle(hello.job)
        self.failure: Error | None = None
        self.setup: PeerSetup | None = None
        self.engine: Engine | None = None
        self.pipeline: Pipeline | None = None
        self.ops: BufferOps | None = None  # how the data plane touches this job's buffers
        self.reporter: Reporter | None = None
        self.last_plan: PeerPlan | None = None
        # the latest decisions (``last_plan`` the last): a takeover hands them to the next
        # coordinator, which gives a later joiner the one in force
        self.plans_kept: list[PeerPlan] = []
        self.started = time.monotonic()  # the first hello: forming has a deadline (deadlines)
        self.liveness = Liveness()  # the coordinator's messages, the job-wide stall
        self.failed_at = 0.0
        # who coordinates (where the job was taken over from the address the ranks name, its
        # successor: a rank restarted with its launch-time environment), and under
        # fault_tolerance="continue" the epochs and their changes
        self.membership = Membership(self.id, self.world_size,
                                     context.successions.resolve(self.id, hello.coordinator),
                                     context, self.members, self)
        # a helper of another job's membership epoch (a state transfer): (job id, epoch)
        self.helper_of = (hello.parent, hello.parent_epoch) if hello.parent else None
        self._done_epoch = 0  # the epoch the last finished iteration ran in
        self._closed = False

    @property
    def state(self) -> JobState:
        return self._life.state

    def _move(self, to: JobState) -> JobState:
        """The one writer of the job's state (IllegalTransition for an edge the table does
        not hold); returns the state left."""
        return self._life.move(to)

    @property
    def coordinator(self) -> str:
        """The coordinator's peer address: the launch-time one until a takeover (or its
        successor's, for a job taken over before its ranks here started)."""
        return self.membership.coordinator

    @property
    def coordinator_host(self) -> str:
        return split_host_port(self.coordinator)[0]

    @property
    def epochs(self) -> Epochs:
        return self.membership.epochs

    @property
    def tolerant_pipeline(self) -> TolerantPipeline | None:
        return self.pipeline if isinstance(self.pipeline, TolerantPipeline) else None

    @property
    def starting(self) -> bool:
        return self.state is JobState.STARTING

    # --- forming ---------------------------------------------------------------------------------

    def add_rank(self, identity: bytes, hello: Hello) -> LocalRank:
        """A rank said hello. One that contradicts the ranks of a forming job fails the job
        at once (it could never form), naming both."""
        if self.state is JobState.FORMING:
            try:
                return self.members.add(identity, hello)
            except JobError as exc:
                if self.members.ranks:
                    self.fail(exc.code, str(exc))
                raise
        if self.state in (JobState.RUNNING, JobState.REFORMING) and self.epochs_enabled:
            # a replacement for a lost local rank; refused alone if it is none (the job runs on)
            return self.members.replace(identity, hello)
        if self.state is JobState.FAILED:
            self.members.check(hello)  # what made it fail may be the clearer message
        raise JobError(f"job {self.id!r} is already {self.state}; use a new job id for a new run",
                       ErrorCode.OUT_OF_ORDER)

    def register(self, member: LocalRank, message: Register, host_fd: int | None = None) -> None:
        """Attach the rank's buffer (a host buffer from the descriptor it handed over, which
        the caller closes); once every local rank is in, ask the coordinator to join."""
        if member.registration is not None:
            raise JobError("register sent twice", ErrorCode.OUT_OF_ORDER)
        if self.failure is not None:  # a failed job maps nothing more
            raise JobError(self.failure.message, ErrorCode(self.failure.code))
        if member.rejoining:
            self._register_replacement(member, message, host_fd)
            return
        if self.state is not JobState.FORMING:
            raise JobError(f"register but job {self.id!r} is already {self.state}",
                           ErrorCode.OUT_OF_ORDER)
        self._attach(member, self._checked(message), host_fd)
        problem = self.members.disagreement(member)
        if problem:
            self.fail(ErrorCode.MISMATCH, problem)
            raise JobError(self.failure.message if self.failure else problem, ErrorCode.MISMATCH)
        if self.members.complete:
            self._join()

    def _register_replacement(self, member: LocalRank, message: Register,
                              host_fd: int | None) -> None:
        """A replacement's registration: it must match the live ranks here exactly (refused
        alone, naming the difference, otherwise: the job runs on); then the coordinator is
        asked to take it in at the next change."""
        message = self._checked(message)
        live = self.members.live_registration()
        problem = "no live rank of it is left on this node" if live is None \
            else describe_difference(live, message)
        if problem:
            raise JobError(f"rank {member.rank} does not fit the running job {self.id!r}: "
                           f"{problem}", ErrorCode.MISMATCH)
        self._attach(member, message, host_fd)
        self.membership.ask_to_rejoin()

    def _checked(self, message: Register) -> Register:
        """``message`` with the daemon's default planner where it names none; JobError when
        it does not pass the checks of a registration."""
        if not message.planner:
            message = msgspec.structs.replace(message, planner=self.ctx.default_planner)
        validation.check_register(message, self.ctx,
                                  several_nodes=self.world_size > self.local_world_size,
                                  world_size=self.world_size)
        return message

    def _attach(self, member: LocalRank, message: Register, host_fd: int | None) -> None:
        """Map the rank's buffer and record its registration."""
        total = sum(layer.size for layer in message.layers)
        try:
            self.ops = buffers.attach(self.ops, member, message, total, self.ctx.timeout_s, host_fd)
        except buffers.AttachError as exc:
            raise JobError(str(exc)) from None
        member.registration = message

    def welcome(self, member: LocalRank, message: PeerResume) -> None:
        """A replacement taken in by the change ``message`` resumed: where the job stands, as
        a joining node's ranks hear it (and whether the rank giving it the state is here)."""
        assert self.pipeline is not None and self.setup is not None
        assert self.last_plan is not None
        member.rejoining = False
        reply = replies.registered(self.setup, self.last_plan, self.ops)
        reply.iteration, reply.epoch = self.pipeline.iteration, self.epochs.epoch
        reply.members, reply.source = self.epochs.members, message.source
        reply.source_local = any(m.rank == message.source and not m.left and not m.rejoining
                                 for m in self.members.ranks.values())
        reply.coordinator = self.coordinator
        member.told_plan, member.told_epoch = self.last_plan.version, self.epochs.epoch
        self.ctx.send_client(member.identity, reply)

    def _join(self) -> None:
        self._move(JobState.JOINING)
        self._ask_to_join()

    def _ask_to_join(self) -> None:
        """Send this node's join to the coordinator; the wait for its answer starts now."""
        self.liveness.joined_at = time.monotonic()
        self.ctx.send_peer(self.coordinator, self.join_request())

    def join_request(self, *, replacements: bool = False) -> PeerJoin:
        """This node's part of the job, as it asks the coordinator to join (and, when the
        coordinator of a tolerant job is lost, asks the next one to take over; with
        ``replacements``, as it asks to take in replacements for ranks it lost)."""
        host = self.coordinator_host
        return join_request(self.id, self.world_size, self.members, self.ctx.advertise(host),
                            self.ctx.peer_address(host), replacements=replacements)

    # --- starting --------------------------------------------------------------------------------

    async def on_setup(self, message: PeerSetup) -> None:
        """The coordinator formed the job: set it up, report the probe, await the first plan."""
        if self.state is not JobState.JOINING:
            log.warning("job %s: ignoring set-up in state %s", self.id, self.state)
            return
        self.liveness.heard_at = time.monotonic()
        problem = validation.setup_problem(message)
        if problem:
            self.fail(ErrorCode.INVALID, f"the coordinator sent a bad set-up: {problem}")
            return
        self._move(JobState.STARTING)
        self.setup = message
        self.epochs.roster = message.roster
        if not await self._build(message):
            return
        assert self.ops is not None and self.reporter is not None
        samples: list[list[float]] = []
        if self.members.first_registration().profile:
            try:
                samples = await setup.probe_network(self.engine, self.ops)
            except setup.SetupError as exc:
                self.fail(ErrorCode.ENGINE, str(exc))
                return
            if not self.starting:
                return
        self.reporter.probe(samples)

    async def _build(self, place: PeerSetup) -> bool:
        """Set up engine, device and data plane for ``place`` and take them; False when the
        set-up failed (the job failed with it) or the job stopped starting meanwhile."""
        try:
            built = await setup.set_up(self, place)
        except setup.SetupError as exc:
            self.fail(ErrorCode.ENGINE, str(exc))
            return False
        if built is None:
            return False
        self.engine, self.pipeline, self.reporter = built.engine, built.pipeline, built.reporter
        return True

    async def start_as_joiner(self, place: PeerSetup) -> bool:
        """Joining → starting: this node joins a running tolerant job at ``place`` (set up as a
        formed job is, minus the probe: the job's link model is fitted already); whether it
        is set up and still starting."""
        self._move(JobState.STARTING)
        self.setup = place
        return await self._build(place) and self.starting

    def on_plan(self, decision: PeerPlan) -> None:
        """The coordinator's plan for a round; round 0's starts the job."""
        if self.pipeline is None and self.state in (JobState.JOINING, JobState.STARTING):
            # A node joining a running job gets the plans in force right after its resume,
            # while its engine still forms: they wait for its pipeline.
            self.membership.keep_early_plan(decision)
            return
        # A decision made while a membership change runs is kept too: it is the only copy
        # this node gets (the coordinator sends each once), and an iteration after the
        # resume may wait for it (this node reported its round).
        if self.pipeline is None or self.state not in (JobState.STARTING, JobState.RUNNING,
                                                       JobState.REFORMING):
            return
        self.liveness.heard_at = time.monotonic()
        problem = validation.plan_problem(decision, len(self.pipeline.sizes),
                                          self.pipeline.compression_spec)
        if problem:
            self.fail(ErrorCode.INVALID, f"the coordinator sent a bad plan: {problem}")
            return
        self.last_plan = decision
        self.plans_kept = [*self.plans_kept[-2:], decision]
        self.pipeline.schedule(
            decision.effective_iteration,
            make_plan(decision.version, decision.groups, self.pipeline.sizes,
                      decision.exchanges, decision.ratio,
                      (decision.alpha_s, decision.beta_s_per_byte)),
        )
        if self.state is JobState.STARTING:
            self._start_running(decision)

    def _start_running(self, decision: PeerPlan) -> None:
        assert self.pipeline is not None and self.setup is not None
        self.pipeline.start()
        self._move(JobState.RUNNING)
        reply = replies.registered(self.setup, decision, self.ops)
        if self.epochs.epoch:  # joined a running job: where it stands, and its members
            reply.iteration, reply.epoch = self.pipeline.iteration, self.epochs.epoch
            reply.members = self.epochs.members
            reply.source, reply.coordinator = self.epochs.source, self.coordinator
        for member in self.members.ranks.values():
            member.told_plan, member.told_epoch = decision.version, self.epochs.epoch
            self.ctx.send_client(member.identity, reply)
        log.info("job %s running: node %d of %d, %d local ranks, %d groups (%s)", self.id,
                 self.setup.node_index, self.setup.nodes, len(self.members.ranks),
                 len(decision.groups), self.setup.planner)

    # --- running ---------------------------------------------------------------------------------

    def _running(self, what: str) -> Pipeline:
        # While a tolerant job reforms its ranks go on marking and waiting: the iteration
        # runs (again) once the new epoch starts.
        if self.state not in (JobState.RUNNING, JobState.REFORMING) or self.pipeline is None:
            raise JobError(f"{what} before the job is formed (job {self.id!r} is {self.state})",
                           ErrorCode.OUT_OF_ORDER)
        return self.pipeline

    def ready(self, member: LocalRank, layers: list[int], sent_at: float = 0.0,
              stamps: list[float] | None = None) -> None:
        pipeline = self._running("ready")
        gone = self.members.gone()
        if gone and not self.epochs_enabled:  # a tolerant job went on without them
            who = f"rank {gone[0]}" if len(gone) == 1 else f"ranks {gone[:20]}"
            self.fail(ErrorCode.RANK_LOST, f"{who} closed its client; the job cannot go on")
            return
        try:
            pipeline.mark(member.local_rank, layers, sent_at, stamps)
        except ReadyError as exc:
            raise JobError(str(exc)) from None

    def wait(self, member: LocalRank, iteration: int) -> None:
        pipeline = self._running("wait")
        if iteration == pipeline.iteration:
            member.waiting = iteration
        elif iteration == pipeline.iteration - 1 and pipeline.done_plan is not None:
            # Finished already (the other local ranks' marks completed it): the plan it ran
            # with, not the one in force, which may have switched since.
            self._send_done(member, iteration, pipeline.done_plan, self._done_epoch)
        else:
            raise JobError(
                f"wait for iteration {iteration} but the job is at {pipeline.iteration}",
                ErrorCode.OUT_OF_ORDER,
            )

    def iteration_done(self, iteration: int, plan: Plan) -> None:
        """The pipeline finished ``iteration``: answer the ranks that wait for it."""
        assert self.pipeline is not None
        # The epoch it ran in, for a rank whose wait comes after a later change began.
        self._done_epoch = self.epochs.epoch
        for member in self.members.ranks.values():
            if member.waiting == iteration:
                member.waiting = None
                self._send_done(member, iteration, plan, self._done_epoch)

    def _send_done(self, member: LocalRank, iteration: int, plan: Plan, epoch: int) -> None:
        assert self.pipeline is not None
        reply = replies.done(self.pipeline, member, iteration, plan)
        member.told_epoch = stamp(reply, self.epochs, member.told_epoch, epoch)
        self.ctx.send_client(member.identity, reply)

    # --- membership epochs (fault_tolerance="continue") ------------------------------------------

    def on_collective_failure(self, problem: BaseException) -> None:
        """The data plane failed: a tolerant job waits for its coordinator's reform, any
        other fails."""
        if self.epochs_enabled:
            self.membership.on_collective_failure(problem)
        else:
            self.fail(ErrorCode.ENGINE, f"collective failed: {problem}")

    @property
    def epochs_enabled(self) -> bool:
        registration = self.members.any_registration()
        return registration is not None and registration.fault_tolerance == "continue"

    def on_reform(self, message: PeerReform) -> None:
        if self.epochs_enabled:
            self.membership.on_reform(message)

    def on_resume(self, message: PeerResume) -> Coroutine[Any, Any, None] | None:
        """Checked now, in the order the coordinator sent it; what joins the new epoch is
        handed back to run as a task (None: nothing to run)."""
        return self.membership.on_resume(message) if self.epochs_enabled else None

    # what a membership change asks of the job (``membership.JobSide``)

    def stop_data_plane(self) -> tuple[int, bool]:
        """Running → reforming: the data plane suspended and the engine let go (a collective
        stuck on the lost peer keeps its old group alive until Gloo gives up on it, see
        GlooEngine.close); the iterations delivered, and whether the current one waits only
        for its commit."""
        pipeline = self.tolerant_pipeline
        assert pipeline is not None
        stood = pipeline.suspend()
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        self._move(JobState.REFORMING)
        return stood

    def run_in_epoch(self, engine: Engine | None, place: PeerSetup) -> None:
        """Reforming → running, with the new epoch's engine and place."""
        self._move(JobState.RUNNING)
        self.engine, self.setup = engine, place

    def heard_from_coordinator(self) -> None:
        self.liveness.heard_at = time.monotonic()

    def trace(self, recorder: TraceRecorder) -> None:  # a TraceRequest; JobError unless running
        recorder.arm(self._running("trace"), self.members.first_registration(), self.setup)

    def on_redirect(self, message: PeerRedirect) -> None:
        """The coordinator this node asked started after the job was taken over elsewhere,
        and says where: while still joining, ask there (see ``commd.job.successions``)."""
        if self.state is JobState.JOINING and self.membership.redirect(message.coordinator):
            self._ask_to_join()

    # --- failure and departure -------------------------------------------------------------------

    def on_abort(self, message: PeerAbort) -> None:
        """The coordinator fails this node's part of the job. A drop (this node fell silent in
        a running tolerant job) that finds a job still forming or joining was meant for an
        earlier job of the same id here: queued while the node was cut off, it comes in
        after the link is back, when a replacement may have started. That one lives on."""
        if message.dropped and self.state in (JobState.FORMING, JobState.JOINING):
            log.warning("job %s: ignoring the coordinator's drop of this node's earlier job "
                        "of the same id: %s", self.id, message.message[:300])
            return
        code = ErrorCode(message.code) if message.code in ErrorCode._value2member_map_ \
            else ErrorCode.ENGINE
        self.fail(code, message.message, tell_coordinator=False)

    def fail(self, code: ErrorCode, message: str, *, tell_coordinator: bool = True) -> None:
        """Latch the failure, tell every local rank and (once) the coordinator."""
        if self.state in (JobState.FAILED, JobState.CLOSED):
            return
        previous = self._move(JobState.FAILED)
        self.failed_at = time.monotonic()
        text = prefixed(message, f"job {self.id!r}: ")
        self.failure = Error(code=code, message=text, fatal=True)
        log.error("%s", text)
        for member in self.members.ranks.values():
            if not member.left:
                self.ctx.send_client(member.identity, self.failure)
        if tell_coordinator and previous is not JobState.FORMING:
            self.ctx.send_peer(self.coordinator, PeerAbort(job=self.id, code=code, message=text))
        self._release_engine()
        self._release_buffers()  # a failed job computes nothing more

    def leave(self, member: LocalRank, *, lost: bool) -> None:
        """A rank said goodbye (lost=False) or its process vanished (lost=True)."""
        if member.left:
            return
        member.left = True
        if member.segment is not None:  # its memory goes now; the job cannot run on without it
            member.segment.close()
        if member.rejoining:  # a replacement not taken in yet: no epoch counted it (if the
            return  # change asked for takes it in, the resume loses it again: Membership)
        # the node goes on with its live ranks; replacements not yet taken in are not any
        others = [m for m in self.members.ranks.values() if not m.left and not m.rejoining]
        if self.epochs_enabled and others and self.pipeline is not None \
                and self.state in (JobState.RUNNING, JobState.REFORMING):
            why = (f"rank {member.rank} (pid {member.pid}) exited without closing its client"
                   if lost else f"rank {member.rank} closed its client")
            index = self.members.in_order().index(member)
            self.membership.on_local_loss(index, member.rank, why)
            return
        waiting = [m.rank for m in self.members.ranks.values() if m.rejoining and not m.left]
        if waiting and self.state.active:  # nothing left here to take them in
            self.fail(ErrorCode.RANK_LOST,
                      f"rank {member.rank}, the last live rank of this node, is gone before "
                      f"replacement(s) {waiting} were taken in: start them again, and they "
                      "join as a node of their own")
            return
        if lost and self.state.active:
            self.fail(
                ErrorCode.RANK_LOST,
                f"rank {member.rank} (pid {member.pid}) exited without closing its client; "
                "check that rank's log",
            )
        elif self.state is JobState.RUNNING and self._iteration_in_flight():
            self.fail(
                ErrorCode.RANK_LOST, f"rank {member.rank} closed in the middle of an iteration"
            )

    def _iteration_in_flight(self) -> bool:
        marked = self.pipeline is not None and self.pipeline.in_flight
        return marked or self.members.waiting()

    @property
    def finished(self) -> bool:
        return self.members.finished

    def close(self) -> None:
        """Stop everything this job started and unmap its buffers (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self.state.active:
            delivered = self.pipeline.iteration if self.pipeline is not None else -1
            self.ctx.send_peer(self.coordinator, PeerLeave(job=self.id, delivered=delivered))
        if self.state is not JobState.FAILED:
            self._move(JobState.CLOSED)
        self._release_engine()
        self._release_buffers()
        if self.ops is not None:
            self.ops.close()  # device: unmaps the ranks' buffers once the stream drained

    def _release_engine(self) -> None:
        if self.pipeline is not None:
            self.pipeline.stop()
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    def _release_buffers(self) -> None:
        """Unmap every rank's host buffer now (idempotent). The data plane may still hold
        views (a collective stuck on a dead peer may even write): SharedSegment.close makes
        that harmless. Dropping the pipeline's views lets the address ranges go too, without
        waiting for the garbage collector to break the pipeline's reference cycles."""
        if self.pipeline is not None:
            self.pipeline.release()
        for member in self.members.ranks.values():
            member.buffer = None
            if member.segment is not None:
                member.segment.close()

    def status(self) -> JobStatus:
        return job_status(
            job=self.id, state=self.state, world_size=self.world_size,
            local_ranks=sorted(r.rank for r in self.members.ranks.values()),
            registration=self.members.any_registration(), setup=self.setup,
            decision=self.last_plan,
            run=self.pipeline.snapshot() if self.pipeline else PipelineSnapshot(),
            reporter=self.reporter,
            error=self.failure.message if self.failure else None,
            stall=(self.liveness.stall, self.liveness.stall_s),
            epochs=self.epochs,
        )
