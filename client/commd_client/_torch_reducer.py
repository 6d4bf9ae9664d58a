"""Gradient reduction for the PyTorch wrapper: autograd hooks that hand gradients to commd.

Lifecycle of the gradient buffers:

- Before the first synchronising backward nothing is registered: gradients live in ordinary
  tensors and a post-accumulate-grad hook records the order in which they become ready.
- At the end of that backward rank 0's observed order is broadcast (so every rank registers
  the same layer list), one commd job per gradient dtype is registered with the layers in
  that order (the flat buffer is laid out in backward order, so the planner's groups are
  contiguous), the gradients are copied in once, reduced, and every ``.grad`` becomes a view
  of the shared buffer: from then on nothing is copied in or out.
- Later backwards report each parameter ready from its hook (``client.ready``); a callback
  queued on the autograd engine marks the rest (unused parameters: zeros, or what their
  ``.grad`` holds) and waits, so ``backward()`` returns with averaged gradients.
- The layout stays as observed in the first iteration. If the order changes later it still
  works — readiness is per layer and a group starts when all its layers are ready — only
  with less overlap of communication and backward.

Each job has one extra layer in front, ``commd:used``: 1 for every parameter that got a
gradient on this rank since the last reduction. After averaging it tells which parameters no
rank used; those whose ``.grad`` was None before keep None, as in torch DDP.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.utils.hooks import RemovableHandle

from commd_protocol import CommdError

from ._torch_common import Endpoint, as_tensor, broadcast_order, grad_dtype
from .client import Client

USED_LAYER = "commd:used"


@dataclass
class _Bucket:
    """One registered commd job: the parameters of one gradient dtype."""

    client: Client
    params: list[int]  # reducer indices; params[k] is layer k + 1 (layer 0: USED_LAYER)
    flags: torch.Tensor  # view of layer 0
    grads: list[torch.Tensor] = field(default_factory=list)  # views, aligned with params


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
        self._sync_backward = True  # decided at forward, as torch DDP does
        self._observed: dict[int, None] = {}  # first-seen order before registration
        self._buckets: list[_Bucket] = []
        self._slots: list[tuple[_Bucket, int]] = []  # per parameter: its bucket and layer
        count = len(self.params)
        self._used = np.zeros(count, dtype=bool)  # got a gradient since the last reduction
        self._marked = np.zeros(count, dtype=bool)  # reported ready in this backward
        self._was_none = np.zeros(count, dtype=bool)  # .grad was None when the window began
        self._queued = False
        self._failure: BaseException | None = None
        self._handles: list[RemovableHandle] = [
            param.register_post_accumulate_grad_hook(self._hook(index))
            for index, param in enumerate(self.params)
        ]

    # --- forward --------------------------------------------------------------------------------

    def prepare_forward(self) -> None:
        """Fix this iteration's sync decision; re-attach views that zero_grad set to None."""
        self._check()
        self._queued = False  # a backward that raised midway never ran its callback
        self._sync_backward = self.require_sync
        if not self._buckets:
            return
        for index, param in enumerate(self.params):
            if param.grad is None:
                self._attach_zeros(index)

    # --- backward -------------------------------------------------------------------------------

    def _hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def on_grad(param: torch.Tensor) -> None:
            self._on_grad(index, param)

        return on_grad

    def _on_grad(self, index: int, param: torch.Tensor) -> None:
        self._check()
        if not self._queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._queued = True
        self._used[index] = True
        if not self._buckets:
            self._observed.setdefault(index)
            return
        self._adopt(index, param)
        if self._sync_backward:
            bucket, layer = self._slots[index]
            self._guard(bucket.client.ready, layer)
            self._marked[index] = True

    def _end_of_backward(self) -> None:
        self._queued = False
        if not self._sync_backward:
            return
        try:
            if not self._buckets:
                self._register()
            self._mark_rest()
            for bucket in self._buckets:
                bucket.client.wait()
            self._finish()
        except BaseException as exc:
            self._failure = exc
            raise

    def _mark_rest(self) -> None:
        """Report every parameter not yet ready (unused ones: zeros) and the used flags."""
        for bucket in self._buckets:
            layers = [0]
            for layer, index in enumerate(bucket.params, start=1):
                if self._marked[index]:
                    continue
                if self.params[index].grad is None:
                    self._attach_zeros(index)
                else:
                    self._adopt(index, self.params[index])
                layers.append(layer)
            bucket.flags.copy_(torch.from_numpy(self._used[bucket.params]))
            bucket.client.ready(layers)

    def _finish(self) -> None:
        """Parameters no rank used keep a None .grad if theirs was None; reset the window."""
        # Top-k would thin the used flags out with the gradients: with compression every
        # parameter counts as used (its .grad holds zeros or what top-k delivered).
        buckets = [] if self.compression not in (None, "none") else self._buckets
        for bucket in buckets:
            unused = (bucket.flags == 0).numpy()
            for position in np.flatnonzero(unused):
                index = bucket.params[position]
                if self._was_none[index]:
                    self.params[index].grad = None
        self._used[:] = False
        self._marked[:] = False
        self._was_none[:] = False

    # --- registration ----------------------------------------------------------------------------

    def _register(self) -> None:
        """First synchronising backward: agree on the order and register (``_mark_rest`` then
        copies this iteration's gradients in and makes ``.grad`` the views)."""
        seen = list(self._observed)
        unseen = [i for i in reversed(range(len(self.params))) if i not in self._observed]
        order = seen + unseen  # ready order, first ready first
        if self.endpoint.world_size > 1:
            order = broadcast_order(self.endpoint, order)
        by_dtype: dict[str, list[int]] = {}
        for index in order:
            by_dtype.setdefault(self.dtypes[index], []).append(index)
        self._slots = [None] * len(self.params)  # type: ignore[list-item]
        try:
            for position, (dtype, ready_order) in enumerate(by_dtype.items()):
                suffix = "" if position == 0 else f".grads-{dtype}"
                self._buckets.append(self._open_bucket(suffix, dtype, ready_order))
        except BaseException:
            self.close()
            raise

    def _open_bucket(self, suffix: str, dtype: str, ready_order: list[int]) -> _Bucket:
        # Layers go to commd in forward order: the last one registered is laid out first.
        params = list(reversed(ready_order))
        torch_dtype = self.params[params[0]].dtype
        client = self.endpoint.open(suffix)
        try:
            arrays = client.register(
                [(USED_LAYER, len(params))]
                + [(self.names[i], self.params[i].numel()) for i in params],
                dtype=dtype, op="avg", planner=self.planner, compression=self.compression,
            )
        except BaseException:
            client.close()
            raise
        bucket = _Bucket(client, params, as_tensor(arrays[0], torch_dtype))
        for layer, (index, array) in enumerate(zip(params, arrays[1:], strict=True), start=1):
            bucket.grads.append(as_tensor(array, torch_dtype).view(self.params[index].shape))
            self._slots[index] = (bucket, layer)
        return bucket

    # --- gradient views ---------------------------------------------------------------------------

    def _view(self, index: int) -> torch.Tensor:
        bucket, layer = self._slots[index]
        return bucket.grads[layer - 1]

    def _attach_zeros(self, index: int) -> None:
        view = self._view(index)
        view.zero_()
        self.params[index].grad = view
        self._was_none[index] = True

    def _adopt(self, index: int, param: torch.Tensor) -> None:
        """Make .grad the shared view again (copying once) if something replaced it."""
        view = self._view(index)
        grad = param.grad
        if grad is not None and grad.data_ptr() != view.data_ptr():
            with torch.no_grad():
                view.copy_(grad)
            param.grad = view

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
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for bucket in self._buckets:
            with contextlib.suppress(Exception):
                bucket.client.close()
