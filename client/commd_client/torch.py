"""``DistributedDataParallel`` for PyTorch models, through the node's commd daemon.

A one-line change for torch users::

    from commd_client.torch import DistributedDataParallel
    model = DistributedDataParallel(model)  # same keywords as Client, defaults from torchrun
    loss.backward()  # returns with every parameter's .grad averaged over all ranks

What it does, as torch's DDP does:

- Construction broadcasts rank 0's parameters and buffers to every rank (job ``<job>.init``).
- Every parameter that requires a gradient is one commd layer; ``.grad`` tensors are views of
  commd's shared buffer (like ``gradient_as_bucket_view=True``), so nothing is copied.
- ``no_sync()`` accumulates gradients locally; the next synchronising backward reduces them.
- Parameters that get no gradient are reported with zeros (``find_unused_parameters`` is
  always on); a parameter no rank used keeps ``.grad`` None if it was None.
- Buffers are broadcast from rank 0 before each training forward (``broadcast_buffers``).
- ``state_dict()`` keys carry the ``module.`` prefix exactly like torch DDP; use
  ``model.module.state_dict()`` for the plain module's keys.

CUDA models are refused with a CommdError: the GPU path is not available yet. See docs/ddp.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Iterator, Sequence
from types import TracebackType
from typing import Any

import torch
from torch import nn

from commd_protocol import CommdError

from . import env
from ._torch_common import GPU_MESSAGE, Broadcaster, Endpoint, broadcast_once, check_cpu
from ._torch_reducer import Reducer

__all__ = ["CommdError", "DistributedDataParallel"]


class DistributedDataParallel(nn.Module):
    """Data parallelism for a CPU ``nn.Module`` with commd averaging the gradients.

    Keywords are the Client's (each defaults from RANK, WORLD_SIZE, LOCAL_RANK,
    LOCAL_WORLD_SIZE, MASTER_ADDR; COMMD_JOB, COMMD_COORDINATOR, COMMD_SOCKET override), plus
    ``planner`` (commd's merge planner), ``compression`` (``topk:RATIO[:EXCHANGE]`` or
    ``topk:auto``; default $COMMD_COMPRESSION, else none; with compression every parameter
    counts as used), ``broadcast_buffers`` (as in torch DDP) and, accepted for compatibility,
    ``find_unused_parameters`` (always on here) and ``device_ids`` (must be None: CPU only).
    """

    def __init__(
        self,
        module: nn.Module,
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
        broadcast_buffers: bool = True,
        find_unused_parameters: bool = True,
        device_ids: Sequence[Any] | None = None,
    ) -> None:
        super().__init__()
        if device_ids:
            raise CommdError(f"commd: device_ids={list(device_ids)!r} was given; {GPU_MESSAGE}")
        check_cpu(module.named_parameters())
        check_cpu(module.named_buffers())
        self.module = module
        who = env.resolve(job, rank, world_size, local_rank, local_world_size, coordinator, socket)
        self.endpoint = Endpoint(**dataclasses.asdict(who), timeout=env.timeout(timeout))
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        self.require_forward_param_sync = True
        trained = [
            (name, p) for name, p in module.named_parameters() if p.requires_grad and p.numel()
        ]
        if not trained:
            raise CommdError(
                "commd: the module has no parameter that requires a gradient; "
                "DistributedDataParallel has nothing to reduce"
            )
        # Checks every dtype and installs the hooks; no communication yet.
        self._reducer = Reducer(trained, self.endpoint, planner, compression)
        self._buffers_sync: Broadcaster | None = None
        self._broadcasters: list[Broadcaster] = []
        self._closed = False
        # Unlinks the shared memory at interpreter exit (or when the wrapper is collected).
        self._finalizer = weakref.finalize(self, _close, self._reducer, self._broadcasters)
        try:
            if self.endpoint.world_size > 1:
                broadcast_once(self.endpoint, ".init", self._state())
            has_buffers = any(buffer.numel() for _, buffer in module.named_buffers())
            if broadcast_buffers and has_buffers and self.endpoint.world_size > 1:
                self._buffers_sync = Broadcaster(
                    self.endpoint, ".buffers", list(module.named_buffers())
                )
                self._broadcasters.append(self._buffers_sync)
        except BaseException:
            self.close()
            raise

    def _state(self) -> list[tuple[str, torch.Tensor]]:
        return [*self.module.named_parameters(), *self.module.named_buffers()]

    # --- training -------------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not self._closed:
            grad_enabled = torch.is_grad_enabled()
            if grad_enabled:
                self._reducer.prepare_forward()
            if self._buffers_sync is not None and self.require_forward_param_sync:
                self._buffers_sync.run(list(self.module.named_buffers()))
            self.require_forward_param_sync = grad_enabled and self._reducer.require_sync
        return self.module(*args, **kwargs)

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

    # --- lifecycle ------------------------------------------------------------------------------

    def close(self) -> None:
        """Leave the jobs and unlink the shared memory; ``.grad`` tensors stay readable.

        Afterwards the wrapper is a plain pass-through to the module (no communication).
        """
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
