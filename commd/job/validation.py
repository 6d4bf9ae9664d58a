"""Checks of what a rank sends before the job takes it: its hello and its registration.

Each check raises ``JobError`` naming the bad field and what would be right; nothing changes.
Whether the ranks of a job agree with each other is ``agreement``'s business.
"""

from __future__ import annotations

import math

from commd.compression.costs import EXCHANGES
from commd.compression.lowrank import LOW_RANK
from commd.compression.spec import HALF, AutoSpec, HalfSpec, LowRankSpec, Spec
from commd.compression.topk import SUPPORTED_DTYPES as COMPRESSIBLE_DTYPES
from commd.compression.topk import parse_compression
from commd.job import buffers
from commd.job.state import JobContext, JobError
from commd.plan import validate_plan
from commd_protocol import PROTOCOL_VERSION, ErrorCode, Hello, PeerPlan, PeerSetup, Register
from commd_protocol.checks import (
    address_problem,
    finite,
    job_id_problem,
    layers_problem,
    layout_problem,
    roster_problem,
    tolerance_problem,
)
from commd_protocol.dtypes import itemsize
from commd_protocol.limits import (
    MAX_BYTE_OFFSET,
    MAX_DEVICE_INDEX,
    MAX_LOCAL_RANKS,
    MAX_PID,
    MAX_PORT,
    MAX_RANKS,
    count_problem,
    ranks_bound_problem,
)

SELECTIONS = ("", "forced", "exploring", "measuring", "measured")  # PeerPlan.selection
MAX_CANDIDATES = 8
MAX_PLAN_TEXT = 4096  # a plan's reason and search state: kept for status, shown on every call


def check_hello(hello: Hello) -> None:
    if hello.protocol != PROTOCOL_VERSION:
        raise JobError(
            f"protocol version {hello.protocol} is not supported (this daemon speaks "
            f"{PROTOCOL_VERSION}); install matching commd and commd_client versions",
            ErrorCode.VERSION,
        )
    problem = job_id_problem(hello.job) or ranks_bound_problem("world_size", hello.world_size)
    if problem:
        raise JobError(problem)
    if not 0 <= hello.pid <= MAX_PID:
        raise JobError(f"pid {hello.pid} is not a process id (0: not given)")
    if not 0 <= hello.rank < hello.world_size:
        raise JobError(f"rank {hello.rank} is outside world size {hello.world_size}")
    if hello.local_world_size > MAX_LOCAL_RANKS:
        raise JobError(f"local world size {hello.local_world_size} is over the {MAX_LOCAL_RANKS} "
                       "ranks one daemon serves")
    if not 0 <= hello.local_rank < hello.local_world_size <= hello.world_size:
        raise JobError(
            f"local rank {hello.local_rank} / local world size {hello.local_world_size} "
            f"do not fit world size {hello.world_size}"
        )
    problem = address_problem("coordinator", hello.coordinator)
    if problem:
        raise JobError(problem)
    problem = (job_id_problem(hello.parent) if hello.parent else "") or count_problem(
        "parent_epoch", hello.parent_epoch)
    if problem:
        raise JobError(f"parent: {problem}")


def check_register(message: Register, context: JobContext, *, several_nodes: bool,
                   world_size: int = 1) -> None:
    """Refuse a registration that cannot be served (its planner is filled in already);
    ``several_nodes``: the job spans nodes, so an engine must take its buffers."""
    problem = register_integers_problem(message) or buffers.check_fields(message)
    if problem:
        raise JobError(problem)
    if several_nodes:
        try:
            context.engine_for(message.device)
        except ValueError as exc:
            raise JobError(str(exc)) from None
    problem = (layout_problem(message.dtype, message.op, message.device)
               or layers_problem(message.layers)
               or tolerance_problem(message.fault_tolerance, message.min_world_size,
                                    world_size, message.device))
    if problem:
        raise JobError(problem)
    check_limits(message, context)
    try:
        spec = parse_compression(message.compression)
    except ValueError as exc:
        raise JobError(str(exc)) from None
    # `auto` and `fp16` take any dtype: half-precision gradients stay as they are
    if spec is not None and not isinstance(spec, AutoSpec | HalfSpec) and (
            message.dtype not in COMPRESSIBLE_DTYPES):
        kind = "low-rank" if isinstance(spec, LowRankSpec) else "top-k"
        raise JobError(
            f"{kind} compression needs float32 or float64 gradients, not {message.dtype}"
        )
    try:
        context.validate_planner(message.planner)
    except ValueError as exc:
        raise JobError(str(exc)) from None


def register_integers_problem(message: Register) -> str:
    """'' when the register's own integers are in range (its layers' sizes are checked with
    the layers), else which is not."""
    if not 0 <= message.ipc_offset <= MAX_BYTE_OFFSET:
        return f"ipc_offset {message.ipc_offset} is outside 0..2**48"
    if not -1 <= message.device_index <= MAX_DEVICE_INDEX:
        return f"device_index {message.device_index} is outside -1..{MAX_DEVICE_INDEX}"
    return ""


def check_limits(message: Register, context: JobContext) -> None:
    """What one job may make this daemon hold: layers and bytes (settings max_layers and
    max_job_bytes); JobError with code LIMIT."""
    if len(message.layers) > context.max_layers:
        raise JobError(f"{len(message.layers)} layers is over this daemon's limit of "
                       f"{context.max_layers} (max_layers)", ErrorCode.LIMIT)
    nbytes = sum(layer.size for layer in message.layers) * itemsize(message.dtype)
    if nbytes > context.max_job_bytes:
        raise JobError(f"the layers need {nbytes} bytes, over this daemon's limit of "
                       f"{context.max_job_bytes} bytes per job (max_job_bytes)", ErrorCode.LIMIT)


def setup_problem(setup: PeerSetup) -> str:
    """'' when the coordinator's set-up fits together, else what is wrong."""
    if not 0 <= setup.node_index < setup.nodes <= MAX_RANKS:
        return f"node {setup.node_index} of {setup.nodes} nodes"
    problem = count_problem("generation", setup.generation)
    if problem:
        return problem
    if not 0 <= setup.store_port <= MAX_PORT or (setup.nodes > 1 and setup.store_port == 0):
        return f"rendezvous port {setup.store_port}"
    if len(setup.store_prefix) > 128:
        return f"a rendezvous prefix of {len(setup.store_prefix)} characters"
    return roster_problem(setup.roster, setup.nodes, MAX_RANKS)


def plan_problem(plan: PeerPlan, layers: int, compression: Spec | None = None) -> str:
    """'' when the coordinator's plan is one this job (of ``compression``) can run, else
    what is wrong."""
    try:
        validate_plan(plan.groups, layers)
    except ValueError as exc:
        return str(exc)
    if plan.exchanges and len(plan.exchanges) != len(plan.groups):
        return f"{len(plan.exchanges)} exchanges for {len(plan.groups)} groups"
    if isinstance(compression, AutoSpec):
        known = {"dense", LOW_RANK, HALF}
    elif isinstance(compression, LowRankSpec):
        known = {"dense", LOW_RANK}
    elif isinstance(compression, HalfSpec):
        known = {"dense", HALF}
    else:
        known = {"dense", *EXCHANGES}
    unknown = sorted(set(plan.exchanges) - known)
    if unknown:
        return f"unknown exchanges {unknown} for compression {compression or 'none'}"
    if not (math.isfinite(plan.ratio) and 0 <= plan.ratio <= 1):
        return f"top-k ratio {plan.ratio}"
    if max(len(plan.reason), len(plan.search), len(plan.choice)) > MAX_PLAN_TEXT:
        return (f"reason, search and choice must be at most {MAX_PLAN_TEXT} characters (shown "
                "in status)")
    if plan.selection not in SELECTIONS:
        return f"exchange selection {plan.selection[:40]!r}"
    if len(plan.candidates) > MAX_CANDIDATES or any(
            len(name) > 40 or not finite((predicted, measured + 1))
            for name, predicted, measured in plan.candidates):
        return f"candidates must be at most {MAX_CANDIDATES} (name, predicted s, measured s)"
    problem = (count_problem("effective_iteration", plan.effective_iteration)
               or count_problem("version", plan.version, 1) or count_problem("round", plan.round))
    if problem:
        return f"plan v{plan.version} from iteration {plan.effective_iteration}: {problem}"
    return ""
