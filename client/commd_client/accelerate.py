"""Hugging Face Accelerate with commd averaging the gradients: one import changes.

::

    # from accelerate import Accelerator
    from commd_client.accelerate import Accelerator

    accelerator = Accelerator(cpu=True, compression="topk:auto")  # commd's keywords optional
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

``Accelerator`` is accelerate's, with one difference: where accelerate 1.16's
``prepare_model`` wraps a model for multi-process CPU training (``DistributedType.MULTI_CPU``,
Gloo) in ``torch.nn.parallel.DistributedDataParallel(model, **kwargs)`` — a hard-coded class —
this one wraps it in ``commd_client.torch.DistributedDataParallel`` with the same keywords (from
``DistributedDataParallelKwargs``) plus commd's own. Everything else is accelerate's code:
``accumulate``, ``no_sync``, ``trigger_sync_in_backward``, ``clip_grad_norm_``, ``unwrap_model``,
``save_state`` / ``load_state`` work through the torch DDP surface commd's wrapper has (it is a
subclass of torch's class, with ``no_sync``, ``reducer.prepare_for_backward`` and
``require_forward_param_sync``). Without distribution (one process) nothing is wrapped and no
daemon is needed, as with stock accelerate.

commd's keywords, the same as ``commd_client.lightning.CommdDDPStrategy``'s: ``compression``,
``planner``, ``socket``, ``coordinator`` and ``job`` (as the wrapper's), and ``commd_timeout``
(the wrapper's ``timeout``, named apart from the process group's timeout that accelerate's
``InitProcessGroupKwargs`` sets). Refused with a ``CommdError`` naming what: FSDP, DeepSpeed,
Megatron-LM and tensor-parallel plugins or launches, a GPU distributed type, comm hooks other
than fp16 / bf16 (``_accelerate_options``). See docs/ddp.md, "Porting a script".
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
from typing import Any

import accelerate
import torch
from accelerate.utils import DistributedType

from commd_protocol import CommdError

from ._accelerate_options import check_ddp_kwargs, refuse_plugins
from ._framework_options import commd_keywords
from .torch import DistributedDataParallel

__all__ = ["Accelerator", "CommdError"]

logger = logging.getLogger("commd_client")

_STOCK_SIGNATURE = inspect.signature(accelerate.Accelerator.__init__)


class Accelerator(accelerate.Accelerator):  # type: ignore[misc]  # accelerate has no types
    """``accelerate.Accelerator`` whose ``prepare`` / ``prepare_model`` wrap with commd's
    ``DistributedDataParallel`` under multi-process CPU training.

    Takes accelerate's arguments unchanged, then commd's keyword-only ones: ``compression``
    (``auto``, ``powersgd:RANK``, ``topk:RATIO[:EXCHANGE]``, ``topk:auto``, optionally
    ``:momentum=M``), ``planner``,
    ``socket``, ``coordinator``, ``job`` and ``commd_timeout`` (seconds);
    each defaults as in ``commd_client.torch.DistributedDataParallel`` (``COMMD_*``, torchrun's
    environment, the process group).
    """

    def __init__(
        self,
        *args: Any,
        compression: str | None = None,
        planner: str | None = None,
        socket: str | None = None,
        coordinator: str | None = None,
        job: str | None = None,
        commd_timeout: float | None = None,
        **kwargs: Any,
    ) -> None:
        # Everything is checked before accelerate initialises a process group, so a bad
        # argument fails every rank the same way, at once.
        self._commd: dict[str, Any] = commd_keywords(
            "Accelerator", compression=compression, planner=planner, socket=socket,
            coordinator=coordinator, job=job, commd_timeout=commd_timeout)
        arguments = _STOCK_SIGNATURE.bind(self, *args, **kwargs).arguments
        refuse_plugins(arguments)
        check_ddp_kwargs(arguments.get("kwargs_handlers"))
        super().__init__(*args, **kwargs)
        self._check_distributed_type()

    def _check_distributed_type(self) -> None:
        kind = self.distributed_type
        if kind == DistributedType.MULTI_CPU:
            return
        if kind != DistributedType.NO:
            raise CommdError(
                f"commd: accelerate chose {kind}; commd's Accelerator trains on CPUs "
                "(DistributedType.MULTI_CPU: Accelerator(cpu=True) or ACCELERATE_USE_CPU=true, "
                "Gloo), or in a single process; FSDP, DeepSpeed, Megatron-LM and GPUs are not "
                "supported"
            )
        world = os.environ.get("WORLD_SIZE", "1")
        if world.isdigit() and int(world) > 1:
            # Stock accelerate does the same (each rank trains alone), but a script that
            # changed its import to get commd almost certainly meant to be distributed.
            logger.warning(
                "commd: WORLD_SIZE=%s, but accelerate runs without distribution, so every rank "
                "trains alone and commd is not used: on a machine without GPUs pass "
                "Accelerator(cpu=True) (or set ACCELERATE_USE_CPU=true) for multi-process CPU "
                "training", world)

    def prepare_model(self, model: torch.nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False) -> Any:
        """accelerate's ``prepare_model``, with commd's wrapper in place of torch's DDP."""
        if (evaluation_mode or self.distributed_type != DistributedType.MULTI_CPU
                or getattr(model, "_is_accelerate_prepared", False)):
            return super().prepare_model(model, device_placement, evaluation_mode)
        # accelerate's MULTI_CPU branch constructs torch's class by name. Its evaluation mode
        # runs every other step of the preparation (mixed-precision forward, placement, the
        # bookkeeping in self._models, torch.compile when configured) and skips only that
        # wrap, which is then made here — without patching torch's class for everyone.
        prepared = super().prepare_model(model, device_placement, evaluation_mode=True)
        # As in accelerate, only the outermost object carries the mark; on the module inside,
        # it would make a second prepare() of that module return it unwrapped.
        with contextlib.suppress(AttributeError):
            del prepared._is_accelerate_prepared
        keywords = self.ddp_handler.to_kwargs() if self.ddp_handler is not None else {}
        wrapped = DistributedDataParallel(prepared, **keywords, **self._commd)
        if self.ddp_handler is not None:
            self.ddp_handler.register_comm_hook(wrapped)  # fp16 / bf16 only (checked at init)
        wrapped._is_accelerate_prepared = True  # type: ignore[assignment]  # as accelerate's
        return wrapped
