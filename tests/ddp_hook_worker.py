"""Small MLPs trained under the half-precision comm hooks: torch DDP's or commd's, one rank.

Started once per rank with torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR/MASTER_PORT; COMMD_SOCKET and COMMD_COORDINATOR for commd), CPU
and Gloo. The DDP class comes from one line (DDP_IMPL=commd: commd's, else torch's). One model
per hook named in ``--hooks``, trained one after the other, each in its own DDP:

- ``fp16``: ``default_hooks.fp16_compress_hook`` for both.
- ``bf16``: commd gets ``default_hooks.bf16_compress_hook``. torch's DDP refuses that hook
  unless CUDA and NCCL >= 2.10 are there (it checks the hook's ``__name__``), so torch gets
  ``bf16_hook_body``: the hook's own body, ``default_hooks._compress_hook(torch.bfloat16, …)``
  (cast to bfloat16, divide by the world size in bfloat16, Gloo's bfloat16 all-reduce, copy
  back), under another name. The arithmetic is torch's code and Gloo's, unchanged.

The model has a layer no rank uses (``spare``) and one only rank 0 uses (``rank0_only``), with
``find_unused_parameters=True``: under a hook commd's used flags are summed, not averaged.

Each rank writes ``OUT/rank<N>.pt``: per hook, ``{"params": state_dict, "local": …,
"reduced": …, "grad_none": …}`` (``local``: this rank's own gradients of the first step, from
a plain copy of the model; ``reduced``: the first step's ``.grad`` after the DDP backward;
``grad_none``: the names whose ``.grad`` was None after it), and ``ddp_class``; or
``{"error"}``.
"""

import argparse
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

if os.environ.get("DDP_IMPL") == "commd":
    from commd_client.torch import DistributedDataParallel as DDP
else:
    from torch.nn.parallel import DistributedDataParallel as DDP


def bf16_hook_body(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """``bf16_compress_hook``'s body under another name (torch checks the name for NCCL)."""
    return default_hooks._compress_hook(torch.bfloat16, state, bucket)


def hook_for(name: str, impl: str) -> Any:
    if name == "fp16":
        return default_hooks.fp16_compress_hook
    return default_hooks.bf16_compress_hook if impl == "commd" else bf16_hook_body


class Net(nn.Module):
    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank
        self.body = nn.Sequential(nn.Linear(24, 64), nn.Tanh(), nn.Linear(64, 48), nn.Tanh())
        self.head = nn.Linear(48, 6)
        self.rank0_only = nn.Linear(6, 6)
        self.spare = nn.Linear(6, 6)  # never used

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.head(self.body(x))
        return out + self.rank0_only(out) if self.rank == 0 else out


def train(rank: int, hook: str, steps: int, lr: float) -> dict[str, Any]:
    torch.manual_seed(7 + rank)  # different weights per rank: DDP broadcasts rank 0's
    module = Net(rank)
    model = DDP(module, find_unused_parameters=True)
    model.register_comm_hook(None, hook_for(hook, os.environ.get("DDP_IMPL", "torch")))
    plain = Net(rank)
    plain.load_state_dict(module.state_dict())  # rank 0's weights, as broadcast
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    data = torch.Generator().manual_seed(100 + rank)
    record: dict[str, Any] = {}
    for step in range(steps):
        x = torch.randn(32, 24, generator=data)
        y = torch.randn(32, 6, generator=data)
        if step == 0:
            F.mse_loss(plain(x), y).backward()
            record["local"] = grads(plain)
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        if step == 0:
            record["reduced"] = grads(module)
            record["grad_none"] = sorted(name for name, param in module.named_parameters()
                                         if param.grad is None)
        optimizer.step()
    record["params"] = {k: v.detach().clone() for k, v in module.state_dict().items()}
    record["ddp_class"] = f"{type(model).__module__}.{type(model).__qualname__}"
    return record


def grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: param.grad.detach().clone() for name, param in module.named_parameters()
            if param.grad is not None}


def save(out: str, rank: int, record: dict[str, Any]) -> None:
    path = os.path.join(out, f"rank{rank}.pt")
    torch.save(record, path + ".tmp")
    os.replace(path + ".tmp", path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--hooks", default="fp16,bf16")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        save(args.out, rank, {hook: train(rank, hook, args.steps, args.lr)
                              for hook in args.hooks.split(",")})
    except Exception as exc:
        save(args.out, rank, {"error": f"{type(exc).__name__}: {exc}"})
        raise
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
