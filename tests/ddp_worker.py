"""One training rank for the DDP tests: wraps a model in commd's DistributedDataParallel,
trains a few SGD steps on this rank's own data and saves what it ended with.

Usage: python ddp_worker.py '<json spec>'. The test computes the reference from the same
``build_model`` and ``batch`` functions, so the two cannot drift apart.
"""

from __future__ import annotations

import json
import sys
import traceback
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

MODELS = ("small_cnn", "mlp", "branchy", "bn")


class Branchy(nn.Module):
    """``extra`` is used only when asked (rank 0 here); ``never`` is never used."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 8)
        self.extra = nn.Linear(8, 8)
        self.never = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, use_extra: bool = False) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        if use_extra:
            h = h + torch.tanh(self.extra(h))
        return self.head(h)


class WithBatchNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.norm = nn.BatchNorm2d(4)
        self.head = nn.Linear(4 * 8 * 8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(torch.relu(self.norm(self.conv(x))), 1))


def build_model(kind: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "small_cnn":
        from commd.models import small_cnn

        return small_cnn()
    if kind == "mlp":
        return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    if kind == "branchy":
        return Branchy()
    if kind == "bn":
        return WithBatchNorm()
    raise ValueError(f"unknown model {kind!r}; valid: {', '.join(MODELS)}")


def batch(kind: str, rank: int, step: int, micro: int, size: int) -> tuple[torch.Tensor, ...]:
    """This rank's own data: (input, target), seeded by rank, step and micro-batch."""
    gen = torch.Generator().manual_seed(1000 * rank + 10 * step + micro + 7)
    shape = {"small_cnn": (3, 32, 32), "mlp": (6,), "branchy": (6,), "bn": (3, 8, 8)}[kind]
    classes = 10 if kind == "small_cnn" else 3
    x = torch.randn(size, *shape, generator=gen)
    return x, torch.randint(0, classes, (size,), generator=gen)


def loss_of(model: nn.Module, kind: str, rank: int, x: torch.Tensor, y: torch.Tensor) -> Any:
    kwargs = {"use_extra": rank == 0} if kind == "branchy" else {}
    return F.cross_entropy(model(x, **kwargs), y)


def sgd_step(params: list[torch.Tensor], lr: float) -> None:
    """Plain SGD, as torch.optim.SGD does it, then ``.grad = None`` as zero_grad() does.

    (torch.optim costs ~1.5 s of imports per process, too much for a quick test.)
    """
    with torch.no_grad():
        for param in params:  # torch.optim.SGD skips parameters whose .grad is None
            if param.grad is not None:
                param.add_(param.grad, alpha=-lr)
                param.grad = None


def main() -> None:
    from commd_client.torch import DistributedDataParallel

    torch.set_num_threads(1)  # several ranks share two cores

    spec = json.loads(sys.argv[1])
    rank, kind = spec["rank"], spec["model"]
    out: dict[str, Any] = {"rank": rank}
    try:
        model = build_model(kind, spec["init_seed"])
        with DistributedDataParallel(
            model, job=spec["job"], rank=rank, world_size=spec["world_size"],
            local_rank=spec["local_rank"], local_world_size=spec["local_world_size"],
            coordinator=spec["coordinator"], socket=spec["socket"], timeout=spec["timeout"],
        ) as ddp:
            out["initial"] = {k: v.clone() for k, v in ddp.module.state_dict().items()}
            accumulate = spec.get("accumulate", 1)
            for step in range(spec["steps"]):
                for micro in range(accumulate):
                    x, y = batch(kind, rank, step, micro, spec["batch"])
                    if micro < accumulate - 1:
                        with ddp.no_sync():
                            loss_of(ddp, kind, rank, x, y).backward()
                    else:
                        loss_of(ddp, kind, rank, x, y).backward()
                out["grad_none"] = [
                    n for n, p in ddp.module.named_parameters() if p.grad is None
                ]
                sgd_step(list(ddp.parameters()), spec["lr"])
            # A validation forward: takes rank 0's buffers first, as the training forwards did.
            ddp.eval()
            with torch.no_grad():
                ddp(batch(kind, rank, 0, 0, spec["batch"])[0])
            out["state"] = {k: v.clone() for k, v in ddp.state_dict().items()}
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["traceback"] = traceback.format_exc()
    torch.save(out, spec["out"])


if __name__ == "__main__":
    main()
