"""Daemon-to-daemon control-plane messages (the data plane is the collective engine)."""

from __future__ import annotations

import heapq
from typing import Annotated

import msgspec

from .limits import MAX_LOCAL_RANKS
from .messages import Layer, _Msg

# Report rounds: every REPORT_EVERY iterations each node sends a PeerProfile; the coordinator
# answers with the plan for iteration last + 1 + DECISION_LAG, which every node waits for.
REPORT_EVERY = 10
DECISION_LAG = 2

# The most dead nodes a takeover names (a node keeps the last 64 coordinators it gave up on).
MAX_DEAD_NAMED = 64

# The kind of a timed collective, the fifth element of a ``PeerProfile.comm`` row.
ALLREDUCE, ALLGATHER = 0, 1


class RosterEntry(msgspec.Struct, array_like=True):
    """One node of a tolerant job: where its daemon's peer endpoint is, and its ranks. Every
    node keeps the roster of its epoch, to find the next coordinator if its own is lost."""

    peer: str  # "host:port"
    ranks: list[int]


class PeerJoin(_Msg, tag="peer_join"):
    """A node's daemon has every local rank of ``job`` registered and asks to join."""

    protocol: int
    job: str
    ranks: list[int]  # the process ranks on this node
    world_size: int
    layers: list[Layer]
    dtype: str
    op: str
    planner: str
    host: str  # the address this node's engine listens on
    compression: str = "none"
    profile: bool = True
    device: str = "cpu"  # where the node's buffers live: every node must agree (one engine)
    # "continue": a lost node costs the job a membership epoch, not its life (docs/
    # fault-tolerance.md); every node must agree, as on the smallest world it goes on with.
    fault_tolerance: str = "fail"
    min_world_size: int = 1
    peer: str = ""  # "host:port" of this node's daemon's peer endpoint, as others reach it


class PeerSetup(_Msg, tag="peer_setup"):
    """The coordinator's answer once the whole world joined: the node's place and the plan."""

    job: str
    generation: int  # distinguishes engine set-ups of a job id that was reused
    node_index: int
    nodes: int
    store_port: int  # TCPStore on the coordinator's host
    planner: str
    # The job's keys in that store live under this random prefix: only the job's nodes learn
    # it, over the authenticated peer channel ("": an older coordinator, "<job>/<generation>").
    store_prefix: str = ""
    roster: list[RosterEntry] = msgspec.field(default_factory=list)  # tolerant jobs


class PeerAbort(_Msg, tag="peer_abort"):
    """The job cannot go on (mismatch, a lost rank or node); every daemon fails its ranks."""

    job: str
    code: str
    message: str
    # to a node dropped from a running fault_tolerance="continue" job (it fell silent): a
    # job of that id still forming or joining there is a later one, which it does not end
    dropped: bool = False


class PeerLeave(_Msg, tag="peer_leave"):
    """A node's ranks all said goodbye: the coordinator forgets the node's part of the job."""

    job: str
    # iterations the node delivered to its ranks (-1: unknown): a tolerant job's others may
    # still be committing the last of them, and must then deliver it, not run it again
    delivered: int = -1


class PeerProfile(_Msg, tag="peer_profile"):
    """A node's measurements for one report round (round 0: the start-up probe)."""

    job: str
    round: int
    iteration: int  # last iteration covered; -1 for the probe
    # per layer (forward order), seconds after the first layer was ready
    ready_offsets_s: list[float] = msgspec.field(default_factory=list)
    # [key_iteration, key_group, bytes, seconds, kind] per collective (kind: ALLREDUCE or
    # ALLGATHER; rows without it are all-reduces)
    comm: list[list[float]] = msgspec.field(default_factory=list)
    measured_comm_s: float = 0.0  # exposed communication per iteration (mean over the round)
    iteration_s: float = 0.0
    # [ratio, mean compression gain ‖sent‖²/‖E‖²] per top-k ratio used in the round
    gains: list[list[float]] = msgspec.field(default_factory=list)
    plan: int = 0  # the plan version of the round's last iteration
    step_s: float = 0.0  # median time per iteration under that plan (0: not measured)
    # the round's compressed groups: [selection s per dense element, update s per dense
    # element, overhead s per group] ([]: none ran; selection 0: this node selected nothing)
    cpu_s_per_element: list[float] = msgspec.field(default_factory=list)


class PeerPlan(_Msg, tag="peer_plan"):
    """The coordinator's decision for a round: the plan to use from ``effective_iteration``."""

    job: str
    round: int
    effective_iteration: int
    version: int
    groups: list[list[int]]
    alpha_s: float
    beta_s_per_byte: float
    predicted_comm_s: float
    reason: str = ""
    exchanges: list[str] = msgspec.field(default_factory=list)  # per group; [] = all dense
    ratio: float = 0.0  # top-k ratio of the compressed groups
    overhead_s: float = 0.0  # per-group cost added to alpha_s for planning (measured search)
    search: str = ""  # the plan search's state, for status
    # compressed jobs: how the exchange was chosen (forced, exploring, measuring, measured)
    # and (candidate, predicted s, measured s or -1) per candidate, for status
    selection: str = ""
    candidates: list[tuple[str, float, float]] = msgspec.field(default_factory=list)
    # what the exchange in force is and why, with the numbers (``compression="auto"``),
    # kept for status: "" where nothing was chosen
    choice: str = ""


class PeerHeartbeat(_Msg, tag="peer_heartbeat"):
    """A node to its job's coordinator, every few seconds while the job is active: it is alive,
    and where its iteration stands (for the stall inspector)."""

    job: str
    iteration: int = 0  # the iteration the node's pipeline is in
    waiting_s: float = 0.0  # how long it has waited for marks of its local ranks (0: not)
    # [rank, first layer it has not marked] per local rank the node waits for
    missing: Annotated[list[list[int]], msgspec.Meta(max_length=MAX_LOCAL_RANKS)] = \
        msgspec.field(default_factory=list)
    wire_s: float = 0.0  # how long its current collective has been on the wire (0: none)


class PeerStatus(_Msg, tag="peer_status"):
    """The coordinator to each node of a job, every few seconds: it is alive, who has joined,
    and the job's stall, if any (every node shows it; waiting ranks log it)."""

    job: str
    joined: list[int] = msgspec.field(default_factory=list)  # ranks that joined (forming)
    stall: str = ""  # the stall warning, "" when none
    stall_s: float = 0.0
    # Some node still waits for its ranks' marks: a collective elsewhere that waits for it is
    # not overdue (the collective watchdog waits; the stall inspector speaks instead).
    marks_pending: bool = False
    # Who the job waits for now (``describe_unmarked``), whatever stall_warn_s: a waiting rank
    # whose own timeout runs out names them. "" when no node waits for marks (or an old daemon).
    waiting_for: str = ""


# A node that has waited this long for its ranks' marks names them: marks a moment late are
# every iteration's normal; a rank late by more is worth naming to a rank that times out.
NAME_UNMARKED_AFTER_S = 1.0
MAX_NAMED_RANKS = 10  # ranks named one by one; the rest are counted
_MAX_NAME_CHARS = 100  # of a layer's name, and of where a rank runs, in those words
# What a node passes on of a coordinator's words to its ranks: above the longest that
# ``describe_unmarked`` writes (10 rows of at most ~300 characters), so only a hostile
# coordinator's words are cut.
MAX_WAITING_FOR_CHARS = 4000


def describe_unmarked(rows: list[tuple[int, str, int, str, float]]) -> str:
    """Who the job waits for, in words, from (rank, where it runs, the first layer it has not
    marked, that layer's name, seconds its node has waited) rows; "" for none. Shown in a
    waiting rank's timeout, so it says what to do. Linear in the rows (a job may have 2**20)."""
    if not rows:
        return ""
    parts = [f"rank {rank} ({where[:_MAX_NAME_CHARS]}) has not marked layer {layer} "
             f"({name[:_MAX_NAME_CHARS]!r}) for {waited:.1f}s"
             for rank, where, layer, name, waited in heapq.nsmallest(MAX_NAMED_RANKS, rows)]
    more = f" and {len(rows) - MAX_NAMED_RANKS} more" if len(rows) > MAX_NAMED_RANKS else ""
    which = "that process" if len(rows) == 1 else "those processes"
    return f"{'; '.join(parts)}{more}; check {which} (stopped? stuck in data loading?)"


class PeerReform(_Msg, tag="peer_reform"):
    """The coordinator to each surviving node of a ``fault_tolerance="continue"`` job: the job
    moves to membership epoch ``epoch``. Stop the data plane (abandon the collective in
    flight) and answer with a ``PeerReformState``."""

    job: str
    epoch: int
    change: str  # what changed, in words: the lost node(s), their ranks, why


class PeerReformState(_Msg, tag="peer_reform_state"):
    """A node to its coordinator: it stopped for ``epoch``; where its iteration stands."""

    job: str
    epoch: int
    delivered: int  # iterations whose results went to this node's ranks
    # iteration ``delivered`` finished every group and waited only for the job-wide commit:
    # its results are whole on this node
    committing: bool = False
    joining: bool = False  # the node joins the running job in this change (it ran nothing)


class PeerResume(_Msg, tag="peer_resume"):
    """The coordinator to each surviving node: the new epoch's place, and the iteration every
    node runs next (a node whose ``delivered`` is one less delivers its committed results
    first; a node that had begun ``iteration`` runs it again among the new members)."""

    job: str
    epoch: int
    node_index: int
    nodes: int
    store_port: int
    store_prefix: str
    members: list[int]  # the ranks of the new epoch, sorted
    iteration: int
    change: str = ""
    # a joining node: the iterations from ``iteration`` on whose plan is still being decided
    # (the others wait for it before running them, so must the joiner)
    expect: Annotated[list[int], msgspec.Meta(max_length=64)] = msgspec.field(
        default_factory=list)
    source: int = -1  # a joining node: the lowest rank that was in the job before
    roster: list[RosterEntry] = msgspec.field(default_factory=list)  # the new epoch's nodes


class PeerFault(_Msg, tag="peer_fault"):
    """A node of a ``fault_tolerance="continue"`` job to its coordinator: a collective of
    ``epoch`` failed (a peer vanished?); the node has stopped its data plane and waits for
    the coordinator's reform."""

    job: str
    epoch: int
    message: str
    # the collective failed because a peer closed its connections: its process is gone (a
    # crash), not merely out of reach (a network split, where it would still be silent)
    closed: bool = False
    # ranks of this node that are gone while its other ranks live (their process exited or
    # closed): the node goes on without them; [] when a collective failed
    lost_ranks: Annotated[list[int], msgspec.Meta(max_length=MAX_LOCAL_RANKS)] = \
        msgspec.field(default_factory=list)


class PeerTakeover(_Msg, tag="peer_takeover"):
    """A node of a tolerant job whose coordinator went silent, to the roster's next node:
    coordinate the job from here. It has stopped its data plane; ``join`` is its part of the
    job, as it first joined, and the rest says where its iteration stands."""

    job: str
    epoch: int  # the latest epoch it knows
    delivered: int
    committing: bool
    join: PeerJoin
    roster: list[RosterEntry]  # its epoch's nodes
    lost: str  # the silent coordinator's peer address
    plan: int = 0  # the version of the plan in force on it
    # the latest decisions it holds, oldest first: a node that joins after the takeover needs
    # the one in force, which only the lost coordinator had sent
    plans: list[PeerPlan] = msgspec.field(default_factory=list)
    # a collective of this epoch failed on it because a peer closed its connections: a
    # process died (a crash), where a network split would only have gone silent
    crash: bool = False
    # roster nodes it knows dead (their link closed while they talked), not silent: the
    # successor neither waits for them nor counts them
    dead: Annotated[list[str], msgspec.Meta(max_length=MAX_DEAD_NAMED)] = msgspec.field(
        default_factory=list)


class PeerSuccession(_Msg, tag="peer_succession"):
    """A node of a tolerant job to the daemon now listening where the job's coordinator was
    lost (a fresh one, started there with the node's old command): the job has been
    coordinated at ``coordinator`` since the takeover. That daemon sends a join of the job
    there (``PeerRedirect``) instead of forming it anew."""

    job: str
    lost: str  # "host:port": the address the lost coordinator had, where this goes
    coordinator: str  # "host:port": the successor's


class PeerRedirect(_Msg, tag="peer_redirect"):
    """A coordinator to a node that asked to join a job here which was taken over elsewhere
    (``PeerSuccession``): ask ``coordinator`` instead."""

    job: str
    coordinator: str  # "host:port"


PeerMessage = (PeerJoin | PeerSetup | PeerAbort | PeerLeave | PeerProfile | PeerPlan
               | PeerHeartbeat | PeerStatus | PeerReform | PeerReformState | PeerResume
               | PeerFault | PeerTakeover | PeerSuccession | PeerRedirect)
