"""Helpers of the PyTorch wrapper: where a rank's clients connect, dtypes, device checks, and
rank 0's values broadcast through a small commd job.

The Client has no broadcast; a job with op="sum" where rank 0 writes its values and every
other rank zeros is one (x + 0 + … + 0 == x exactly). float64 carries every value exactly:
all floating dtypes up to 64 bits, bool, and integers up to 2**53.

Under ``fault_tolerance="continue"`` only the jobs that live as long as training (the
gradients and the per-forward buffer broadcast) take it; the jobs of the constructor
(``.init``, ``.order``) and of the end of a join (``.final*``) form while every rank is there
and keep failing as torch does.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from commd_protocol import CommdError

from . import env
from .client import Client

# torch dtype -> commd's gradient dtype name.
GRAD_DTYPES: dict[torch.dtype, str] = {
    torch.float32: "float32",
    torch.float64: "float64",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
}

_EXACT_INT_LIMIT = 2**53  # integers beyond this lose precision in float64

GPU_MESSAGE = (
    "the GPU path is not available yet: commd's DistributedDataParallel supports CPU models "
    "only for now; keep the model on the CPU or use torch.nn.parallel.DistributedDataParallel"
)


@dataclass(frozen=True)
class Endpoint(env.Identity):
    """Where this rank's clients connect (``env.resolve`` fills it from torchrun's
    environment), and their timeout."""

    timeout: float = 300.0
    fault_tolerance: str = "fail"
    min_world_size: int = 1
    helper_of: tuple[str, int] | None = None  # the state transfer's: (job, epoch) it serves

    def open(self, suffix: str = "", tolerant: bool = True) -> Client:
        """A connected Client for job ``<job><suffix>`` (suffix "" is the gradient job);
        ``tolerant=False`` for a job that fails on a lost rank whatever the wrapper's
        ``fault_tolerance``."""
        client = Client(
            job=self.job + suffix,
            rank=self.rank,
            world_size=self.world_size,
            local_rank=self.local_rank,
            local_world_size=self.local_world_size,
            coordinator=self.coordinator,
            socket=self.socket,
            timeout=self.timeout,
            fault_tolerance=self.fault_tolerance if tolerant else "fail",
            min_world_size=self.min_world_size if tolerant else 1,
            helper_of=self.helper_of,
        )
        # One warning per membership change per rank: the gradient job's client says it; the
        # helper jobs beside it (other dtypes' gradients, the buffer broadcast) learn the same
        # change and stay quiet.
        client.membership.log = suffix == ""
        return client


def check_cpu(named: Iterable[tuple[str, Any]]) -> None:
    """CommdError naming the first tensor (anything with ``.device``) not on the CPU."""
    for name, tensor in named:
        device = torch.device(tensor.device)
        if device.type != "cpu":
            raise CommdError(f"commd: {name!r} is on {device}; {GPU_MESSAGE}")


def grad_dtype(name: str, dtype: torch.dtype) -> str:
    try:
        return GRAD_DTYPES[dtype]
    except KeyError:
        raise CommdError(
            f"commd: parameter {name!r} has dtype {dtype}; gradients must be one of "
            f"{', '.join(str(d) for d in GRAD_DTYPES)}"
        ) from None


def as_tensor(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A torch view of a commd buffer slice (bfloat16 buffers hold raw uint16 words)."""
    tensor = torch.from_numpy(array)
    return tensor.view(torch.bfloat16) if dtype == torch.bfloat16 else tensor


def _check_exact(name: str, tensor: torch.Tensor) -> None:
    if tensor.is_complex():
        raise CommdError(f"commd: cannot broadcast complex tensor {name!r} yet")
    if tensor.dtype.is_floating_point or tensor.dtype == torch.bool or tensor.numel() == 0:
        return
    if int(tensor.detach().abs().max()) > _EXACT_INT_LIMIT:
        raise CommdError(
            f"commd: integer tensor {name!r} holds values beyond 2**53, which the broadcast "
            "(float64) cannot carry exactly"
        )


class Broadcaster:
    """One rank's tensors to every rank, through job ``<job><suffix>`` (float64, op sum).

    One layer per tensor, named as in the module: ranks whose modules differ get the
    coordinator's CommdError naming the first differing tensor. ``tolerant``: the job takes
    the endpoint's ``fault_tolerance`` (the per-forward buffer broadcast); otherwise it fails
    on a lost rank.
    """

    def __init__(
        self, endpoint: Endpoint, suffix: str, named: Sequence[tuple[str, torch.Tensor]],
        tolerant: bool = False,
    ) -> None:
        self.rank = endpoint.rank
        self.names = [name for name, tensor in named if tensor.numel() > 0]
        self.client = endpoint.open(suffix, tolerant)
        try:
            sizes = {name: tensor.numel() for name, tensor in named}
            self.arrays = self.client.register(
                [(name, sizes[name]) for name in self.names], dtype="float64", op="sum",
                # A few exact exchanges: one group, no probe, never compressed.
                planner="syncea", profile=False, compression="none",
            )
        except BaseException:
            self.client.close()
            raise

    def run(self, named: Sequence[tuple[str, torch.Tensor]], source: int = 0) -> None:
        """Overwrite every rank's tensors (same names as at construction) with those of rank
        ``source`` (0, or whom torch's Join agreed on); a source no longer in the job's
        membership (fault_tolerance="continue") gives way to the lowest live rank."""
        tensors = dict(named)
        with torch.no_grad():
            members = self.client.members
            source = source if source in members else min(members)
            epoch = self.client.epoch
            self._exchange(tensors, source)
            # A source lost during the exchange contributed nothing: the survivors summed
            # zeros. Every survivor sees the same new epoch with the same iteration, so all
            # agree on the new source and exchange again; nothing was copied out yet.
            while self.client.epoch != epoch and source not in self.client.members:
                epoch, source = self.client.epoch, min(self.client.members)
                self._exchange(tensors, source)
            if self.rank != source:
                for name, array in zip(self.names, self.arrays, strict=True):
                    target = tensors[name]
                    target.copy_(torch.from_numpy(array).view(target.shape))

    def _exchange(self, tensors: dict[str, torch.Tensor], source: int) -> None:
        """One iteration of the job: ``source`` writes its values, everyone else zeros."""
        for name, array in zip(self.names, self.arrays, strict=True):
            if self.rank == source:
                _check_exact(name, tensors[name])
                torch.from_numpy(array).copy_(tensors[name].detach().reshape(-1))
            else:
                array.fill(0.0)
        self.client.ready(range(len(self.arrays)))
        self.client.wait()

    def close(self) -> None:
        self.client.close()


def broadcast_once(
    endpoint: Endpoint,
    suffix: str,
    named: Sequence[tuple[str, torch.Tensor]],
    source: int = 0,
) -> None:
    """Overwrite ``named`` with rank ``source``'s values through a short-lived job."""
    if not any(tensor.numel() for _, tensor in named):
        return
    broadcaster = Broadcaster(endpoint, suffix, named)
    try:
        broadcaster.run(named, source)
    finally:
        broadcaster.close()


def order_job(endpoint: Endpoint, count: int) -> Broadcaster:
    """Job ``<job>.order``, formed at construction while every rank is there: a rank that
    fails in its own code before its first backward then leaves a job the others know
    (its goodbye or exit fails their ``broadcast_order`` at once), not one they wait to form
    until the timeout."""
    return Broadcaster(endpoint, ".order", [("order", torch.zeros(count, dtype=torch.float64))])


def broadcast_order(endpoint: Endpoint, order: Sequence[int],
                    job: Broadcaster | None = None) -> list[int]:
    """Rank 0's list of parameter indices, to every rank (through ``job`` if formed already)."""
    values = torch.tensor([float(i) for i in order], dtype=torch.float64)
    if job is None:
        broadcast_once(endpoint, ".order", [("order", values)])
    else:
        job.run([("order", values)])
    result = [int(v) for v in values.tolist()]
    if sorted(result) != sorted(order):
        raise CommdError(
            "commd: rank 0's gradient order does not name the same parameters as this rank's; "
            "is every rank running the same model?"
        )
    return result
