"""What ``commd status`` shows: the daemon's typed snapshot of itself and of its jobs.

The daemon builds these and sends them in ``StatusReply.status`` as a plain map (the same
keys), so any MessagePack client can read it; ``commd status`` turns the map back into these
types to render it. New fields get defaults, so an older daemon's reply still converts.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

import msgspec


class JobState(StrEnum):
    """The life of one job on one node."""

    FORMING = "forming"  # local ranks are saying hello and registering
    JOINING = "joining"  # every local rank registered; waiting for the coordinator's set-up
    STARTING = "starting"  # engine, device and network probe being set up; waiting for a plan
    RUNNING = "running"  # iterations run
    # fault_tolerance="continue": a node was lost; the data plane waits for the new epoch
    REFORMING = "reforming"
    FAILED = "failed"  # the failure is latched and told to every rank
    CLOSED = "closed"  # every rank said goodbye

    @property
    def active(self) -> bool:
        """Between joining and running: the coordinator knows this node's part of the job."""
        return self in (JobState.JOINING, JobState.STARTING, JobState.RUNNING,
                        JobState.REFORMING)


class _Status(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    """Base: keyword-only, and unknown keys (a newer daemon's) are ignored."""


class IterationTiming(_Status):
    """A job's iteration time on this node, in seconds: the last iteration's, and the mean over the
    last ones (up to 100)."""

    last: float
    mean: float


class LatencySummary(_Status):
    """Percentiles of a latency window, in microseconds."""

    p50_us: float
    p99_us: float
    max_us: float
    samples: float


class CandidateTiming(_Status):
    """One way a compressed job can exchange: the model's and the measured seconds."""

    name: str  # "dense", "allgather@0.01", "allreduce@0.01"
    predicted_s: float  # the cost model's seconds per iteration
    measured_s: float | None = None  # the measured step time (None: not measured)


class PlanChange(_Status):
    """One entry of a job's plan history: from ``iteration`` on, the job ran with merge plan
    ``version`` of ``groups`` groups (the last 10 changes are kept)."""

    iteration: int  # the first iteration that ran with the plan
    version: int
    groups: int


class JobStatus(_Status):
    """One job as this node sees it: its state and place, the plan in force and why, what was
    measured, how compression exchanges and the membership. A field is None or empty until the
    job has reached the stage that knows it."""

    job: str
    state: JobState
    world_size: int
    local_ranks: list[int] = []
    nodes: int | None = None
    node_index: int | None = None
    iteration: int = 0
    planner: str | None = None
    plan_version: int | None = None
    groups: list[list[int]] = []
    plan_history: list[PlanChange] = []
    ready_messages: int = 0
    plan_reason: str | None = None
    alpha_s: float | None = None
    beta_s_per_byte: float | None = None
    predicted_comm_s: float | None = None
    plan_overhead_s: float | None = None
    plan_search: str | None = None
    measured_comm_s: float = 0.0
    compression: str | None = None
    ratio: float | None = None
    exchanges: list[str] = []
    gain: float = 1.0
    # how the exchange was chosen: forced, exploring, measuring or measured (None: dense)
    selection: str | None = None
    candidates: list[CandidateTiming] = []
    # what the exchange in force is and why, with the numbers (compression="auto"; None: no
    # choice was made)
    choice: str | None = None
    layers: int = 0
    dtype: str | None = None
    op: str | None = None
    iteration_s: IterationTiming | None = None
    error: str | None = None
    device: str | None = None
    ready_to_launch: LatencySummary | None = None
    stall: str | None = None  # the coordinator's stall warning naming ranks and layers
    stall_s: float = 0.0  # how long the stall has lasted
    fault_tolerance: str = "fail"
    epoch: int = 0  # membership epoch (fault_tolerance="continue"; 0: the first)
    members: list[int] = []  # the ranks of that epoch ([]: every rank, never changed)
    membership_changes: list[str] = []  # "epoch N: what changed", oldest first


class EndedJob(_Status):
    """A job that ended on this node: its last snapshot and how it ended."""

    status: JobStatus  # taken as it left the job table (state closed or failed)
    outcome: str  # "finished", "failed: <message>" or "closed while <state>"
    ended_at: float  # unix seconds


class CoordinatedJob(_Status):
    """A job this daemon coordinates (it is on rank 0's node)."""

    job: str
    formed: bool
    nodes: int
    world_size: int
    epoch: int = 0  # membership epoch (fault_tolerance="continue")
    membership_changes: list[str] = []  # "epoch N: what changed", oldest first


class ShareStatus(_Status):
    """What the daemon holds of one capped kind, in all and per local user (docs/security.md)."""

    kind: str  # "ranks connected", "jobs", "traces running", …
    held: int  # in all
    per_daemon: int  # the daemon's cap
    per_user: int  # each user's cap (root: the daemon's only)
    by_uid: dict[str, int] = {}  # uid (as text; "-1": unreadable) -> how many it holds


class DaemonStatus(_Status):
    """What ``commd status`` shows of one daemon: who it is (version, backend, socket, peer port,
    uptime), its jobs, the jobs it coordinates, the peer handshakes it refused, what each user
    holds of its caps and the jobs that ended lately."""

    version: str
    protocol: int
    backend: str
    uptime_s: float
    pid: int | None = None
    socket: str | None = None
    listen: str | None = None
    jobs: list[JobStatus] = []
    coordinating: list[CoordinatedJob] = []
    peer_handshakes_refused: int = 0  # handshakes refused on the peer port, every reason
    # the same by reason: no_key, wrong_server_key, wrong_client_key, garbage ({}: older daemon)
    peer_handshakes_refused_by: dict[str, int] = {}
    # which loops run the top-k path: "compiled[, AVX-512]" or "numpy (why)"; "": older daemon
    compression_loops: str = ""
    shares: list[ShareStatus] = []  # per-user fair shares ([]: older daemon)
    ended: list[EndedJob] = []  # the last jobs that ended here, newest first ([]: older daemon)


def status_map(status: DaemonStatus) -> dict[str, Any]:
    """The map that travels in ``StatusReply.status``."""
    result: dict[str, Any] = msgspec.to_builtins(status)
    return result


def read_status(data: object) -> DaemonStatus:
    """A received status map as types; msgspec.ValidationError names a bad field."""
    return msgspec.convert(data, DaemonStatus)
