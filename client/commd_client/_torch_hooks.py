"""torch DDP communication hooks, mapped to what commd's daemon does.

A hook runs inside torch's reducer on every bucket; commd reduces in the daemon, so arbitrary
Python hooks cannot run. torch's standard ones map: ``allreduce_hook`` is commd's plain
average, ``fp16_compress_hook`` / ``bf16_compress_hook`` reduce the gradients in half
precision on the wire, ``powerSGD_hook`` with its ``PowerSGDState`` becomes the daemon's
PowerSGD (``compression="powersgd:…"``). Other hooks are refused, saying which map.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from commd_protocol import CommdError


def wire_dtype(hook: Callable[..., Any]) -> torch.dtype | None:
    """The dtype gradients travel in under ``hook`` (None: their own), or CommdError."""
    if not callable(hook):
        raise CommdError(f"commd: register_comm_hook needs a callable hook, got {hook!r}")
    if hook is default_hooks.allreduce_hook:
        return None
    if hook is default_hooks.fp16_compress_hook:
        return torch.float16
    if hook is default_hooks.bf16_compress_hook:
        return torch.bfloat16
    if hook is powerSGD_hook.powerSGD_hook:
        return None  # float32 on the wire: the daemon's PowerSGD (``low_rank_compression``)
    name = getattr(hook, "__qualname__", None) or repr(hook)
    if "powerSGD" in name or "powersgd" in getattr(hook, "__module__", "").lower():
        raise CommdError(
            f"commd: the PowerSGD hook {name} has no counterpart in commd's daemon; register "
            "torch's powerSGD_hook (commd runs it in the daemon, see docs/compression.md), "
            "or pass compression='powersgd:RANK' to DistributedDataParallel"
        )
    raise CommdError(
        f"commd: the communication hook {name} cannot run in commd's daemon, which reduces "
        "the gradients itself; supported: default_hooks.allreduce_hook, fp16_compress_hook, "
        "bf16_compress_hook, powerSGD_hook.powerSGD_hook (and compression='topk:...' for "
        "sparsification)"
    )


def low_rank_compression(state: object, hook: Callable[..., Any]) -> str | None:
    """The compression spec of the daemon's PowerSGD for torch's ``powerSGD_hook`` with
    ``state`` (a ``PowerSGDState``: its rank, start iteration, minimum compression rate, error
    feedback, warm start and epsilon carry over); None for any other hook. CommdError for a
    state that is not a ``PowerSGDState``."""
    if hook is not powerSGD_hook.powerSGD_hook:
        return None
    if not isinstance(state, powerSGD_hook.PowerSGDState):
        raise CommdError(f"commd: powerSGD_hook needs a PowerSGDState as its state, got "
                         f"{type(state).__name__}")
    if state.process_group is not None:
        raise CommdError("commd: PowerSGDState(process_group=...) must be None under commd: the "
                         "daemons reduce over the job's ranks")
    # torch keeps only the seeded generator; its next draw stands for the seed (the same on
    # every rank that seeded it alike; a copy, so the user's generator does not move)
    seed = int(copy.deepcopy(state.rng).randint(0, 2**31 - 1))
    # the daemon checks the values (a refusal reaches every rank at registration)
    return (f"powersgd:{state.matrix_approximation_rank}:start={state.start_powerSGD_iter}"
            f":min_rate={state.min_compression_rate:g}"
            f":feedback={int(bool(state.use_error_feedback))}:warm={int(bool(state.warm_start))}"
            f":epsilon={state.orthogonalization_epsilon:g}:seed={seed}")


def builtin_hook(comm_hook_type: Any) -> Callable[..., Any]:
    """torch's ``BuiltinCommHookType`` as the hook it stands for."""
    if comm_hook_type == dist.BuiltinCommHookType.FP16_COMPRESS:
        return default_hooks.fp16_compress_hook
    if comm_hook_type == dist.BuiltinCommHookType.ALLREDUCE:
        return default_hooks.allreduce_hook
    raise CommdError(f"commd: unknown built-in comm hook {comm_hook_type!r}")
