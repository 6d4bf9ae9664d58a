"""The PyTorch "Getting Started with Distributed Data Parallel" tutorial's demos, on CPU.

ToyModel, ``demo_basic`` and ``demo_checkpoint`` follow the tutorial (``device_ids`` dropped:
CPU and Gloo); ``demo_keywords``, ``demo_allreduce_beside`` and ``demo_rewrap`` use the same
model the way real scripts also do: every constructor keyword, collectives of their own
beside the wrapper, wrapping one module twice. The only line a port changes is the import.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from porting_kit import result
from torch import nn, optim

if os.environ.get("DDP_IMPL") == "commd":
    from commd_client.torch import DistributedDataParallel as DDP
else:
    from torch.nn.parallel import DistributedDataParallel as DDP


class ToyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))


class ToyModelWithExtras(nn.Module):
    """ToyModel with a BatchNorm buffer and a head that forward never uses."""

    def __init__(self) -> None:
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.norm = nn.BatchNorm1d(10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)
        self.unused_head = nn.Linear(10, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.norm(self.net1(x))))


def train_steps(ddp_model: nn.Module, optimizer: optim.Optimizer, data: torch.Generator,
                steps: int) -> list[float]:
    loss_fn = nn.MSELoss()
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        outputs = ddp_model(torch.randn(20, 10, generator=data))
        labels = torch.randn(20, 5, generator=data)
        loss = loss_fn(outputs, labels)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def demo_basic(rank: int, world_size: int, workdir: str, seed: int) -> dict[str, Any]:
    print(f"Running basic DDP example on rank {rank}.")
    torch.manual_seed(100 + rank)  # different weights per rank: DDP broadcasts rank 0's
    model = ToyModel()
    ddp_model = DDP(model)

    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.01)
    data = torch.Generator().manual_seed(seed)
    for _ in range(3):
        optimizer.zero_grad()
        outputs = ddp_model(torch.randn(20, 10, generator=data))
        labels = torch.randn(20, 5, generator=data)
        loss_fn(outputs, labels).backward()
        optimizer.step()
    return result(DDP, {"": model})


def demo_checkpoint(rank: int, world_size: int, workdir: str, seed: int) -> dict[str, Any]:
    print(f"Running DDP checkpoint example on rank {rank}.")
    torch.manual_seed(100 + rank)
    model = ToyModel()
    ddp_model = DDP(model)
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.01)
    data = torch.Generator().manual_seed(seed)
    train_steps(ddp_model, optimizer, data, 2)

    checkpoint_path = os.path.join(workdir, "model.checkpoint")
    if rank == 0:
        # All processes should see same parameters as they all start from same random
        # parameters and gradients are synchronized in backward passes. Therefore, saving
        # it in one process is sufficient.
        torch.save(ddp_model.state_dict(), checkpoint_path)
    # Use a barrier() to make sure that process 1 loads the model after process 0 saves it.
    dist.barrier()
    keys = sorted(ddp_model.state_dict())
    train_steps(ddp_model, optimizer, data, 1)  # moves on; the load below rewinds it
    map_location = "cpu"
    ddp_model.load_state_dict(torch.load(checkpoint_path, map_location=map_location,
                                         weights_only=True))
    losses = train_steps(ddp_model, optimizer, data, 2)
    # Not necessary to use a dist.barrier() to guard the file deletion below as the
    # AllReduce ops in the backward pass of DDP already served as the synchronization.
    dist.barrier()
    if rank == 0:
        os.remove(checkpoint_path)
    return result(DDP, {"": model}, values={"losses": torch.tensor(losses)},
                  info={"state_dict_keys": keys})


def demo_keywords(rank: int, world_size: int, workdir: str, seed: int) -> dict[str, Any]:
    """torch 2.13's whole constructor signature, positionally and by keyword."""
    group = dist.new_group(ranks=list(range(world_size)))
    torch.manual_seed(100 + rank)
    plain, full, new_style = ToyModel(), ToyModelWithExtras(), ToyModelWithExtras()

    positional = DDP(plain, None)
    keywords = DDP(
        full,
        device_ids=None,
        output_device=None,
        dim=0,
        broadcast_buffers=True,
        init_sync=True,
        process_group=group,
        bucket_cap_mb=1,
        find_unused_parameters=True,
        check_reduction=False,
        gradient_as_bucket_view=True,
        static_graph=False,
        delay_all_reduce_named_params=None,
        param_to_hook_all_reduce=None,
        mixed_precision=None,
        device_mesh=None,
        skip_all_reduce_unused_params=False,
        bucket_cap_mb_list=None,
        batched_grad_copy=False,
        forward_sync_buffers=None,
    )
    # broadcast_buffers is deprecated in 2.13: the replacement and the newer keywords.
    newer = DDP(new_style, forward_sync_buffers=True, bucket_cap_mb_list=[1],
                batched_grad_copy=True, find_unused_parameters=True)

    info: dict[str, Any] = {}
    for name, wrapper, module, pg in (("positional", positional, plain, None),
                                      ("keywords", keywords, full, group),
                                      ("newer", newer, new_style, None)):
        info[name] = {
            "isinstance": isinstance(wrapper, torch.nn.parallel.DistributedDataParallel),
            "module_is_wrapped": wrapper.module is module,
            "device_ids": wrapper.device_ids,
            "dim": wrapper.dim,
            "process_group_is_given": (wrapper.process_group is pg) if pg is not None
            else None,
            "process_group_size": dist.get_world_size(wrapper.process_group),
        }

    data = torch.Generator().manual_seed(seed)
    modules: dict[str, nn.Module] = {}
    for name, wrapper, module in (("positional", positional, plain),
                                  ("keywords", keywords, full),
                                  ("newer", newer, new_style)):
        optimizer = optim.SGD(wrapper.parameters(), lr=0.01, momentum=0.9)
        train_steps(wrapper, optimizer, data, 3)
        modules[f"{name}."] = module
        info[name]["unused_head_grad_is_none"] = (
            module.unused_head.weight.grad is None if hasattr(module, "unused_head") else None
        )
    return result(DDP, modules, info=info)


def demo_allreduce_beside(rank: int, world_size: int, workdir: str,
                          seed: int) -> dict[str, Any]:
    """The training loop's own collectives on the default group, beside the wrapper's."""
    torch.manual_seed(100 + rank)
    model = ToyModel()
    ddp_model = DDP(model)
    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.01)
    data = torch.Generator().manual_seed(seed)
    logged, counts = [], []
    for step in range(4):
        batch = 12 + 4 * ((rank + step) % 2)
        optimizer.zero_grad()
        outputs = ddp_model(torch.randn(batch, 10, generator=data))
        labels = torch.randn(batch, 5, generator=data)
        loss = loss_fn(outputs, labels)
        samples = torch.tensor([float(batch)])  # the global batch size, between forward
        dist.all_reduce(samples)  # and backward
        counts.append(samples.item())
        loss.backward()
        optimizer.step()
        loss_copy = loss.detach().clone()
        dist.all_reduce(loss_copy)  # the mean loss over ranks, for the log
        logged.append(loss_copy.item() / world_size)
        if step % 2 == 1:
            dist.barrier()
    return result(DDP, {"": model}, values={"logged_loss": torch.tensor(logged),
                                                "global_samples": torch.tensor(counts)})


def demo_rewrap(rank: int, world_size: int, workdir: str, seed: int) -> dict[str, Any]:
    """Wrap, train, let go of the wrapper, wrap the same module again, train on."""
    torch.manual_seed(100 + rank)
    model = ToyModel()
    ddp_model = DDP(model)
    optimizer = optim.SGD(model.parameters(), lr=0.01)
    data = torch.Generator().manual_seed(seed)
    train_steps(ddp_model, optimizer, data, 2)
    getattr(ddp_model, "close", lambda: None)()
    ddp_model = DDP(model)
    train_steps(ddp_model, optimizer, data, 2)
    return result(DDP, {"": model})
