"""Client defaults, read from the environment the way torchrun sets it.

One ``torchrun --standalone`` per node (so that one node's failure does not make torchrun's
agents tear down the others): torchrun's RANK and WORLD_SIZE are then the node's own, so
commd reads ``COMMD_NODE_RANK`` (this node, 0-based) and ``COMMD_NNODES`` (how many nodes)
when they are set and gives each rank its global identity, rank =
COMMD_NODE_RANK * LOCAL_WORLD_SIZE + LOCAL_RANK and world size =
COMMD_NNODES * LOCAL_WORLD_SIZE (every node runs the same number of ranks). Each standalone
torchrun has its own run id and rendezvous address, so with more than one node COMMD_JOB and
COMMD_COORDINATOR must be set too (the same on every node). Explicit keywords still win.
"""

from __future__ import annotations

import numbers
import os
from dataclasses import dataclass

from commd_protocol import (
    DEFAULT_PEER_PORT,
    DEFAULT_SOCKET,
    FAULT_TOLERANCE,
    CommdError,
    CommdTypeError,
    CommdValueError,
)
from commd_protocol.limits import ranks_bound_problem


def _int_env(name: str, default: int | None) -> int:
    raw = os.environ.get(name)
    if raw is None:
        if default is None:
            raise CommdError(
                f"commd: {name} is not set; pass it as a keyword or start under torchrun"
            )
        return default
    try:
        return int(raw)
    except ValueError:
        raise CommdError(f"commd: {name}={raw!r} is not an integer") from None


def rank() -> int:
    return _int_env("RANK", 0)


def world_size() -> int:
    return _int_env("WORLD_SIZE", 1)


def local_rank() -> int:
    return _int_env("LOCAL_RANK", 0)


def local_world_size() -> int:
    return _int_env("LOCAL_WORLD_SIZE", 1)


def job() -> str:
    """COMMD_JOB, else torchrun's run id, else one derived from the rendezvous address."""
    explicit = os.environ.get("COMMD_JOB")
    if explicit:
        return explicit
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id and run_id != "none":
        return run_id
    if "MASTER_ADDR" in os.environ:
        return f"{os.environ['MASTER_ADDR']}-{os.environ.get('MASTER_PORT', '0')}"
    return "default"


def coordinator() -> str:
    """COMMD_COORDINATOR, else MASTER_ADDR with commd's peer port, else this host."""
    explicit = os.environ.get("COMMD_COORDINATOR")
    if explicit:
        return explicit
    return f"{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{DEFAULT_PEER_PORT}"


def socket_path() -> str:
    return os.environ.get("COMMD_SOCKET", DEFAULT_SOCKET)


DEFAULT_TIMEOUT_S = 300.0


def timeout(given: float | None = None) -> float:
    """``given``, else COMMD_TIMEOUT (seconds), else 300: how long a call waits."""
    if given is not None:
        value: object = given
    else:
        raw = os.environ.get("COMMD_TIMEOUT")
        if raw is None:
            return DEFAULT_TIMEOUT_S
        try:
            value = float(raw)
        except ValueError:
            raise CommdError(f"commd: COMMD_TIMEOUT={raw!r} is not a number of seconds") \
                from None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 1e9:
        raise CommdError(f"commd: timeout must be a positive number of seconds, got {value!r}")
    return float(value)


def planner() -> str:
    """COMMD_PLANNER, else "" (the daemon's default planner)."""
    return os.environ.get("COMMD_PLANNER", "")


def compression() -> str:
    """COMMD_COMPRESSION, else "none"."""
    return os.environ.get("COMMD_COMPRESSION", "none")


def fault_tolerance(given: object = None) -> str:
    """``given``, else COMMD_FAULT_TOLERANCE, else "fail": what a lost rank does to a job
    ("fail": every rank gets a CommdError, as torch; "continue": the survivors go on)."""
    accepted = " or ".join(repr(value) for value in FAULT_TOLERANCE)
    if given is None:
        raw = os.environ.get("COMMD_FAULT_TOLERANCE")
        if raw is None:
            return "fail"
        if raw not in FAULT_TOLERANCE:
            raise CommdValueError(f"commd: COMMD_FAULT_TOLERANCE={raw[:40]!r} is not "
                                  f"{accepted}")
        return raw
    if not isinstance(given, str):
        raise CommdTypeError(f"commd: fault_tolerance must be a string, {accepted}; got "
                             f"{type(given).__name__} {given!r:.40}")
    if given not in FAULT_TOLERANCE:
        raise CommdValueError(f"commd: fault_tolerance={given[:40]!r} is not {accepted}")
    return given


def min_world_size(given: object, world_size: int) -> int:
    """``given``, else COMMD_MIN_WORLD_SIZE, else 1: the fewest live ranks a fault-tolerant
    job goes on with; it must be between 1 and ``world_size``."""
    if given is None:
        raw = os.environ.get("COMMD_MIN_WORLD_SIZE")
        if raw is None:
            return 1
        name = "COMMD_MIN_WORLD_SIZE"
        value = _parse_count(name, raw)
    else:
        name = "min_world_size"
        if isinstance(given, bool) or not isinstance(given, numbers.Integral):
            raise CommdTypeError(f"commd: min_world_size must be an int, got "
                                 f"{type(given).__name__} {given!r:.40}")
        value = int(given)
    if not 1 <= value <= world_size:
        raise CommdValueError(f"commd: {name}={value} must be between 1 and the world size "
                              f"{world_size}")
    return value


def _parse_count(name: str, raw: str) -> int:
    """An environment variable that holds a whole number; CommdValueError naming it if not."""
    try:
        return int(raw)
    except ValueError:  # also past Python's digit limit for int()
        raise CommdValueError(f"commd: {name}={raw[:40]!r} is not an integer") from None


def node_identity(local_rank: int, local_world_size: int) -> tuple[int, int] | None:
    """(rank, world size) from COMMD_NODE_RANK and COMMD_NNODES, or None when neither is set
    (see the module's docstring)."""
    node_raw = os.environ.get("COMMD_NODE_RANK")
    nodes_raw = os.environ.get("COMMD_NNODES")
    if node_raw is None and nodes_raw is None:
        return None
    if node_raw is None or nodes_raw is None:
        have, lack = (("COMMD_NNODES", "COMMD_NODE_RANK") if node_raw is None
                      else ("COMMD_NODE_RANK", "COMMD_NNODES"))
        raise CommdValueError(f"commd: {have} is set but {lack} is not; set both (one "
                              "torchrun --standalone per node) or neither")
    node, nodes = _parse_count("COMMD_NODE_RANK", node_raw), _parse_count("COMMD_NNODES",
                                                                          nodes_raw)
    problem = ranks_bound_problem("COMMD_NNODES", nodes)
    if problem:
        raise CommdValueError(f"commd: {problem}")
    if not 0 <= node < nodes:
        raise CommdValueError(f"commd: COMMD_NODE_RANK={node} must be between 0 and "
                              f"COMMD_NNODES-1 ({nodes - 1})")
    if not 0 <= local_rank < local_world_size:
        raise CommdValueError(f"commd: LOCAL_RANK={local_rank} must be between 0 and "
                              f"LOCAL_WORLD_SIZE-1 ({local_world_size - 1})")
    problem = ranks_bound_problem("COMMD_NNODES * LOCAL_WORLD_SIZE", nodes * local_world_size)
    if problem:
        raise CommdValueError(f"commd: {problem}")
    return node * local_world_size + local_rank, nodes * local_world_size


def _check_multi_node(job: str | None, coordinator: str | None) -> None:
    """One standalone torchrun per node: the run id and MASTER_ADDR are each node's own, so
    the defaults derived from them would form one job per node, each waiting for ranks that
    never come; the job id and the coordinator must be given."""
    for value, variable, keyword in ((job, "COMMD_JOB", "job"),
                                     (coordinator, "COMMD_COORDINATOR", "coordinator")):
        if value is None and not os.environ.get(variable):
            raise CommdValueError(
                f"commd: COMMD_NNODES is above 1 (one torchrun --standalone per node) but "
                f"{variable} is not set: set it (or pass {keyword}=) to the same value on "
                "every node; torchrun's own run id and address differ per node")


@dataclass(frozen=True)
class Identity:
    """Who a client is in its job, and where its daemon is."""

    job: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    coordinator: str
    socket: str


def resolve(
    job: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    local_rank: int | None = None,
    local_world_size: int | None = None,
    coordinator: str | None = None,
    socket: str | None = None,
) -> Identity:
    """Every value given, else read from the environment as torchrun sets it (rank and world
    size from COMMD_NODE_RANK and COMMD_NNODES where set: see the module's docstring)."""
    local = local_rank if local_rank is not None else _read_local_rank()
    local_size = local_world_size if local_world_size is not None else _read_local_world_size()
    if rank is None or world_size is None:
        node = node_identity(local, local_size)
        if node is not None:
            if node[1] > local_size:
                _check_multi_node(job, coordinator)
            rank = node[0] if rank is None else rank
            world_size = node[1] if world_size is None else world_size
    return Identity(
        job=job if job is not None else _read_job(),
        rank=rank if rank is not None else _read_rank(),
        world_size=world_size if world_size is not None else _read_world_size(),
        local_rank=local,
        local_world_size=local_size,
        coordinator=coordinator if coordinator is not None else _read_coordinator(),
        socket=socket if socket is not None else socket_path(),
    )


# resolve()'s parameters shadow the readers of the same names.
_read_job, _read_rank, _read_world_size = job, rank, world_size
_read_local_rank, _read_local_world_size, _read_coordinator = (
    local_rank, local_world_size, coordinator
)
