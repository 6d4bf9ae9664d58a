"""Client defaults, read from the environment the way torchrun sets it."""

from __future__ import annotations

import os
from dataclasses import dataclass

from commd_protocol import DEFAULT_PEER_PORT, DEFAULT_SOCKET, CommdError


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
    """Every value given, else read from the environment as torchrun sets it."""
    return Identity(
        job=job if job is not None else _read_job(),
        rank=rank if rank is not None else _read_rank(),
        world_size=world_size if world_size is not None else _read_world_size(),
        local_rank=local_rank if local_rank is not None else _read_local_rank(),
        local_world_size=(
            local_world_size if local_world_size is not None else _read_local_world_size()
        ),
        coordinator=coordinator if coordinator is not None else _read_coordinator(),
        socket=socket if socket is not None else socket_path(),
    )


# resolve()'s parameters shadow the readers of the same names.
_read_job, _read_rank, _read_world_size = job, rank, world_size
_read_local_rank, _read_local_world_size, _read_coordinator = (
    local_rank, local_world_size, coordinator
)
