"""A job's side of liveness, ticked every second by the daemon: heartbeats to its coordinator,
the coordinator's silence, and what its waiting ranks hear every few seconds.

A node whose coordinator has sent nothing for ``peer_timeout_s`` (or never answered its join
within CONNECT_S) fails the job on every local rank, naming the coordinator. A coordinator
whose process ended closes its connections: the link's close, while the coordinator was
still talking, is that death (``on_coordinator_closed``), acted on at once; silence alone
waits for the timeout, since nothing tells a crash from a cut-off there. A waiting rank
hears a ``progress`` message every BEAT_S: what the job waits for (who has not registered or
joined, a stall), who the job waits for (its timeout names them), and, by its arrival, that
its daemon is alive.
"""

from __future__ import annotations

from commd.job.job import Job
from commd.job.state import JobState
from commd_protocol import ErrorCode, PeerHeartbeat, PeerStatus, Progress
from commd_protocol.peer import MAX_WAITING_FOR_CHARS, NAME_UNMARKED_AFTER_S, describe_unmarked

BEAT_S = 2.0  # heartbeats to the coordinator, progress to waiting ranks
CONNECT_S = 5.0  # a coordinator that never answered by then is reported unreachable


def on_status(job: Job, message: PeerStatus, now: float) -> None:
    job.liveness.heard_at = now
    job.liveness.joined, job.liveness.stall = message.joined, message.stall
    job.liveness.stall_s, job.liveness.marks_pending = message.stall_s, message.marks_pending
    job.liveness.waiting_for = culprit_text(message.waiting_for)


def on_coordinator_closed(job: Job, now: float, heartbeat_timeout_s: float) -> None:
    """The link to the job's coordinator closed. Within ``heartbeat_timeout_s`` of its last
    message, that close is its daemon's process ending (a link dropped for silence closes
    only after that long without a word): a tolerant job turns to its roster's next node
    at once, as one that saw a crash; any other job fails, naming the coordinator. After
    longer silence the close says nothing new: the peer timeout decides."""
    if not job.state.active or now - job.liveness.heard_at >= heartbeat_timeout_s:
        return
    if _coordinated_here(job):
        return  # its own link is not the coordinator's life
    _coordinator_lost(job, f"the coordinator daemon at {job.coordinator} closed its "
                           "connection: its process ended (or restarted)", crash=True)


def awaits_successor(job: Job) -> bool:
    """Whether this tolerant job asked another node to take over and awaits its answer: then
    whether anything listens there is worth finding out (``on_successor_gone``). A job that
    is joining or forming waits as before: a daemon being started is not listening yet
    either."""
    return (job.state.active and job.epochs_enabled and job.epochs.taking_over
            and not _coordinated_here(job))


def on_successor_gone(job: Job) -> None:
    """Nothing listens at the address of the node this tolerant job asked to take over (a
    connection there was refused at once): its daemon died too, as when two daemons are
    killed together. The roster's next node is asked at once, this one counted dead, rather
    than after the peer timeout."""
    if awaits_successor(job):
        _coordinator_lost(job, f"nothing listens at {job.coordinator}, the node asked to "
                               "take over: its daemon is gone too", crash=True)


def _coordinated_here(job: Job) -> bool:
    """Whether this very daemon coordinates the job: if that is stalled or gone, so is the
    check."""
    return job.coordinator == job.ctx.peer_address(job.coordinator_host)


def _coordinator_lost(job: Job, problem: str, *, crash: bool) -> None:
    """A tolerant job asks the next node of its roster to coordinate; any other job, or one
    with no node left to ask, fails naming ``problem``."""
    if job.epochs_enabled and job.membership.take_over(problem, crash=crash):
        return
    job.fail(ErrorCode.RANK_LOST, problem)


def culprit_text(words: str) -> str:
    """What this node passes on to its waiting ranks of the coordinator's ``waiting_for``:
    every rank of the node gets it every BEAT_S, so a bounded prefix."""
    return words[:MAX_WAITING_FOR_CHARS]


def tick(job: Job, now: float, link: str) -> None:
    """``link``: the state of our link to the coordinator ("up", "connecting", "refused")."""
    live = job.liveness
    if job.state.active:
        problem = _coordinator_problem(job, now, link)
        if problem:
            _coordinator_lost(job, problem, crash=False)
            return
        if now - live.beat_at >= BEAT_S:
            live.beat_at = now
            job.ctx.send_peer(job.coordinator, heartbeat(job))
    waiting = [m for m in job.members.ranks.values() if not m.left and (
        m.waiting is not None or (m.registration is not None and
                                  job.state is not JobState.RUNNING))]
    if waiting and job.state is not JobState.FAILED:
        message = Progress(message=progress_message(job), stall=live.stall,
                           waiting_for=local_waiting_for(job) or live.waiting_for)
        for member in waiting:
            job.ctx.send_client(member.identity, message)


def _coordinator_problem(job: Job, now: float, link: str) -> str:
    live, address = job.liveness, job.coordinator
    if job.state is JobState.JOINING and link != "up" and now - live.joined_at > CONNECT_S:
        if link == "refused":
            return (f"the coordinator daemon at {address} refused this node's handshake: the "
                    "cluster keys differ (or only one of the daemons has one)")
        return (f"no commd daemon answers at {address} (peer port of the coordinator daemon): "
                "check COMMD_COORDINATOR / MASTER_ADDR and that its daemon runs")
    if _coordinated_here(job):
        return ""
    silent = now - max(live.heard_at, live.joined_at)
    if silent > job.ctx.peer_timeout_s:
        return (f"the coordinator daemon at {address} has sent nothing for {silent:.0f}s: it "
                "stopped, or the network to it is down")
    return ""


def heartbeat(job: Job) -> PeerHeartbeat:
    if job.pipeline is None:
        return PeerHeartbeat(job=job.id)
    waiting_s, missing, wire_s = job.pipeline.waiting()
    ranks = {m.local_rank: m.rank for m in job.members.ranks.values()}
    return PeerHeartbeat(job=job.id, iteration=job.pipeline.iteration, waiting_s=waiting_s,
                         missing=[[ranks[local], layer] for local, layer in missing],
                         wire_s=wire_s)


def local_waiting_for(job: Job) -> str:
    """This node's own ranks that it has waited for past NAME_UNMARKED_AFTER_S, in words.
    Preferred to the coordinator's: fresh, where those take a heartbeat and a status (up to
    2 x BEAT_S), and a rank of this node that has not marked is a culprit wherever others are."""
    if job.pipeline is None or job.setup is None:
        return ""
    waiting_s, missing, _ = job.pipeline.waiting()
    if waiting_s < NAME_UNMARKED_AFTER_S or not missing:
        return ""
    ranks = {m.local_rank: m.rank for m in job.members.ranks.values()}
    registration = job.members.any_registration()
    layers = registration.layers if registration is not None else []
    where = f"node {job.setup.node_index}, this node"
    return describe_unmarked([
        (ranks[local], where, layer,
         layers[layer].name if 0 <= layer < len(layers) else "?", waiting_s)
        for local, layer in missing])


def first_missing(world_size: int, joined: list[int], limit: int) -> list[int]:
    """The first ``limit`` ranks below ``world_size`` not in ``joined`` (sorted, distinct),
    found in the gaps between joined ranks: the work is in the ranks joined, not the world."""
    missing: list[int] = []
    expect = 0
    for rank in [*joined, world_size]:
        missing.extend(range(expect, min(rank, expect + limit - len(missing))))
        if len(missing) >= limit:
            break
        expect = rank + 1
    return missing


def progress_message(job: Job) -> str:
    """What the job waits for, in words, for its waiting ranks."""
    name = f"commd: job {job.id!r}"
    if job.state is JobState.FORMING:
        ranks = job.members.ranks
        registered = sorted(i for i, r in ranks.items() if r.registration is not None)
        waiting = sorted(set(range(job.local_world_size)) - set(registered))
        return (f"{name} forms on this node: local ranks {registered} of "
                f"{job.local_world_size} registered, waiting for local ranks {waiting}")
    if job.state is JobState.JOINING:
        joined = sorted({r for r in job.liveness.joined if 0 <= r < job.world_size})
        missing = first_missing(job.world_size, joined, 21)  # not range(world): up to 2**20
        return (f"{name} waits for the other nodes at the coordinator {job.coordinator}: "
                f"{len(joined)} of {job.world_size} ranks joined, waiting "
                f"for ranks {missing[:20]}{' …' if len(missing) > 20 else ''}")
    if job.state is JobState.STARTING:
        return f"{name} is starting: engine set-up and network probe"
    iteration = job.pipeline.iteration if job.pipeline else 0
    return f"{name} runs iteration {iteration}"
