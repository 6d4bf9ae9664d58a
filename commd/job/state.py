"""The pieces a job on one node is made of: its local ranks, what every job of the daemon
shares, and the error a job raises when it refuses a request."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from commd.job.segments import SharedSegment
from commd.job.successions import Successions
from commd_protocol import ErrorCode, Register, RosterEntry
from commd_protocol.errors import prefixed
from commd_protocol.status import JobState

if TYPE_CHECKING:
    from commd.job.measurements import IterationRecord

__all__ = ["Epochs", "JobContext", "JobError", "JobState", "Liveness", "LocalRank", "SendClient",
           "SendPeer"]

SendClient = Callable[[bytes, msgspec.Struct], None]
SendPeer = Callable[[str, msgspec.Struct], None]


class JobError(Exception):
    """A request the job refuses; ``code`` goes into the error reply."""

    def __init__(self, message: str, code: ErrorCode = ErrorCode.INVALID) -> None:
        super().__init__(prefixed(message))
        self.code = code


@dataclass
class LocalRank:
    """One rank of a job on this node, from its hello to its departure: its connection and pid, its
    buffer and registration, the iteration it waits for, what it was last told, and whether it
    left or is a replacement waiting to be taken in."""

    identity: bytes
    rank: int
    local_rank: int
    pid: int
    segment: SharedSegment | None = None
    buffer: Any = None  # numpy array (shared memory) or cupy array (device memory)
    registration: Register | None = None
    waiting: int | None = None  # the iteration this rank waits for
    told_plan: int = 0  # the plan whose groups this rank was last sent (it batches by them)
    told_epoch: int = 0  # the membership epoch this rank was last told (tolerant jobs)
    left: bool = False
    # fault_tolerance="continue": a replacement for a gone local rank of a running job, until
    # a change takes it in (``rejoin_asked``: this node has asked the coordinator for it)
    rejoining: bool = False
    rejoin_asked: bool = False


@dataclass(frozen=True)
class JobContext:
    """What every job of this daemon shares."""

    engine_for: Callable[[str], str]  # buffer kind -> engine name; ValueError says why none
    timeout_s: float
    advertise: Callable[[str], str]  # coordinator host -> our engine address
    executor: Executor
    send_client: SendClient
    send_peer: SendPeer
    validate_planner: Callable[[str], object]  # ValueError names the valid planners
    default_planner: str
    peer_timeout_s: float = 10.0  # the coordinator's silence that fails the job
    watchdog: tuple[float, float] = (10.0, 15.0)  # a collective's limit: factor, floor seconds
    max_layers: int = 65536  # per job
    max_job_bytes: int = 1 << 40  # gradient bytes per job on this node
    # (job id, record) for every finished iteration, e.g. the daemon's metrics (None: off)
    observe: Callable[[str, IterationRecord], None] | None = None
    # (job id, kind) for every membership change of a tolerant job, e.g. metrics (None: off)
    on_membership_change: Callable[[str, str], None] | None = None
    # (job id, epoch): a tolerant job stops here for a new membership epoch; the daemon
    # fails that job's helpers of earlier epochs (state transfers whose peer may be gone)
    membership_changing: Callable[[str, int], None] = lambda job, epoch: None
    # coordinator host -> "host:port" of this daemon's peer endpoint as that host reaches it
    peer_address: Callable[[str], str] = lambda host: ""
    # the daemon's one record of which node took over each job's lost coordinator
    successions: Successions = field(default_factory=Successions)


@dataclass
class Liveness:
    """What a job knows of its coordinator's liveness and of the job-wide state."""

    heard_at: float = 0.0  # the coordinator's last message for this job (monotonic)
    joined_at: float = 0.0  # when this node asked to join
    beat_at: float = 0.0  # our last heartbeat
    joined: list[int] = field(default_factory=list)  # ranks that joined (forming)
    stall: str = ""  # the coordinator's stall warning, "" when none
    stall_s: float = 0.0
    marks_pending: bool = False  # some node waits for its ranks' marks (watchdog: be patient)
    waiting_for: str = ""  # the coordinator's words on whom the job waits for, "" when none


@dataclass
class Epochs:
    """What this node knows of its job's membership."""

    epoch: int = 0  # the epoch the data plane runs in
    members: list[int] = field(default_factory=list)  # its ranks ([]: every rank, epoch 0)
    # (epoch, its ranks, what changed), oldest first
    changes: list[tuple[int, list[int], str]] = field(default_factory=list)
    stopping_for: int = 0  # the epoch the node stopped for (answered a reform), 0: none
    # the epoch's nodes (where to turn if the coordinator is lost), and the coordinators
    # given up on; taking_over: asked the roster's next node to coordinate, awaiting it
    roster: list[RosterEntry] = field(default_factory=list)
    given_up: list[str] = field(default_factory=list)
    # of those, the ones this epoch knows dead (a link that closed while it talked), not
    # merely silent: a takeover need not wait for them nor count them
    dead: list[str] = field(default_factory=list)
    taking_over: bool = False
    crash_seen: bool = False  # a peer closed its connections in this epoch (a process died)
    source: int = -1  # a joining node: the rank that gives its ranks the training state

    @property
    def latest(self) -> int:
        """The latest epoch this node knows: the one it runs in, or the one it stopped for."""
        return max(self.epoch, self.stopping_for)

    def members_of(self, epoch: int) -> list[int]:
        """The ranks of ``epoch`` ([] when it is not kept)."""
        return next((ranks for number, ranks, _ in self.changes if number == epoch), [])

    def words_since(self, told: int, upto: int) -> str:
        """What changed after epoch ``told`` up to ``upto``, in words."""
        return "; ".join(words for number, _, words in self.changes if told < number <= upto)

    def history(self) -> list[str]:
        return [f"epoch {number}: {words}" for number, _, words in self.changes]
