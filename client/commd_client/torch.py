"""``DistributedDataParallel`` for PyTorch models, through the node's commd daemon.

A one-line change for torch users::

    from commd_client.torch import DistributedDataParallel
    model = DistributedDataParallel(model)  # torch's signature; defaults from torchrun
    loss.backward()  # returns with every parameter's .grad averaged over all ranks

What it does, as torch's DDP does:

- It *is* a ``torch.nn.parallel.DistributedDataParallel`` (a subclass that never runs torch's
  constructor: no torch reducer, no buckets), so ``isinstance`` checks and unwrap helpers
  work; every method of torch's class that scripts call is commd's here.
- Identity: from torch.distributed's process group when one is initialised (``mp.spawn``
  included), else from torchrun's environment (``_torch_identity``).
- Construction broadcasts rank 0's parameters and buffers to every rank (job ``<job>.init``;
  ``init_sync=False`` skips it).
- Every parameter that requires a gradient is one commd layer; ``.grad`` tensors are views of
  commd's shared buffer (like ``gradient_as_bucket_view=True``), so nothing is copied.
- ``no_sync()`` / ``require_backward_grad_sync`` accumulate gradients locally.
- Parameters that get no gradient are reduced as zeros; with ``find_unused_parameters=False``
  a one-time warning names them (torch would raise).
- Buffers are broadcast before each training forward (``forward_sync_buffers``), unseen by
  autograd's version counters, as in torch (a module called twice before one backward).
- ``join()`` (torch's ``Join``), ``register_comm_hook`` (fp16/bf16 on the wire).
- ``reducer`` and ``logger``: what Lightning and Accelerate call on torch's (``_torch_surface``).
- ``fault_tolerance="continue"`` (commd's own): a lost rank or node costs the survivors a step,
  not a restart; ``world_size`` and ``members`` follow the live ranks.

CUDA models are refused with a CommdError: the GPU path is not available yet. See docs/ddp.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import weakref
from collections.abc import Callable, Iterator, Sequence
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable

from commd_protocol import CommdError, CommdTypeError, CommdValueError, Joining

from . import _torch_rejoin as rejoin
from . import env
from ._torch_common import Broadcaster, Endpoint, broadcast_once, check_cpu
from ._torch_hooks import builtin_hook, low_rank_compression, wire_dtype
from ._torch_identity import resolve
from ._torch_join import DdpJoinHook, announce_sync, common_rank, rescale_by_active
from ._torch_options import TorchOptions, interpret
from ._torch_reducer import Reducer
from ._torch_surface import DdpLogger, ReducerSurface

__all__ = ["CommdError", "DistributedDataParallel"]

_TorchDDP = torch.nn.parallel.DistributedDataParallel


class DistributedDataParallel(_TorchDDP):
    """Data parallelism for a CPU ``nn.Module`` with commd averaging the gradients.

    The parameters are torch 2.13's, in its order (see docs/ddp.md for what each does here),
    then commd's keywords: the Client's (``job``, ``rank``, ``world_size``, ``local_rank``,
    ``local_world_size``, ``coordinator``, ``socket``, ``timeout``; each defaults from the
    process group or torchrun's environment), ``planner`` (commd's merge planner) and
    ``compression`` (``auto``: dense, or PowerSGD where the measured network pays;
    ``powersgd:RANK[:start=N]``, or torch's ``powerSGD_hook`` registered as a comm hook;
    ``topk:RATIO[:EXCHANGE]`` or ``topk:auto``, optionally ``:momentum=M``:
    the daemon keeps the momentum, so build the optimizer without it; without it, top-k under
    ``torch.optim.SGD`` with momentum is momentum-corrected on each rank, the optimizer as it
    is (``_torch_momentum``); default $COMMD_COMPRESSION, else none; with compression every
    parameter counts as used), ``fault_tolerance`` (``"fail"``, torch's semantics: a lost rank
    fails every rank with a CommdError; ``"continue"``: the survivors complete the step in
    flight and go on, gradients averaged over the live ranks; default
    $COMMD_FAULT_TOLERANCE, else ``"fail"``) and ``min_world_size`` (the fewest live ranks
    that go on, 1..world size; default $COMMD_MIN_WORLD_SIZE, else 1). Fault tolerance
    covers the gradients and the per-forward buffer broadcast (whose source becomes the
    lowest live rank when rank 0 is lost); the constructor's broadcasts form while every rank
    is there. ``world_size`` and ``members`` are the current membership's.
    """

    def __init__(  # torch's signature, then commd's keywords
        self,
        module: nn.Module,
        device_ids: Sequence[Any] | None = None,
        output_device: Any = None,
        dim: int = 0,
        broadcast_buffers: bool | None = None,
        init_sync: bool = True,
        process_group: Any = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,  # deprecated in torch; no meaning here
        gradient_as_bucket_view: bool = False,  # always views here
        static_graph: bool = False,  # no meaning here: commd's hooks need no graph
        delay_all_reduce_named_params: Any = None,  # timing only in torch
        param_to_hook_all_reduce: Any = None,  # timing only in torch
        mixed_precision: Any = None,
        device_mesh: Any = None,
        skip_all_reduce_unused_params: bool = False,  # unused ones cost zeros here
        bucket_cap_mb_list: Sequence[float] | None = None,
        batched_grad_copy: bool = False,  # nothing is copied here
        forward_sync_buffers: bool | None = None,
        *,
        job: str | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        local_rank: int | None = None,
        local_world_size: int | None = None,
        coordinator: str | None = None,
        socket: str | None = None,
        timeout: float | None = None,
        planner: str | None = None,
        compression: str | None = None,
        fault_tolerance: str | None = None,
        min_world_size: int | None = None,
    ) -> None:
        """Long only by torch's signature: the body interprets it, resolves who this rank is,
        installs the hooks and broadcasts rank 0's state."""
        nn.Module.__init__(self)
        Joinable.__init__(self)
        options = interpret(
            device_ids=device_ids, output_device=output_device,
            broadcast_buffers=broadcast_buffers, forward_sync_buffers=forward_sync_buffers,
            init_sync=init_sync, process_group=process_group, device_mesh=device_mesh,
            bucket_cap_mb=bucket_cap_mb, bucket_cap_mb_list=bucket_cap_mb_list,
            mixed_precision=mixed_precision, planner=planner,
        )
        check_cpu(module.named_parameters())
        check_cpu(module.named_buffers())
        tolerance = env.fault_tolerance(fault_tolerance)  # before any process talks
        self.module = module
        self._torch_attributes(options, dim, find_unused_parameters, static_graph)
        who = resolve(options.process_group, job, rank, world_size, local_rank,
                      local_world_size, coordinator, socket)
        self.endpoint = Endpoint(**dataclasses.asdict(who), timeout=env.timeout(timeout),
                                 fault_tolerance=tolerance,
                                 min_world_size=env.min_world_size(min_world_size,
                                                                   who.world_size))
        trained = [
            (name, p) for name, p in module.named_parameters() if p.requires_grad and p.numel()
        ]
        if not trained:
            raise CommdError(
                "commd: the module has no parameter that requires a gradient; "
                "DistributedDataParallel has nothing to reduce"
            )
        # Checks every dtype and installs the hooks; no communication yet.
        self._reducer = Reducer(trained, self.endpoint, options.planner, compression)
        self._reducer.warn_unused = not find_unused_parameters
        # torch's reducer and logger as far as frameworks call them (Lightning, Accelerate)
        self.reducer = ReducerSurface(self._reducer)  # type: ignore[assignment]
        self.logger = DdpLogger(  # type: ignore[assignment]
            module, self._reducer.params, world_size=self.endpoint.world_size,
            rank=self.endpoint.rank, broadcast_buffers=bool(self.forward_sync_buffers),
            find_unused_parameters=find_unused_parameters, static_graph=static_graph)
        self._hook_registered = False
        # fault_tolerance="continue": what register_state names, the state received on
        # joining a running job, and the iterations the job had completed then
        self._states: dict[str, rejoin.Stateful] = {}
        self._received: dict[str, Any] | None = None
        self.joined_at_step = 0
        self._buffers_fresh = False  # a joiner's first forward keeps the source's buffers
        self._buffers_sync: Broadcaster | None = None
        self._broadcasters: list[Broadcaster] = []
        self._one_offs = itertools.count(1)  # suffixes of the final-model broadcasts
        self._closed = False
        # Unlinks the shared memory at interpreter exit (or when the wrapper is collected).
        self._finalizer = weakref.finalize(self, _close, self._reducer, self._broadcasters)
        try:
            self._start(options.init_sync, options.init_sync_buffers)
        except BaseException:
            self.close()
            raise

    def _torch_attributes(self, options: TorchOptions, dim: int, find_unused_parameters: bool,
                          static_graph: bool) -> None:
        """torch DDP's public attributes, with what they are here."""
        self.device_ids = None
        self.output_device = None
        self.dim = dim
        self.device = torch.device("cpu")
        self.device_type = "cpu"
        self.process_group = options.process_group  # type: ignore[assignment]  # None: no group
        self.forward_sync_buffers = options.forward_sync_buffers
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = True
        self.static_graph = static_graph
        self.mixed_precision = None
        self.require_forward_param_sync = True
        self._divide_by_initial_world_size = True

    def _start(self, sync: bool, with_buffers: bool) -> None:
        if self.endpoint.world_size == 1:
            return
        if self.endpoint.fault_tolerance == "continue":
            rejoin.prepare_to_join()
            # The gradient jobs first: they tell a replacement that it joins a running job,
            # which then takes a live peer's state instead of rank 0's initial one.
            self._reducer.register_now()
            gradients = self._reducer.gradient_client
            assert gradients is not None  # registered just now
            gradients.on_joining = self._give_state
            self.joined_at_step = gradients.joined_at
            if gradients.joined:
                self._received = rejoin.unpack(rejoin.take_state(
                    self.endpoint, gradients.epoch, gradients.state_source,
                    local=gradients.state_source_local, coordinator=gradients.state_coordinator))
                rejoin.load_module(self.module, self._received)
                self._buffers_fresh = True  # the source's, as its last forward left them
                sync = False
        if sync:
            named = list(self.module.named_parameters())
            broadcast_once(self.endpoint, ".init",
                           named + (list(self.module.named_buffers()) if with_buffers else []))
        if not self._reducer.registered:
            self._reducer.form_order_job()
        has_buffers = any(buffer.numel() for _, buffer in self.module.named_buffers())
        if self.forward_sync_buffers and has_buffers:
            self._buffers_sync = Broadcaster(
                self.endpoint, ".buffers", list(self.module.named_buffers()), tolerant=True
            )
            self._broadcasters.append(self._buffers_sync)

    # --- membership -----------------------------------------------------------------------------

    def register_state(self, name: str, obj: rejoin.Stateful) -> None:
        """Training state a replacement rank must receive besides the model (the optimizer, an
        LR scheduler, the loop's own counter: anything with ``state_dict`` and
        ``load_state_dict``), under ``fault_tolerance="continue"``. On a rank that joined a
        running job, ``obj`` is loaded at once with the live peer's state of ``name``."""
        if not isinstance(name, str) or not name:
            raise CommdTypeError(f"commd: register_state needs a non-empty name, not {name!r}")
        if not (callable(getattr(obj, "state_dict", None))
                and callable(getattr(obj, "load_state_dict", None))):
            raise CommdTypeError(f"commd: register_state({name!r}): {type(obj).__name__} has no "
                                 "state_dict/load_state_dict")
        if name in self._states:
            raise CommdValueError(f"commd: register_state({name!r}) twice")
        self._states[name] = obj
        if self._received is not None:
            rejoin.load_state(name, obj, self._received)

    def _give_state(self, notice: Joining) -> None:
        """Ranks joined the running job; the source gives each the training state (inside
        its wait for the iteration they complete, so with exactly the updates they need)."""
        if self.endpoint.rank != notice.source:
            return
        blob = rejoin.pack(self.module, self._states, notice.iteration)
        for joiner in notice.ranks:
            rejoin.give_state(self.endpoint, notice.epoch, joiner, blob,
                              local=joiner in notice.local, coordinator=notice.coordinator)

    @property
    def world_size(self) -> int:
        """How many ranks train now: the job's world size until a rank is lost under
        ``fault_tolerance="continue"``, then the current epoch's (re-shard data by it)."""
        return len(self.members)

    @property
    def members(self) -> list[int]:
        """The ranks of the current membership epoch, ascending, as the gradient job last
        reported them (every rank before the first backward)."""
        gradients = self._reducer.gradient_client
        if gradients is not None:
            return gradients.members
        return list(range(self.endpoint.world_size))

    # --- training -------------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not self._closed:
            grad_enabled = torch.is_grad_enabled()
            if grad_enabled:
                self._reducer.prepare_forward()
            self._join_forward()
            if self._buffers_fresh:  # joined: this step's buffer broadcast ran before it
                self._buffers_fresh = False
            elif self.will_sync_module_buffers():
                source = 0
                if self._join_config.enable:  # rank 0 may have joined: its buffers are stale
                    source = common_rank(self.process_group, self.endpoint.rank, True)
                self.sync_buffers_from(source)
            if self._join_config.enable:
                announce_sync(self.process_group, self._reducer.require_sync)
        output = self.module(*args, **kwargs)
        if not self._closed:
            # torch's _post_forward: decided after the module ran, so sync turned off inside
            # the forward (Lightning's manual optimisation) skips the next buffer broadcast
            self.require_forward_param_sync = (torch.is_grad_enabled()
                                               and self._reducer.require_sync)
        return output

    def _join_forward(self) -> None:
        """Inside ``join()``: tell the joined ranks that this one still trains."""
        self._reducer.after_reduce = None
        work = Join.notify_join_context(self)
        if work is not None and not self._divide_by_initial_world_size:
            params, world = self._reducer.params, self.endpoint.world_size
            self._reducer.after_reduce = lambda: rescale_by_active(work, params, world)

    def will_sync_module_buffers(self) -> bool:
        return self._buffers_sync is not None and self.require_forward_param_sync

    def sync_buffers_from(self, source: int) -> None:
        """Every rank takes rank ``source``'s synced buffers (each forward, and torch's
        join protocol)."""
        assert self._buffers_sync is not None
        named = list(self.module.named_buffers())
        # As torch's _sync_buffers: a module called twice before one backward saved these
        # buffers (BatchNorm's running stats) for its backward; the copy must not bump their
        # version counters, or that backward raises "modified by an inplace operation".
        with torch.autograd._unsafe_preserve_version_counter(tuple(b for _, b in named)):
            self._buffers_sync.run(named, source)

    def take_model_from(self, source: int) -> None:
        """Everyone takes rank ``source``'s parameters (and synced buffers): end of a join."""
        named = list(self.module.named_parameters())
        if self.forward_sync_buffers:
            named += list(self.module.named_buffers())
        broadcast_once(self.endpoint, f".final{next(self._one_offs)}", named, source)

    @property
    def require_backward_grad_sync(self) -> bool:
        return self._reducer.require_sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self._reducer.require_sync = value

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the first backward after the block reduces them.

        As with torch DDP, the forward must run inside the block too.
        """
        previous = self._reducer.require_sync
        self._reducer.require_sync = False
        try:
            yield
        finally:
            self._reducer.require_sync = previous

    # --- torch DDP's other methods ------------------------------------------------------------

    def join(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> Join:
        """torch's uneven-inputs context manager: ranks out of data shadow the others'
        reductions with zeros; at the end every rank takes the last joiner's model."""
        if self.process_group is None:
            raise CommdError(
                "commd: join() counts the ranks still training over torch.distributed's "
                "process group, as torch's Join does: call "
                "torch.distributed.init_process_group('gloo') before wrapping the model"
            )
        self.logger._set_uneven_input_join()  # type: ignore[union-attr]
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs: Any) -> DdpJoinHook:
        self._divide_by_initial_world_size = kwargs.get("divide_by_initial_world_size", True)
        return DdpJoinHook(self)

    @property
    def join_rank(self) -> int:
        return self.endpoint.rank

    def shadow_reduction(self) -> None:
        """A rank out of data takes part in the others' reduction with zeros (torch's join
        protocol)."""
        self._reducer.shadow()

    @property
    def join_device(self) -> torch.device:
        device: torch.device = self.device
        return device

    @property
    def join_process_group(self) -> Any:
        return self.process_group

    def register_comm_hook(self, state: object, hook: Callable[..., Any]) -> None:
        """torch's standard hooks: ``allreduce_hook`` (commd's default),
        ``fp16_compress_hook`` and ``bf16_compress_hook`` (half precision on the wire),
        ``powerSGD_hook`` with its ``PowerSGDState`` (the daemon's PowerSGD); anything else
        is refused with the reason. Once, before the first backward."""
        if self._hook_registered:
            raise CommdError("commd: register_comm_hook can only be called once (as in torch)")
        compression = low_rank_compression(state, hook)
        if compression is not None:
            self._reducer.set_compression(compression)
        self._reducer.set_wire_dtype(wire_dtype(hook))
        name = getattr(hook, "__qualname__", repr(hook))  # torch logs the qualname
        self.logger._set_comm_hook_name(name)  # type: ignore[union-attr]
        self._hook_registered = True

    def _register_builtin_comm_hook(self, comm_hook_type: Any) -> None:
        self.register_comm_hook(None, builtin_hook(comm_hook_type))

    def _set_static_graph(self) -> None:
        self.static_graph = True  # commd's hooks work the same with or without
        self.logger._set_static_graph()  # type: ignore[union-attr]

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(
            "commd's DistributedDataParallel cannot be pickled or deep-copied: it holds shared "
            "memory and a daemon connection; checkpoint model.module.state_dict() instead"
        )

    # --- lifecycle ------------------------------------------------------------------------------

    def close(self) -> None:
        """Leave the jobs and unlink the shared memory; ``.grad`` tensors stay readable. The
        wrapper becomes a pass-through to the module, which can be wrapped again."""
        self._closed = True
        self._finalizer()

    def __enter__(self) -> DistributedDataParallel:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _close(reducer: Reducer, broadcasters: list[Broadcaster]) -> None:
    reducer.close()
    for broadcaster in broadcasters:
        with contextlib.suppress(Exception):
            broadcaster.close()
