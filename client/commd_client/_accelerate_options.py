"""What commd's ``Accelerator`` is given, checked before Accelerate sets anything up.

Two kinds of input besides commd's own keywords (``_framework_options``): the
``DistributedDataParallelKwargs`` handler Accelerate turns into torch DDP's keywords, and the
plugins of the parallelisms commd cannot stand in for (FSDP, DeepSpeed, Megatron-LM, tensor
parallelism). Each failure is a ``CommdError`` (a ``CommdTypeError`` or ``CommdValueError``
where the value is of the wrong kind or out of range) naming the argument, raised before a
process group or daemon connection exists, so a misconfigured script fails on every rank alike
and at once, also when it runs as a single process.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs

from commd_protocol import CommdError, CommdTypeError, CommdValueError

# Accelerate's constructor arguments that select a parallelism other than data parallelism.
REFUSED_PLUGINS = ("deepspeed_plugin", "deepspeed_plugins", "fsdp_plugin", "megatron_lm_plugin",
                   "torch_tp_plugin", "parallelism_config")

# The hooks commd's wrapper runs (fp16 / bf16 on the wire); PowerSGD is compression='powersgd:R'.
_HOOKS = (DDPCommunicationHookType.NO, DDPCommunicationHookType.FP16,
          DDPCommunicationHookType.BF16)
_BOOL_FIELDS = ("broadcast_buffers", "find_unused_parameters", "check_reduction",
                "gradient_as_bucket_view", "static_graph")


def refuse_plugins(arguments: Mapping[str, Any]) -> None:
    """FSDP, DeepSpeed, Megatron-LM and tensor parallelism shard or split the model; commd
    reduces whole gradients of a replicated one."""
    for name in REFUSED_PLUGINS:
        if arguments.get(name) is not None:
            raise CommdError(
                f"commd: Accelerator({name}=...) is not supported: commd's Accelerator does "
                "data parallelism with commd's DistributedDataParallel only (FSDP, DeepSpeed, "
                "Megatron-LM and tensor parallelism are not); use accelerate.Accelerator for it"
            )


def check_ddp_kwargs(handlers: Iterable[Any] | None) -> None:
    """The ``DistributedDataParallelKwargs`` among ``kwargs_handlers``: every field of the
    right kind, and a communication hook commd's wrapper runs."""
    for handler in handlers or ():
        if isinstance(handler, DistributedDataParallelKwargs):
            _check_ddp_handler(handler)


def _check_ddp_handler(handler: DistributedDataParallelKwargs) -> None:
    def bad(field: str, value: Any, want: str) -> str:
        return (f"commd: DistributedDataParallelKwargs({field}={value!r:.60}) is not valid: "
                f"{field} must be {want}")

    for field in _BOOL_FIELDS:
        value = getattr(handler, field)
        if not isinstance(value, bool):
            raise CommdTypeError(bad(field, value, "True or False"))
    if isinstance(handler.dim, bool) or not isinstance(handler.dim, int):
        raise CommdTypeError(bad("dim", handler.dim, "an int"))
    cap = handler.bucket_cap_mb
    if isinstance(cap, bool) or not isinstance(cap, int | float):
        raise CommdTypeError(bad("bucket_cap_mb", cap, "a positive number of megabytes"))
    if not cap > 0:
        raise CommdValueError(bad("bucket_cap_mb", cap, "a positive number of megabytes"))
    hook, wrapper = handler.comm_hook, handler.comm_wrapper
    if hook not in _HOOKS:
        raise CommdValueError(
            f"commd: DistributedDataParallelKwargs(comm_hook={hook}) is not supported: commd's "
            "daemon runs no Python hooks; comm_hook may be 'no', 'fp16' or 'bf16' (half "
            "precision on the wire), and for PowerSGD pass it as commd's compression, which "
            "the daemon runs: Accelerator(compression='powersgd:4')"
        )
    if wrapper != DDPCommunicationHookType.NO and hook != DDPCommunicationHookType.NO:
        raise CommdValueError(
            f"commd: DistributedDataParallelKwargs(comm_wrapper={wrapper}) around "
            f"comm_hook={hook} is not supported: choose comm_hook='fp16' or 'bf16' alone"
        )
