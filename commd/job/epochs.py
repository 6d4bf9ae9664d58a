"""A tolerant job's membership epochs on this node: stop for a change, answer where the
iteration stands, go on in the new epoch (``commd.coordinator.membership`` decides; this
carries it out). Only jobs registered with ``fault_tolerance="continue"`` get here.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Coroutine
from typing import Any, Protocol

import msgspec

from commd.engines import Engine
from commd.engines.buffer_ops import BufferOps
from commd.job import setup as set_up
from commd.job.members import Members
from commd.job.pipeline import Pipeline
from commd.job.state import Epochs, JobContext, Liveness, LocalRank
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
from commd_protocol.checks import roster_problem
from commd_protocol.status import JobState

log = logging.getLogger("commd.jobs")

MAX_CHANGE_CHARS = 2000  # of the coordinator's words on a change, kept and passed on
MAX_CHANGES_KEPT = 64
# How Gloo words a peer whose process is gone (its connections reset or closed), as opposed
# to one out of reach (a timeout): the coordinator may then take a node that does not answer
# as dead, not as cut off (``TolerantCoordination._lose``).
_PEER_CLOSED = re.compile(r"connection (reset|closed) by peer|broken pipe|end of file",
                          re.IGNORECASE)


class Tolerant(Protocol):
    """What the epochs need of the job (``Job``; a protocol, not an import)."""

    id: str
    ctx: JobContext
    coordinator: str
    world_size: int  # the job's first world size
    ops: BufferOps | None
    members: Members
    state: JobState
    setup: PeerSetup | None
    engine: Engine | None
    pipeline: Pipeline | None
    epochs: Epochs

    @property
    def coordinator_host(self) -> str: ...

    def fail(self, code: ErrorCode, message: str, *, tell_coordinator: bool = True) -> None: ...

    def join_request(self, *, replacements: bool = False) -> PeerJoin: ...

    def welcome(self, member: LocalRank, message: PeerResume) -> None: ...


def _pipeline(job: Tolerant) -> TolerantPipeline | None:
    return job.pipeline if isinstance(job.pipeline, TolerantPipeline) else None


def _stop(job: Tolerant) -> tuple[int, bool]:
    """Stop the data plane and let the engine go (a collective stuck on the lost peer keeps
    its old group alive until Gloo gives up on it, see GlooEngine.close)."""
    pipeline = _pipeline(job)
    assert pipeline is not None
    state = pipeline.suspend()
    if job.engine is not None:
        job.engine.close()
        job.engine = None
    job.state = JobState.REFORMING
    return state


def _stand(job: Tolerant, pipeline: TolerantPipeline) -> tuple[int, bool]:
    """Stopped (now, if it still ran): iterations delivered, and whether the current one
    waits only for its commit."""
    if job.state is JobState.RUNNING:
        return _stop(job)
    return pipeline.iteration, pipeline.committing


def on_collective_failure(job: Tolerant, problem: BaseException) -> None:
    """A collective failed (a peer vanished?): stop and tell the coordinator, which reforms
    the job; nothing fails here."""
    if job.state is not JobState.RUNNING:
        return  # stopped already: an abandoned collective's late failure
    _stop(job)
    log.warning("job %s: a collective failed in epoch %d (%s); waiting for the coordinator",
                job.id, job.epochs.epoch, problem)
    words = str(problem)
    closed = _PEER_CLOSED.search(words) is not None
    job.epochs.crash_seen = job.epochs.crash_seen or closed
    job.ctx.send_peer(job.coordinator, PeerFault(
        job=job.id, epoch=job.epochs.epoch, message=words[:MAX_CHANGE_CHARS], closed=closed))


def on_local_loss(job: Tolerant, local_index: int, rank: int, why: str) -> None:
    """A local rank is gone while others of this node live: stop, go on without it (zeros
    for its gradients), and ask the coordinator for the change."""
    pipeline = _pipeline(job)
    assert pipeline is not None
    if job.state is JobState.RUNNING:
        _stop(job)
    pipeline.drop_local(local_index)
    log.warning("job %s: rank %d is gone (%s); this node goes on without it", job.id, rank, why)
    job.ctx.send_peer(job.coordinator, PeerFault(
        job=job.id, epoch=max(job.epochs.epoch, job.epochs.stopping_for),
        message=why[:MAX_CHANGE_CHARS], lost_ranks=[rank]))


def on_reform(job: Tolerant, message: PeerReform) -> None:
    """The coordinator starts epoch ``message.epoch``: stop, and say where we stand."""
    if message.epoch <= max(job.epochs.epoch, job.epochs.stopping_for):
        return  # an old or repeated change
    if job.state is JobState.JOINING:  # it joins the running job in this change
        job.epochs.stopping_for = message.epoch
        job.ctx.send_peer(job.coordinator, PeerReformState(
            job=job.id, epoch=message.epoch, delivered=0, joining=True))
        return
    if job.state is JobState.STARTING:
        job.fail(ErrorCode.RANK_LOST, f"a node was lost while the job started: "
                 f"{message.change[:MAX_CHANGE_CHARS]}")
        return
    if job.state not in (JobState.RUNNING, JobState.REFORMING) or _pipeline(job) is None:
        return
    pipeline = _pipeline(job)
    assert pipeline is not None
    delivered, committing = _stand(job, pipeline)
    job.epochs.stopping_for = message.epoch
    job.ctx.send_peer(job.coordinator, PeerReformState(
        job=job.id, epoch=message.epoch, delivered=delivered, committing=committing))


def resume_problem(job: Tolerant, message: PeerResume) -> str:
    """'' when a resume fits this node's job, else what is wrong with it."""
    stopped = job.state in (JobState.REFORMING, JobState.JOINING)
    # a new coordinator chooses its epoch: any later one will do
    awaited = (message.epoch > job.epochs.epoch if job.epochs.taking_over
               else message.epoch == job.epochs.stopping_for)
    if not stopped or not awaited:
        return (f"a resume for epoch {message.epoch} while the job is {job.state} "
                f"(stopped for epoch {job.epochs.stopping_for})")
    if not 0 <= message.node_index < message.nodes:
        return f"node index {message.node_index} of {message.nodes} nodes"
    if not message.members or message.members != sorted(set(message.members)):
        return "its ranks must be distinct and sorted"
    if message.members[0] < 0 or message.members[-1] >= job.world_size:
        return f"its ranks must lie in 0..{job.world_size - 1}"
    return roster_problem(message.roster, message.nodes, job.world_size)


def on_resume(job: JoiningJob, message: PeerResume) -> Coroutine[Any, Any, None] | None:
    """Check a resume where it stands on the wire, then hand back what joins the new epoch
    (its engine forms asynchronously, so it runs as a task); None when there is nothing to
    run. The check cannot wait for the task: the coordinator may fold this change into a
    later one at once, and that later reform, handled as it arrives, would make this
    resume look out of turn and fail the job."""
    problem = resume_problem(job, message)
    if problem:
        if job.state in (JobState.REFORMING, JobState.JOINING):
            job.fail(ErrorCode.INVALID, f"the coordinator sent a bad resume: {problem}")
        return None
    return _enter_epoch(job, message)


async def _enter_epoch(job: JoiningJob, message: PeerResume) -> None:
    """Join the new epoch's group and go on from the coordinator's iteration."""
    if resume_problem(job, message):
        return  # a later change began before this task ran: its own resume follows
    if job.state is JobState.JOINING:
        await _join_running(job, message)
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
            engine = await set_up.start_engine(job.ctx, job.coordinator_host, job.id, job.ops,
                                               place)
        except set_up.SetupError as exc:
            if job.state is JobState.REFORMING and not resume_problem(job, message):
                job.ctx.send_peer(job.coordinator, PeerFault(
                    job=job.id, epoch=message.epoch, message=str(exc)[:MAX_CHANGE_CHARS]))
            return
    if job.state is not JobState.REFORMING or resume_problem(job, message):
        if engine is not None:  # failed, closed or changed again while the group formed
            engine.close()
        return
    pipeline = _pipeline(job)
    assert pipeline is not None and job.pipeline is not None
    taken_in = [m for m in job.members.ranks.values()
                if m.rejoining and m.rank in message.members]
    order = job.members.in_order()
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
    job.engine, job.setup, job.state = engine, place, JobState.RUNNING
    arrived = [m for m in taken_in if not m.left]
    _enter(job, message, local_joiners=[m.rank for m in arrived])
    for member in arrived:
        job.welcome(member, message)
    for member in taken_in:
        if member.left:  # taken in, but gone before the change was through: lost again
            member.rejoining = False
            on_local_loss(job, order.index(member), member.rank,
                          f"replacement rank {member.rank} left before it joined")
    # replacements that registered while the change ran (none while another change begins)
    ask_to_rejoin(job)


def ask_to_rejoin(job: Tolerant) -> None:
    """Ask the coordinator to take in the replacements registered here, once this node runs
    in an epoch without their ranks (the loss each replaces is through: a rank the
    coordinator still counts cannot be joined), else after the change under way."""
    pending = [m for m in job.members.ranks.values()
               if m.rejoining and not m.left and not m.rejoin_asked and m.registration]
    if not pending or job.state is not JobState.RUNNING or job.epochs.stopping_for:
        return
    current = set(job.epochs.members) if job.epochs.epoch else set(range(job.world_size))
    if any(member.rank in current for member in pending):
        return
    for member in pending:
        member.rejoin_asked = True
    log.warning("job %s: replacement rank(s) %s registered here; asking to take them in",
                job.id, sorted(m.rank for m in pending))
    job.ctx.send_peer(job.coordinator, job.join_request(replacements=True))


class JoiningJob(set_up.Starting, Tolerant, Protocol):
    """What joining a running job needs of the job: both of the above, and its plans."""

    plans_waiting: list[PeerPlan]

    def on_plan(self, decision: PeerPlan) -> None: ...


async def _join_running(job: JoiningJob, message: PeerResume) -> None:
    """This node joins the running job at ``message.iteration``: set up as a formed job
    would be, minus the probe; the plans in force follow, and the first starts it."""
    registration = job.members.first_registration()
    place = PeerSetup(job=job.id, generation=message.epoch, node_index=message.node_index,
                      nodes=message.nodes, store_port=message.store_port,
                      planner=registration.planner, store_prefix=message.store_prefix)
    job.state, job.setup = JobState.STARTING, place
    try:
        await set_up.set_up_joiner(job, place)
    except set_up.SetupError as exc:
        job.fail(ErrorCode.ENGINE, str(exc))
        return
    pipeline = _pipeline(job)
    if not job.starting or pipeline is None:
        return
    pipeline.join_at(message.iteration, world_size=len(message.members), expect=message.expect)
    job.epochs.source = message.source
    _enter(job, message, "joined")
    waiting, job.plans_waiting = job.plans_waiting, []
    for plan in waiting:  # the first starts the job
        job.on_plan(plan)


def _enter(job: Tolerant, message: PeerResume, kind: str = "",
           local_joiners: list[int] | None = None) -> None:
    """The node runs in ``message``'s epoch now: record it and say so. ``kind`` for the
    metrics: "joined" when ranks came in (given by a joining node, whose own arrival it is),
    else "lost". ``local_joiners``: replacements on this node taken in by the change (they
    hear of it in their ``Registered``, not here)."""
    change = message.change[:MAX_CHANGE_CHARS]
    epochs = job.epochs
    before = set(epochs.members) if epochs.epoch else set(range(job.world_size))
    joined = sorted(set(message.members) - before)
    kind = kind or ("joined" if joined else "lost")
    if joined and before & set(message.members) and job.state is JobState.RUNNING:
        # This node was in the job: its ranks hear of the joiners, the lowest old one
        # gives them the training state.
        notice = Joining(epoch=message.epoch, ranks=joined, iteration=message.iteration,
                         source=min(before & set(message.members)),
                         local=sorted(local_joiners or []))
        for member in job.members.ranks.values():
            if not member.left and not member.rejoining:
                job.ctx.send_client(member.identity, notice)
    epochs.epoch, epochs.members, epochs.stopping_for = message.epoch, message.members, 0
    epochs.roster, epochs.taking_over, epochs.crash_seen = message.roster, False, False
    epochs.changes = [*epochs.changes,
                      (message.epoch, message.members, change)][-MAX_CHANGES_KEPT:]
    if job.ctx.on_membership_change is not None:
        job.ctx.on_membership_change(job.id, kind)
    pipeline = _pipeline(job)
    if pipeline is not None and pipeline.trace is not None:  # `commd trace` armed: marked
        pipeline.trace.membership(message.epoch, message.members, change,
                                  (message.node_index, message.nodes), message.iteration)
    log.warning("job %s: epoch %d: %s; node %d of %d, %d rank(s), from iteration %d", job.id,
                message.epoch, change, message.node_index, message.nodes,
                len(message.members), message.iteration)


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


def take_over(job: TakingOver, problem: str) -> bool:
    """The coordinator is silent: stop, and ask the roster's next node to coordinate (the
    node holding the lowest rank, past those given up on); False when there is none."""
    if job.state not in (JobState.RUNNING, JobState.REFORMING) or _pipeline(job) is None:
        return False
    epochs = job.epochs
    gone = {*epochs.given_up, job.coordinator}
    successor = next((entry.peer for entry in sorted(epochs.roster, key=lambda e: min(e.ranks))
                      if entry.peer and entry.peer not in gone), None)
    if successor is None:
        return False
    pipeline = _pipeline(job)
    assert pipeline is not None
    delivered, committing = _stand(job, pipeline)
    pipeline.forget_expected_decisions()
    lost, job.coordinator = job.coordinator, successor
    epochs.given_up = [*epochs.given_up, lost][-MAX_CHANGES_KEPT:]
    epochs.taking_over = True
    job.liveness.heard_at = time.monotonic()  # the new coordinator's silence counts from now
    log.warning("job %s: %s; asking %s to coordinate", job.id, problem, successor)
    job.ctx.send_peer(successor, PeerTakeover(
        job=job.id, epoch=max(epochs.epoch, epochs.stopping_for), delivered=delivered,
        committing=committing, join=job.join_request(), roster=epochs.roster, lost=lost,
        plan=pipeline.plan.version if pipeline.plan else 0, crash=epochs.crash_seen,
        plans=list(job.plans_kept)))
    return True


class TakingOver(Tolerant, Protocol):
    """What a takeover needs of the job besides the epochs' own."""

    liveness: Liveness
    plans_kept: list[PeerPlan]
