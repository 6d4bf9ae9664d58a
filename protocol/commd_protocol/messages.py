"""Typed wire messages: msgspec Structs, encoded as plain MessagePack maps.

Every message is a map with a ``type`` tag, so a client in another language can speak the
protocol with any MessagePack library. New fields always get defaults, so that an old client
keeps working against a newer daemon.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from .limits import MAX_LAYERS

PROTOCOL_VERSION = 2  # 2: host buffers are handed over as file descriptors, never named

# Dtypes the daemon reduces; bfloat16 travels as raw 16-bit words (numpy has no bfloat16).
DTYPES = ("float32", "float64", "float16", "bfloat16")
OPS = ("sum", "avg")
# Where a rank's flat buffer lives: "cpu" (POSIX shared memory) or "cuda" (device memory shared
# through a CUDA IPC handle).
DEVICES = ("cpu", "cuda")


class _Msg(msgspec.Struct, tag_field="type", forbid_unknown_fields=False, kw_only=True):
    """Base of every message; the tag is the class's ``type`` name."""


# --- client -> daemon -----------------------------------------------------------------------


class Hello(_Msg, tag="hello"):
    """The first message a rank's client sends on its connection (``Client()``): which job it is
    and its place in it. The first hello of a job creates the job on this node, owned by the
    user who sent it; later ones add ranks to it. The daemon answers ``Welcome``, or ``Error``
    (a bad value, a cap reached, another user's job, a rank that contradicts the others)."""

    protocol: int
    job: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    coordinator: str  # "host:port" of the peer endpoint of the daemon on rank 0's node
    pid: int = 0  # lets the daemon notice a client that dies (pidfd)
    # a short job that serves job ``parent`` in its membership epoch ``parent_epoch`` (the
    # DDP wrapper's state transfer to a joiner): once that job's membership changes again
    # on this node, the helper fails at once (its peer may be the rank that was lost)
    parent: str = ""
    parent_epoch: int = 0


class Layer(msgspec.Struct, array_like=False, kw_only=True):
    """One layer of a ``Register``: its name, its number of elements and the rows of its matrix
    view (which low-rank compression needs)."""

    name: str
    size: int  # number of elements
    # Rows of the layer's matrix view, shape[0] of a tensor of 2 or more dimensions (a
    # low-rank compressor sees it as rows x size / rows, as torch's PowerSGD hook does);
    # 0: a vector, or not known (never compressed low-rank). 0 <= rows <= size, and rows
    # divides size.
    rows: int = 0


class Register(_Msg, tag="register"):
    """Sent once by each rank after the welcome (``Client.register``): its layers in forward
    order, dtype and op, where its flat buffer is (a host buffer's token or a device buffer's
    CUDA IPC handles) and the job's choices (planner, compression, fault tolerance). The local
    ranks must agree. Once every rank of every node has registered and the coordinator's first
    plan has come, each rank gets ``Registered``; a bad or mismatched one gets ``Error``."""

    layers: list[Layer]  # forward order
    dtype: str
    op: str
    # A host buffer (device == "cpu"): the token under which the rank handed the flat buffer
    # (backward order, a sealed memfd) to the daemon's buffer socket just before (handover.py).
    buffer_token: str = ""
    shm_name: str = ""  # protocol 1 named a /dev/shm file here: refused, see handover.py
    planner: str = ""  # "" = the daemon's default (optimal unless configured)
    compression: str = "none"
    profile: bool = True  # False: no network probe, no profiling rounds (short helper jobs)
    # FAULT_TOLERANCE: "fail" (torch's semantics: a lost rank fails the job) or "continue"
    # (the survivors go on in a new membership epoch while at least min_world_size ranks live)
    fault_tolerance: str = "fail"
    min_world_size: int = 1
    # --- a device buffer (device == "cuda"); sent once, here ---
    device: str = "cpu"  # one of DEVICES
    device_bus_id: str = ""  # PCI bus id of the rank's GPU: indices differ between processes
    device_index: int = -1  # the GPU's index as the rank sees it (for messages only)
    ipc_handle: bytes = b""  # cudaIpcMemHandle_t of the allocation holding the flat buffer
    ipc_offset: int = 0  # byte offset of the flat buffer inside that allocation
    event_handle: bytes = b""  # cudaIpcEventHandle_t of the rank's interprocess event, recorded
    # before every ready notification on the stream that produced the gradients


class Ready(_Msg, tag="ready"):
    """Sent during an iteration (``Client.ready``, batched by the plan's groups): layers whose
    gradients are final. A group is reduced once every local rank has marked all its layers.
    Nothing answers it but an ``Error`` for a bad one; the iteration's answer is ``Done``."""

    # forward-order indices whose gradients are final for this iteration (each at most once)
    layers: Annotated[list[int], msgspec.Meta(max_length=MAX_LAYERS)]
    sent_at: float = 0.0  # the client's CLOCK_MONOTONIC seconds at sending (0: not given);
    # the daemon measures ready-to-launch latency from it (same host, same clock)
    # CLOCK_MONOTONIC seconds at which each layer became ready, in the order of ``layers``
    # (empty: when the daemon received it). Clients batch their ready marks until a group of
    # the plan is complete; the stamps keep the profile per layer.
    stamps: Annotated[list[float], msgspec.Meta(max_length=MAX_LAYERS)] = []


class Wait(_Msg, tag="wait"):
    """Sent once a rank has marked every layer (``Client.wait``): it waits for ``iteration`` to be
    reduced. The daemon answers ``Done`` when it is (at once if it already is), meanwhile
    ``Progress`` every few seconds and ``Joining`` when ranks join a tolerant job; ``Error`` if
    the job fails."""

    iteration: int


class StatusRequest(_Msg, tag="status"):
    """``commd status`` asks the daemon what it is doing. It needs no hello; the daemon answers at
    once with ``StatusReply``."""
    pass


class TraceRequest(_Msg, tag="trace"):
    """Record the next ``iterations`` whole iterations of ``job`` on this node (``commd
    trace``). Like ``status`` it needs no hello. The daemon answers once they are recorded
    with a ``TraceReply``, or with an ``Error``: no such job, a trace of it already running,
    a value out of range. After ``timeout_s`` it answers with what it has (or a timeout).
    ``timeout_s`` is at most 600 (above: ``limit``); only the job's own user (the uid of the
    hello that created it, from the kernel) or root may trace it (else ``invalid``)."""

    job: str
    iterations: int = 1
    timeout_s: float = 60.0


class Goodbye(_Msg, tag="goodbye"):
    """The rank leaves its job (``Client.close``); nothing answers it. A client that dies without
    it is noticed through its pid and counts as lost. The job ends when its last rank has gone."""
    pass


# --- daemon -> client -----------------------------------------------------------------------


class Welcome(_Msg, tag="welcome"):
    """The daemon's answer to ``hello``: its protocol and version, the engine it runs (``nccl`` or
    ``gloo``) and the socket to which a rank hands its host buffer before ``register``."""

    protocol: int
    version: str
    backend: str
    buffer_socket: str = ""  # where host buffers are handed over (AF_UNIX, SOCK_SEQPACKET)


class Registered(_Msg, tag="registered"):
    """The answer to ``register``, sent to every local rank once the job runs: the node's place
    among the job's nodes and the first plan's groups, which the client batches its ready marks
    by. A replacement rank that joins a running tolerant job gets one too, saying where the
    job stands and which rank gives it the training state."""

    nodes: int
    node_index: int
    groups: list[list[int]]  # forward-order layer indices, in communication order
    planner: str
    plan: int = 0  # the version of the plan whose ``groups`` these are
    # fault_tolerance="continue": a rank that joined a running job learns here the iterations
    # the job had completed (its first wait is for that one; 0 for a fresh job), the epoch
    # and its ranks
    iteration: int = 0
    epoch: int = 0
    members: list[int] | None = None
    source: int = -1  # a joiner: the rank that gives it the training state
    source_local: bool = False  # ... and that rank is on this node (the transfer is local)
    # ... and the job's coordinator now ("host:port"; "" where it is the one the rank named),
    # which that transfer's jobs form at: after a takeover, not the launch-time address
    coordinator: str = ""
    done_event: bytes = b""  # device jobs: cudaIpcEventHandle_t of the daemon's completion
    # event; recorded before every ``done``, the client's stream waits on it


FAULT_TOLERANCE = ("fail", "continue")


class Done(_Msg, tag="done"):
    """The answer to ``wait`` once ``iteration`` is reduced: every layer of the rank's buffer holds
    the sum or average (a device buffer: once its work is issued, ended by the done event). It
    names the plan the iteration ran with, what is known of the next one, and, in a tolerant
    job, the membership epoch."""

    iteration: int
    plan: int = 0  # version of the merge plan this iteration ran with
    next_plan: int = 0  # the version the next iteration will run with (0: not decided yet)
    next_groups: list[list[int]] | None = None  # that plan's groups, when this rank has not
    # been told them yet; a hint for batching ready marks, never needed for correctness
    dense: bool = False  # every group of this iteration ran dense (no top-k): the same on
    # every node, since all switch plans at one iteration; False where unknown (old daemons)
    # fault_tolerance="continue": the membership epoch the iteration ran in (0: the first),
    # and, when it differs from the one this rank was last told, that epoch's ranks (the
    # ranks whose gradients the iteration holds) and what changed, in words
    epoch: int = 0
    members: list[int] | None = None
    change: str = ""


class Error(_Msg, tag="error"):
    """Why a message could not be served (``ref`` names it), or, with ``fatal``, that the job
    failed: a failure is sent unasked to every local rank, and answers each later wait."""

    code: str
    message: str
    ref: str = ""  # the type of the message this answers, when known
    fatal: bool = False  # True: the job failed and every later call fails the same way


class Progress(_Msg, tag="progress"):
    """Every few seconds to a rank that waits (for its job to form, or in ``wait``): what the
    job waits for. It also tells the rank that its daemon is alive: a waiting rank that hears
    nothing for long knows its daemon stopped."""

    message: str  # what the job waits for, in words ("commd: …")
    stall: str = ""  # a stall warning (log it once), "" when none
    # the ranks the job waits for (a waiting rank's timeout names them), "" when none
    waiting_for: str = ""


class Joining(_Msg, tag="joining"):
    """fault_tolerance="continue": ranks joined the running job, which resumes at
    ``iteration`` once they have marked it. Sent to the ranks already in it: rank ``source``
    gives the joiners the training state (the DDP wrapper does, from inside its ``wait``)."""

    epoch: int
    ranks: list[int]  # the ranks that joined
    iteration: int
    source: int  # the lowest rank that was in the job before
    local: list[int] = msgspec.field(default_factory=list)  # the joiners on this node
    # the job's coordinator now ("host:port"; "" where it is the one the ranks named): the
    # state transfer's jobs form there, not at a coordinator lost before the join
    coordinator: str = ""


class StatusReply(_Msg, tag="status_reply"):
    """The answer to ``status``: the daemon's ``DaemonStatus`` as a plain map (status.py)."""

    status: dict[str, object]


class TraceEvent(msgspec.Struct, kw_only=True):
    """One event of a trace, on the daemon's CLOCK_MONOTONIC (one clock per machine)."""

    row: str  # "iteration", "ready", "local sum", "wire", "write back", "compression", "plan"
    name: str  # e.g. "group 2", a layer's name, "plan v3"
    start_s: float  # CLOCK_MONOTONIC seconds
    duration_s: float | None = None  # None: an instant (a ready mark, a plan change)
    iteration: int = -1
    args: dict[str, str | int | float] = {}  # e.g. group, layers, bytes, exchange, k


class TraceReply(_Msg, tag="trace_reply"):
    """The answer to ``trace`` once the iterations are recorded: this node's events of them.
    ``commd trace`` asks every node's daemon and merges their replies into one trace."""

    job: str
    node_index: int = 0
    nodes: int = 1
    iterations: list[int] = []  # the iterations recorded, every one whole
    events: list[TraceEvent] = []
    truncated: str = ""  # why fewer iterations than asked were recorded ("": none fewer)


ClientMessage = Hello | Register | Ready | Wait | StatusRequest | Goodbye | TraceRequest
DaemonMessage = (Welcome | Registered | Done | Error | StatusReply | Progress
                 | TraceReply | Joining)
