"""Gradient reduction for the PyTorch wrapper: autograd hooks that hand gradients to commd.

Lifecycle of the gradient buffers:

- Before the first synchronising backward nothing is registered: gradients live in ordinary
  tensors and a post-accumulate-grad hook records the order in which they become ready.
- At the end of that backward rank 0's observed order is broadcast (so every rank registers
  the same layer list), one commd job per gradient dtype is registered with the layers in
  that order (the flat buffer is laid out in backward order, so the planner's groups are
  contiguous), the gradients are copied in, reduced, and every ``.grad`` becomes a view of
  the shared buffer, where the daemon leaves the result: nothing is copied out.
- ``zero_grad()`` sets ``.grad`` to None and autograd hands the next gradient over as a fresh
  tensor: its hook copies it into the view, one pass (the correction's velocity is written
  from it in that pass) and makes ``.grad`` the view again. Re-attaching zeroed views at the
  forward would cost a zeroing pass plus autograd's accumulation into them.
- Later backwards report each parameter ready from its hook (``client.ready``); a callback
  queued on the autograd engine marks the rest (unused parameters: zeros, or what their
  ``.grad`` holds) and waits, so ``backward()`` returns with averaged gradients.
- The layout stays as observed in the first iteration. If the order changes later it still
  works — readiness is per layer and a group starts when all its layers are ready — only
  with less overlap of communication and backward.

With a half-precision comm hook the buffers hold the wire dtype and gradients are cast in and
out instead (``_torch_slots``), with torch's hook's arithmetic: each rank divides its
half-precision gradient by the world size and the job is a sum (op ``sum``), not an average.

Each job has one extra layer in front, ``commd:used``: 1 for every parameter that got a
gradient on this rank since the last reduction. After the reduction (an average, or under a
hook a sum: a count of ranks) zero tells which parameters no rank used; those whose ``.grad``
was None before keep None, as in torch DDP.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch.utils.hooks import RemovableHandle

from commd_protocol import CommdError

from ._torch_common import Broadcaster, Endpoint, as_tensor, broadcast_order, grad_dtype, order_job
from ._torch_momentum import MomentumCorrection, StepHook, step_hook_for
from ._torch_slots import Bucket, Slots
from .client import Client

USED_LAYER = "commd:used"
_UNUSED_SHOWN = 10  # names in the unused-parameter warning

logger = logging.getLogger("commd_client")


class Reducer:
    """Hooks on the parameters; reduces their gradients through commd at each backward."""

    def __init__(
        self,
        named: Sequence[tuple[str, torch.nn.Parameter]],
        endpoint: Endpoint,
        planner: str | None,
        compression: str | None = None,
    ) -> None:
        self.names = [name for name, _ in named]
        self.params = [param for _, param in named]
        self.dtypes = [grad_dtype(name, param.dtype) for name, param in named]
        self.endpoint = endpoint
        self.planner = planner
        self.compression = compression
        self.require_sync = True  # no_sync() turns it off
        self.warn_unused = False  # find_unused_parameters=False: say what torch would raise
        self.after_reduce: Callable[[], None] | None = None  # set per forward (join)
        self.wire_dtype: torch.dtype | None = None  # a half-precision comm hook's
        self._sync_backward = True  # decided at forward, as torch DDP does
        self._observed: dict[int, None] = {}  # first-seen order before registration
        self._slots = Slots(self.params, staged=False)
        count = len(self.params)
        self._used = np.zeros(count, dtype=bool)  # got a gradient since the last reduction
        self._marked = np.zeros(count, dtype=bool)  # reported ready in this backward
        self._queued = False
        self._warned = False
        self._failure: BaseException | None = None
        self._order: Broadcaster | None = None  # job <job>.order until the first backward
        # top-k under the optimizer's own SGD momentum: DGC's correction on this rank (or,
        # with the daemon's momentum, the check that the optimizer keeps none of its own)
        self._step_hook: StepHook | None = step_hook_for(self.params, compression)
        self._handles: list[RemovableHandle] = [
            param.register_post_accumulate_grad_hook(self._hook(index))
            for index, param in enumerate(self.params)
        ]

    @property
    def correction(self) -> MomentumCorrection | None:
        """The rank's momentum correction, where the compression has one."""
        hook = self._step_hook
        return hook if isinstance(hook, MomentumCorrection) else None

    @property
    def registered(self) -> bool:
        return bool(self._slots.buckets)

    @property
    def gradient_client(self) -> Client | None:
        """The client of the gradient job ``<job>`` (the first bucket's): it hears of the
        membership; None before registration."""
        return self._slots.buckets[0].client if self._slots.buckets else None

    def set_compression(self, compression: str) -> None:
        """Compress as ``compression`` says (a comm hook that maps to the daemon's PowerSGD);
        only before the first reduction, and not on top of another compression."""
        self._check_unregistered()
        if self.compression not in (None, "", "none"):
            raise CommdError(
                f"commd: register_comm_hook's compression ({compression}) cannot run on top of "
                f"compression={self.compression!r}: pass one of them"
            )
        self.compression = compression

    def _check_unregistered(self) -> None:
        """A comm hook changes what the gradient jobs register: CommdError once they have."""
        if self.registered and self.endpoint.fault_tolerance == "continue":
            raise CommdError(
                'commd: register_comm_hook is not available with fault_tolerance="continue": '
                "its gradient jobs register at construction (a replacement rank must find "
                "the running job's layout), before a hook could change their dtype"
            )
        if self.registered:
            raise CommdError(
                "commd: register_comm_hook must be called before the first backward, as in "
                "torch DDP"
            )

    def set_wire_dtype(self, dtype: torch.dtype | None) -> None:
        """Reduce in ``dtype`` on the wire (a comm hook); only before the first reduction."""
        self._check_unregistered()
        self.wire_dtype = dtype
        self._slots = Slots(self.params, staged=dtype is not None,
                            divide_by=self.endpoint.world_size)
        if dtype is not None and self.correction is not None:  # the buffers hold the wire's
            self.correction.close()
            self._step_hook = None

    def form_order_job(self) -> None:
        """Form ``<job>.order`` now, with every rank present (see ``order_job``)."""
        if self.endpoint.world_size > 1 and self._order is None and not self.registered:
            self._order = order_job(self.endpoint, len(self.params))

    # --- forward --------------------------------------------------------------------------------

    def prepare_forward(self) -> None:
        """Fix this iteration's sync decision."""
        self._check()
        self._queued = False  # a backward that raised midway never ran its callback
        self._sync_backward = self.require_sync

    # --- backward -------------------------------------------------------------------------------

    def _hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def on_grad(param: torch.Tensor) -> None:
            self._on_grad(index)

        return on_grad

    def _on_grad(self, index: int) -> None:
        self._check()
        if not self._queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._queued = True
        self._used[index] = True
        if not self.registered:
            self._observed.setdefault(index)
            return
        if self._sync_backward:
            self._load(index)
            bucket, layer = self._slots.layer(index)
            self._guard(bucket.client.ready, layer)
            self._marked[index] = True
        elif not self._slots.staged:
            self._slots.load(index)  # .grad is the view: later backwards accumulate there

    def _end_of_backward(self) -> None:
        self._queued = False
        if not self._sync_backward:
            return
        try:
            if not self.registered:
                self._register()
            self._mark_rest()
            self._wait_all()
            self._slots.store()
            self._finish()
            if self.after_reduce is not None:
                self.after_reduce()
            if self.correction is not None:
                self.correction.received(all(b.client.ran_dense for b in self._slots.buckets))
        except BaseException as exc:
            self._failure = exc
            raise

    def _mark_rest(self) -> None:
        """Report every parameter not yet ready (unused ones: zeros) and the used flags."""
        for bucket in self._slots.buckets:
            layers = [0]
            for layer, index in enumerate(bucket.params, start=1):
                if not self._marked[index]:
                    self._load(index)
                    layers.append(layer)
            bucket.flags.copy_(torch.from_numpy(self._used[bucket.params]))
            bucket.client.ready(layers)

    def _load(self, index: int) -> None:
        """The gradient into the buffer, about to be handed over: copied in, or under the
        rank's momentum correction its velocity written from it in the same pass."""
        correction = self.correction
        if correction is None:
            self._slots.load(index)
            return
        correction.send(index, self._slots.view(index), self._slots.claim(index))

    def _wait_all(self) -> None:
        for bucket in self._slots.buckets:
            bucket.client.wait()

    def _finish(self) -> None:
        """Parameters no rank used keep a None .grad if theirs was None; reset the window."""
        self._warn_unused()
        # Top-k would thin the used flags out with the gradients: with compression every
        # parameter counts as used (its .grad holds zeros or what top-k delivered).
        buckets = [] if self.compression not in (None, "none") else self._slots.buckets
        for bucket in buckets:
            unused = (bucket.flags == 0).numpy()
            for position in np.flatnonzero(unused):
                index = bucket.params[position]
                if self._slots.was_none[index]:
                    self.params[index].grad = None
        self._reset_window()

    def _reset_window(self) -> None:
        self._used[:] = False
        self._marked[:] = False
        self._slots.was_none[:] = False

    def _warn_unused(self) -> None:
        """torch DDP raises at the next iteration when find_unused_parameters=False and a
        parameter got no gradient; commd copes, and says it once."""
        if not self.warn_unused or self._warned or self._used.all():
            return
        self._warned = True
        names = [self.names[i] for i in np.flatnonzero(~self._used)]
        shown = ", ".join(repr(n) for n in names[:_UNUSED_SHOWN])
        more = f" and {len(names) - _UNUSED_SHOWN} more" if len(names) > _UNUSED_SHOWN else ""
        logger.warning(
            "commd: %d parameter(s) got no gradient in this backward on rank %d: %s%s. torch's "
            "DistributedDataParallel would raise at the next iteration (it needs "
            "find_unused_parameters=True here); commd reduces them as zeros. Said once.",
            len(names), self.endpoint.rank, shown, more,
        )

    # --- a joined rank (torch's Join) ------------------------------------------------------------

    def shadow(self) -> None:
        """A rank out of data takes part in the others' reduction with zeros, so nobody
        hangs (torch DDP's join hook); its own ``.grad`` is overwritten, not read."""
        self._check()
        try:
            if not self.registered:
                self._register()
            self._slots.zero_all()
            for bucket in self._slots.buckets:
                bucket.client.ready(range(len(bucket.params) + 1))
            self._wait_all()
        except BaseException as exc:
            self._failure = exc
            raise
        self._reset_window()

    # --- registration ----------------------------------------------------------------------------

    def register_now(self) -> None:
        """Register before any backward, in reverse definition order (the usual backward
        order) without asking rank 0: ``fault_tolerance="continue"``, whose joiners must
        register the running job's layout without a first backward of their own."""
        self._register(agree=False)

    def _register(self, agree: bool = True) -> None:
        """First synchronising backward: agree on the order and register (``_mark_rest`` then
        copies this iteration's gradients in and makes ``.grad`` the views)."""
        seen = list(self._observed)
        unseen = [i for i in reversed(range(len(self.params))) if i not in self._observed]
        order = seen + unseen  # ready order, first ready first
        if agree and self.endpoint.world_size > 1:
            try:
                order = broadcast_order(self.endpoint, order, self._order)
            finally:
                self._close_order()
        by_dtype: dict[str, list[int]] = {}
        for index in order:
            dtype = grad_dtype("", self.wire_dtype) if self.wire_dtype else self.dtypes[index]
            by_dtype.setdefault(dtype, []).append(index)
        try:
            for position, (dtype, ready_order) in enumerate(by_dtype.items()):
                suffix = "" if position == 0 else f".grads-{dtype}"
                self._open_bucket(suffix, dtype, ready_order)
        except BaseException:
            self.close()
            raise

    def _open_bucket(self, suffix: str, dtype: str, ready_order: list[int]) -> None:
        # Layers go to commd in forward order: the last one registered is laid out first.
        params = list(reversed(ready_order))
        torch_dtype = self.wire_dtype or self.params[params[0]].dtype
        client = self.endpoint.open(suffix)
        try:
            arrays = client.register(
                [(USED_LAYER, len(params))]
                + [(self.names[i], tuple(self.params[i].shape) or 1) for i in params],
                dtype=dtype, op="avg" if self.wire_dtype is None else "sum",
                planner=self.planner, compression=self.compression,
            )
        except BaseException:
            client.close()
            raise
        bucket = Bucket(client, params, as_tensor(arrays[0], torch_dtype))
        self._slots.add(bucket, [as_tensor(array, torch_dtype) for array in arrays[1:]])

    # --- errors and closing ----------------------------------------------------------------------

    def _check(self) -> None:
        if self._failure is not None:
            raise CommdError(
                f"commd: an earlier gradient reduction failed ({self._failure}); the ranks are "
                "out of step: restart the job"
            ) from self._failure

    def _guard(self, call: Callable[..., object], *args: object) -> None:
        try:
            call(*args)
        except BaseException as exc:
            self._failure = exc
            raise

    def close(self) -> None:
        """Remove the hooks and close the jobs; .grad views stay readable."""
        if self._step_hook is not None:
            self._step_hook.close()
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._close_order()
        for bucket in self._slots.buckets:
            with contextlib.suppress(Exception):
                bucket.client.close()

    def _close_order(self) -> None:
        if self._order is not None:
            with contextlib.suppress(Exception):
                self._order.close()
            self._order = None
