"""Where each parameter's gradient lives in commd's shared buffers.

Two ways, chosen once per wrapper:

- in place (the default): ``.grad`` *is* a view of the shared buffer once the parameter's
  gradient is final, and the daemon reduces it there; nothing is copied out. Autograd hands
  over a fresh tensor after ``zero_grad()`` (``.grad`` None), copied into the view once
  (or, under the rank's momentum correction, its velocity written from it in the same
  pass); later backwards of a ``no_sync`` window accumulate into the view. One pass over the
  gradients: keeping the view attached through ``zero_grad`` would make it two, a zeroing
  at the forward and autograd's accumulation into it.
- staged (a half-precision comm hook): the shared buffer holds the gradients in the wire dtype;
  each gradient is cast into it and divided there by the world size before it is marked
  ready, the daemon sums, and the sum is cast back after the reduction: torch's
  ``fp16_compress_hook`` (``buffer.to(float16).div_(world_size)``, all-reduce, copy back)
  with the same roundings.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from .client import Client


@dataclass
class Bucket:
    """One registered commd job: the parameters whose gradients share one dtype."""

    client: Client
    params: list[int]  # reducer indices; params[k] is layer k + 1 (layer 0: the used flags)
    flags: torch.Tensor  # view of layer 0
    grads: list[torch.Tensor] = field(default_factory=list)  # views, aligned with params


class Slots:
    """Per parameter: its bucket, its layer and its view; moves gradients in and out."""

    def __init__(self, params: Sequence[torch.nn.Parameter], staged: bool,
                 divide_by: int = 1) -> None:
        """``divide_by`` (staged only): what each gradient is divided by in the wire dtype
        once cast into it (the world size: the daemon sums, as torch's hooks' all-reduce)."""
        self.params = params
        self.staged = staged
        self.divide_by = divide_by if staged else 1
        self.buckets: list[Bucket] = []
        self._where: list[tuple[Bucket, int] | None] = [None] * len(params)
        self.was_none = np.zeros(len(params), dtype=bool)  # .grad None when the window began

    def add(self, bucket: Bucket, views: Sequence[torch.Tensor]) -> None:
        for layer, (index, view) in enumerate(zip(bucket.params, views, strict=True), start=1):
            bucket.grads.append(view.view(self.params[index].shape))
            self._where[index] = (bucket, layer)
        self.buckets.append(bucket)

    def layer(self, index: int) -> tuple[Bucket, int]:
        where = self._where[index]
        assert where is not None, "a parameter without a bucket"
        return where

    def view(self, index: int) -> torch.Tensor:
        bucket, layer = self.layer(index)
        return bucket.grads[layer - 1]

    def load(self, index: int) -> None:
        """The parameter's gradient is final: put it into the buffer."""
        grad = self.claim(index)
        if grad is not None:
            with torch.no_grad():
                view = self.view(index)
                view.copy_(grad)  # staged: rounded to the wire dtype, as grad.to(dtype)
                if self.divide_by != 1:
                    view.div_(self.divide_by)  # in the wire dtype, as torch's hook divides

    def claim(self, index: int) -> torch.Tensor | None:
        """In place: make ``.grad`` the view. Returns the gradient still to be written into
        the view: autograd's fresh tensor (the first gradient since ``zero_grad``), or,
        staged, ``.grad``; None where the view holds it already (accumulated there) or there
        was none (zeros are loaded)."""
        param, view = self.params[index], self.view(index)
        grad = param.grad
        if grad is None:
            self.load_zeros(index)
            return None
        if self.staged:
            return grad
        if grad.data_ptr() == view.data_ptr():
            return None
        param.grad = view
        return grad

    def load_zeros(self, index: int) -> None:
        """No gradient on this rank: contribute zeros (in place: ``.grad`` is the view)."""
        view = self.view(index)
        view.zero_()
        if not self.staged:
            self.params[index].grad = view
        self.was_none[index] = True

    def store(self) -> None:
        """After the reduction: staged gradients go back into ``.grad`` in their dtype."""
        if not self.staged:
            return
        with torch.no_grad():
            for index, param in enumerate(self.params):
                if self._where[index] is None:
                    continue
                reduced = self.view(index)
                if param.grad is None:
                    param.grad = reduced.to(param.dtype)
                else:
                    param.grad.copy_(reduced)

    def zero_all(self) -> None:
        """A joined rank's contribution: zeros everywhere (its own ``.grad`` is not read)."""
        for bucket in self.buckets:
            bucket.flags.zero_()
            for view in bucket.grads:
                view.zero_()
