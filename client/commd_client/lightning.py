"""PyTorch Lightning's ``DDPStrategy`` with commd averaging the gradients.

Lightning users change one argument::

    import commd_client.lightning  # registers strategy="commd" (and "commd_spawn")
    trainer = Trainer(accelerator="cpu", devices=2, strategy="commd")
    # or, with commd's options as keywords:
    trainer = Trainer(accelerator="cpu", devices=2,
                      strategy=CommdDDPStrategy(compression="topk:auto"))

Everything Lightning's ``DDPStrategy`` does stays Lightning's: its launchers (the default
re-runs the script once per extra device, ``start_method="popen"``, as ``strategy="ddp"``;
``"commd_spawn"`` / ``start_method="spawn"`` as ``"ddp_spawn"``; torchrun and other external
launchers are detected as usual), the Gloo process group it
initialises, samplers, checkpoints, ``trainer.test``. Only the wrapper differs:
``_setup_model`` wraps with ``commd_client.torch.DistributedDataParallel``, which takes its
rank and local ranks from Lightning's process group and its daemon from ``COMMD_SOCKET`` or
``socket=``. What the wrapper cannot do is refused here, at construction where the arguments
say it, before any process is started: a CUDA device, communication hooks other than
torch's allreduce / fp16 / bf16 compress hooks, ``ddp_comm_wrapper``, post-local-SGD model
averaging, a backend other than Gloo. See docs/ddp.md ("Porting a script").
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from torch.nn import Module

from commd_protocol import CommdError, CommdTypeError, CommdValueError

from ._framework_options import commd_keywords
from ._torch_common import GPU_MESSAGE
from ._torch_hooks import low_rank_compression, wire_dtype
from .torch import DistributedDataParallel

__all__ = ["CommdDDPStrategy", "CommdError"]

NAME = "commd"

# torch DDP's constructor keywords a strategy may pass through ``**kwargs`` (as DDPStrategy
# does): everything of the wrapper's signature before commd's keyword-only options, except
# what Lightning itself passes (the module and its device ids).
_DDP_KEYWORDS = frozenset(
    name for name, parameter in inspect.signature(DistributedDataParallel).parameters.items()
    if parameter.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    and name not in ("module", "device_ids")
)


class CommdDDPStrategy(DDPStrategy):
    """``DDPStrategy`` whose model wrapper is commd's ``DistributedDataParallel`` (CPU, Gloo).

    Lightning's own arguments keep their meaning (``timeout`` is the process group's, a
    ``timedelta``). commd's options are keywords: ``compression`` (``auto``,
    ``powersgd:RANK``, ``topk:RATIO[:EXCHANGE]``, ``topk:auto``, optionally ``:momentum=M``),
    ``planner``, ``socket`` (default
    ``$COMMD_SOCKET``), ``coordinator``, ``job`` and ``commd_timeout`` (seconds for every wait
    on the daemon; ``timeout`` is taken by Lightning). Every other keyword is one of torch
    DDP's constructor keywords (``find_unused_parameters``, ``broadcast_buffers``,
    ``bucket_cap_mb``, …), as for ``DDPStrategy``; anything else is a TypeError naming it.
    """

    strategy_name = NAME

    def __init__(
        self,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        ddp_comm_state: object | None = None,
        ddp_comm_hook: Callable[..., Any] | None = None,
        ddp_comm_wrapper: Callable[..., Any] | None = None,
        model_averaging_period: int | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        *,
        compression: str | None = None,
        planner: str | None = None,
        socket: str | None = None,
        coordinator: str | None = None,
        job: str | None = None,
        commd_timeout: float | None = None,
        **kwargs: Any,
    ) -> None:
        unknown = sorted(set(kwargs) - _DDP_KEYWORDS)
        if unknown:
            raise CommdTypeError(
                f"commd: CommdDDPStrategy got unknown keyword(s) {', '.join(unknown)}; it takes "
                "Lightning's DDPStrategy arguments, commd's compression, planner, socket, "
                "coordinator, job, commd_timeout, and torch DDP's constructor keywords "
                f"({', '.join(sorted(_DDP_KEYWORDS))})"
            )
        _refuse_unsupported(ddp_comm_state, ddp_comm_hook, ddp_comm_wrapper,
                            model_averaging_period, process_group_backend)
        options = commd_keywords(
            "CommdDDPStrategy", compression=compression, planner=planner, socket=socket,
            coordinator=coordinator, job=job, commd_timeout=commd_timeout,
        )
        super().__init__(
            accelerator=accelerator, parallel_devices=parallel_devices,
            cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin, ddp_comm_state=ddp_comm_state,
            ddp_comm_hook=ddp_comm_hook, process_group_backend=process_group_backend,
            timeout=timeout, start_method=start_method, **kwargs,
        )
        self._commd_options = options

    @property
    def commd_options(self) -> dict[str, Any]:
        """The keywords handed to commd's wrapper (those given; the rest from the environment)."""
        return dict(self._commd_options)

    def setup_environment(self) -> None:
        # Refused before the process group forms: commd's wrapper reduces CPU tensors only.
        if self.root_device.type != "cpu":
            raise CommdError(
                f"commd: CommdDDPStrategy got device {self.root_device}; {GPU_MESSAGE}. "
                "Use Trainer(accelerator='cpu', ...)"
            )
        super().setup_environment()

    def _setup_model(self, model: Module) -> DistributedDataParallel:
        """Wraps the model in commd's ``DistributedDataParallel`` (Lightning: torch's)."""
        return DistributedDataParallel(module=model, **self._ddp_kwargs, **self._commd_options)

    def _register_ddp_hooks(self) -> None:
        # Lightning registers hooks on CUDA only (torch's reducer ran them only there);
        # commd runs the fp16 / bf16 hooks on the CPU, so a hook given is a hook honoured.
        if self._ddp_comm_hook is not None:
            assert isinstance(self.model, DistributedDataParallel)
            self.model.register_comm_hook(self._ddp_comm_state, self._ddp_comm_hook)

    def teardown(self) -> None:
        # Lightning unwraps the model and drops the wrapper; commd's holds daemon jobs and
        # shared memory, so it is closed here rather than left to the garbage collector.
        wrapper = self.model if isinstance(self.model, DistributedDataParallel) else None
        try:
            super().teardown()
        finally:
            if wrapper is not None:
                wrapper.close()

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """``"commd"`` (popen, as ``"ddp"``) and ``"commd_spawn"`` (as ``"ddp_spawn"``);
        DDPStrategy's own names stay Lightning's."""
        for name, start_method in ((NAME, "popen"), (f"{NAME}_spawn", "spawn")):
            strategy_registry.register(
                name, cls, override=True, start_method=start_method,
                description=f"DDP with commd averaging the gradients (CPU, Gloo), "
                            f"start_method {start_method!r}",
            )


def _refuse_unsupported(state: object | None, hook: Callable[..., Any] | None,
                        wrapper: Callable[..., Any] | None, averaging_period: int | None,
                        backend: str | None) -> None:
    """What DDPStrategy accepts but commd's daemon cannot do: a clear error, before launch."""
    if hook is not None:
        wire_dtype(hook)  # CommdError naming the hook unless allreduce / fp16 / bf16 / PowerSGD
        low_rank_compression(state, hook)  # PowerSGD: CommdError unless a PowerSGDState
    if wrapper is not None:
        raise CommdValueError(
            f"commd: ddp_comm_wrapper={getattr(wrapper, '__qualname__', wrapper)!r} is not "
            "supported: it wraps a custom hook, which cannot run in commd's daemon; pass "
            "ddp_comm_hook=default_hooks.fp16_compress_hook (or bf16_compress_hook) alone"
        )
    if averaging_period is not None or type(state).__name__ == "PostLocalSGDState":
        raise CommdValueError(
            "commd: model_averaging_period / PostLocalSGDState (post-local SGD model "
            "averaging) is not supported: commd averages every step's gradients; for less "
            "traffic use compression='auto'"
        )
    if backend is not None and backend != "gloo":
        raise CommdValueError(
            f"commd: process_group_backend={backend!r}; commd's wrapper runs on the CPU with "
            "a Gloo process group: leave it unset or pass 'gloo'"
        )


CommdDDPStrategy.register_strategies(StrategyRegistry)
