"""Who a DDP wrapper is in its job: from torch.distributed's process group when there is one,
else from the environment torchrun sets.

With a process group (``dist.init_process_group``, ``mp.spawn`` included) the group wins:
rank and world size are the group's, the local ranks are the group's ranks that share this
rank's daemon (one ``all_gather_object`` of host name and socket path), and the job id is rank
0's. A keyword or an environment variable that contradicts the group is an error, never a
silent one-rank job.

Every wrapper of a process gets its own job: the first ``<job>``, the next ones ``<job>.ddpN``
in construction order, which is the same on every rank (as with torch DDP, every rank must
construct its wrappers in the same order).
"""

from __future__ import annotations

import os
import secrets
import socket as socket_module
from collections import Counter
from typing import Any

import torch.distributed as dist

from commd_protocol import CommdError

from . import env

# Wrappers constructed so far in this process, per base job id.
_CONSTRUCTED: Counter[str] = Counter()


def default_group() -> Any | None:
    """torch.distributed's default group, or None if no process group is initialised."""
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return None


def resolve(
    group: Any | None,
    job: str | None,
    rank: int | None,
    world_size: int | None,
    local_rank: int | None,
    local_world_size: int | None,
    coordinator: str | None,
    socket: str | None,
) -> env.Identity:
    """This wrapper's identity; ``group`` None means the environment alone."""
    if group is None:
        who = env.resolve(job, rank, world_size, local_rank, local_world_size, coordinator,
                          socket)
        return _numbered(who)
    return _numbered(_from_group(group, job, rank, world_size, local_rank, local_world_size,
                                 coordinator, socket))


def _numbered(who: env.Identity) -> env.Identity:
    """The first wrapper keeps the job id; the Nth gets ``.ddpN`` (the same on every rank)."""
    count = _CONSTRUCTED[who.job]
    _CONSTRUCTED[who.job] += 1
    if count == 0:
        return who
    return env.Identity(**{**who.__dict__, "job": f"{who.job}.ddp{count}"})


def _explicit_job(job: str | None) -> str | None:
    """A job id that the user chose (keyword, COMMD_JOB or torchrun's run id), else None."""
    if job is not None:
        return job
    if os.environ.get("COMMD_JOB"):
        return os.environ["COMMD_JOB"]
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    return run_id if run_id and run_id != "none" else None


def _from_group(
    group: Any,
    job: str | None,
    rank: int | None,
    world_size: int | None,
    local_rank: int | None,
    local_world_size: int | None,
    coordinator: str | None,
    socket: str | None,
) -> env.Identity:
    if os.environ.get("COMMD_NNODES"):
        # One torchrun --standalone per node: a process group there is the node's own, and
        # taking the job from it would train each node alone, silently.
        raise CommdError(
            "commd: COMMD_NNODES is set (one torchrun per node, commd forming the job across "
            "them) but a torch.distributed process group is initialised: it is this node's "
            "own. Do not call init_process_group in this pattern (commd takes the ranks from "
            "the COMMD_* variables), or unset COMMD_NNODES")
    group_rank = dist.get_rank(group)
    if group_rank < 0:
        raise CommdError("commd: this process is not a member of the process_group given")
    group_size = dist.get_world_size(group)
    _agree("rank", group_rank, rank, "RANK" if group is dist.group.WORLD else None)
    _agree("world_size", group_size, world_size,
           "WORLD_SIZE" if group is dist.group.WORLD else None)
    socket_path = socket if socket is not None else env.socket_path()
    mine = {
        "host": socket_module.gethostname(),
        "socket": socket_path,
        "job": _explicit_job(job),
        # Rank 0's default, made unique per run: spawned runs share no run id.
        "default_job": f"{env.job()}-{secrets.token_hex(4)}",
    }
    everyone: list[Any] = [None] * group_size
    dist.all_gather_object(everyone, mine, group=group)
    same_daemon = [
        r for r, other in enumerate(everyone)
        if (other["host"], other["socket"]) == (mine["host"], mine["socket"])
    ]
    _agree("local_rank", same_daemon.index(group_rank), local_rank, None)
    _agree("local_world_size", len(same_daemon), local_world_size, None)
    return env.Identity(
        job=_group_job(everyone),
        rank=group_rank,
        world_size=group_size,
        local_rank=same_daemon.index(group_rank),
        local_world_size=len(same_daemon),
        coordinator=coordinator if coordinator is not None else env.coordinator(),
        socket=socket_path,
    )


def _group_job(everyone: list[dict[str, Any]]) -> str:
    chosen = {entry["job"] for entry in everyone}
    if len(chosen) > 1:
        by_rank = {rank: entry["job"] for rank, entry in enumerate(everyone)}
        raise CommdError(
            f"commd: the ranks of the process group chose different job ids: {by_rank} "
            "(COMMD_JOB, TORCHELASTIC_RUN_ID or the job keyword must agree on every rank)"
        )
    explicit = chosen.pop()
    return explicit if explicit is not None else str(everyone[0]["default_job"])


def _agree(name: str, from_group: int, given: int | None, variable: str | None) -> None:
    """CommdError when a keyword or environment variable contradicts the process group."""
    if given is not None and given != from_group:
        raise CommdError(
            f"commd: {name}={given} was given, but the torch.distributed process group says "
            f"{from_group}; the process group decides: leave {name} out"
        )
    raw = os.environ.get(variable) if variable else None
    if raw is not None and raw.strip() != str(from_group):
        raise CommdError(
            f"commd: {variable}={raw} in the environment, but the torch.distributed process "
            f"group says {name} {from_group}; the process group decides: fix or unset "
            f"{variable}"
        )
