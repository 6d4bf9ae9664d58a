"""An encoder called twice per step, one backward: SimCLR-style contrastive training with
BatchNorm, written the way such scripts are (``z1, z2 = model(x1), model(x2)``).

The DDP class comes from one line (DDP_IMPL=commd: commd's, else torch's). Launch styles, as
in ddp_scripts/run_scenarios.py: ``--launch spawn`` (``torch.multiprocessing.spawn`` and
``init_process_group("gloo", rank=..., world_size=...)``) or ``--launch env`` (torchrun's
environment, one process per rank started by the caller).

Each rank writes ``OUT/rank<N>.pt``: ``{"params": state_dict, "ddp_class": ...}``, or
``{"error", "commd_error", "elapsed_s"}`` when training raised (then the script exits 1,
as an uncaught exception would).

``--fail-rank R --fail-at before|after``: rank R raises in its own code before or after its
first backward (a bug in one rank's script); the other ranks must hear of it fast.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

if os.environ.get("DDP_IMPL") == "commd":
    from commd_client.torch import DistributedDataParallel as DDP
else:
    from torch.nn.parallel import DistributedDataParallel as DDP

STEPS = 4


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(12, 16)
        self.norm = nn.BatchNorm1d(16)
        self.head = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.norm(self.body(x))))


def contrastive_loss(z1: torch.Tensor, z2: torch.Tensor) -> torch.Tensor:
    """NT-Xent-like: each view's match is the same row of the other view."""
    z1, z2 = F.normalize(z1, dim=1), F.normalize(z2, dim=1)
    logits = z1 @ z2.T / 0.5
    return F.cross_entropy(logits, torch.arange(len(z1)))


class InjectedFailure(RuntimeError):
    """The bug in one rank's own code (``--fail-rank``)."""


def train(rank: int, out: str, fail_rank: int, fail_at: str) -> None:
    torch.manual_seed(7 + rank)  # different weights per rank: DDP broadcasts rank 0's
    model = DDP(Encoder(), broadcast_buffers=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = torch.Generator().manual_seed(100 + rank)
    started = time.monotonic()
    try:
        for step in range(STEPS):
            x = torch.randn(16, 12, generator=data)
            noise1, noise2 = (torch.randn(16, 12, generator=data) * 0.1 for _ in range(2))
            optimizer.zero_grad()
            z1, z2 = model(x + noise1), model(x + noise2)  # the encoder twice, one backward
            loss = contrastive_loss(z1, z2)
            if rank == fail_rank and fail_at == "before":
                raise InjectedFailure(f"rank {rank} failed before backward {step}")
            loss.backward()
            if rank == fail_rank and fail_at == "after":
                raise InjectedFailure(f"rank {rank} failed after backward {step}")
            optimizer.step()
    except Exception as exc:
        save(out, rank, {"error": f"{type(exc).__name__}: {exc}",
                         "commd_error": any(c.__name__ == "CommdError"
                                            for c in type(exc).__mro__),
                         "elapsed_s": time.monotonic() - started})
        raise  # the script dies of it, as a real one would
    save(out, rank, {"params": {k: v.detach().clone()
                                for k, v in model.module.state_dict().items()},
                     "ddp_class": f"{type(model).__module__}.{type(model).__qualname__}"})


def save(out: str, rank: int, record: dict[str, Any]) -> None:
    path = os.path.join(out, f"rank{rank}.pt")
    torch.save(record, path + ".tmp")
    os.replace(path + ".tmp", path)


def spawned(rank: int, world_size: int, port: int, out: str, fail_rank: int,
            fail_at: str) -> None:
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        train(rank, out, fail_rank, fail_at)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--launch", choices=("spawn", "env"), required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--world-size", type=int, default=2, help="spawn only")
    parser.add_argument("--master-port", type=int, default=29500, help="spawn only")
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument("--fail-at", choices=("before", "after"), default="before")
    args = parser.parse_args()
    if args.launch == "spawn":
        mp.spawn(spawned, args=(args.world_size, args.master_port, args.out, args.fail_rank,
                                args.fail_at), nprocs=args.world_size, join=True)
        return
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        train(dist.get_rank(), args.out, args.fail_rank, args.fail_at)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
