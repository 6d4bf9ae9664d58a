"""torch DDP communication hooks, mapped to what commd's daemon does.

A hook runs inside torch's reducer on every bucket; commd reduces in the daemon, so arbitrary
Python hooks cannot run. torch's standard ones map: ``allreduce_hook`` is commd's plain
average, ``fp16_compress_hook`` / ``bf16_compress_hook`` reduce the gradients in half
precision on the wire. PowerSGD and custom hooks are refused with a pointer to commd's own
compression.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

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
    name = getattr(hook, "__qualname__", None) or repr(hook)
    if "powerSGD" in name or "powersgd" in getattr(hook, "__module__", "").lower():
        raise CommdError(
            f"commd: the PowerSGD hook ({name}) cannot run in commd's daemon; use commd's "
            "compression instead: DistributedDataParallel(model, compression='topk:0.01') "
            "(or 'topk:auto'), see docs/compression.md"
        )
    raise CommdError(
        f"commd: the communication hook {name} cannot run in commd's daemon, which reduces "
        "the gradients itself; supported: default_hooks.allreduce_hook, fp16_compress_hook, "
        "bf16_compress_hook (and compression='topk:...' for sparsification)"
    )


def builtin_hook(comm_hook_type: Any) -> Callable[..., Any]:
    """torch's ``BuiltinCommHookType`` as the hook it stands for."""
    if comm_hook_type == dist.BuiltinCommHookType.FP16_COMPRESS:
        return default_hooks.fp16_compress_hook
    if comm_hook_type == dist.BuiltinCommHookType.ALLREDUCE:
        return default_hooks.allreduce_hook
    raise CommdError(f"commd: unknown built-in comm hook {comm_hook_type!r}")
