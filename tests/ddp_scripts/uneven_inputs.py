"""The PyTorch "Distributed Training with Uneven Inputs Using the Join Context Manager"
tutorial, on CPU, with a BatchNorm buffer: ranks train on different numbers of batches
inside ``model.join()``. The only line a port changes is the import.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from porting_kit import result
from torch import nn

if os.environ.get("DDP_IMPL") == "commd":
    from commd_client.torch import DistributedDataParallel as DDP
else:
    from torch.nn.parallel import DistributedDataParallel as DDP

BATCHES_PER_RANK = (3, 5, 4)


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))


def train(rank: int, world_size: int, workdir: str, seed: int) -> dict[str, Any]:
    torch.manual_seed(100 + rank)
    module = build_model()
    model = DDP(module)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = torch.Generator().manual_seed(seed)
    inputs = [(torch.randn(8, 4, generator=data), torch.randn(8, 1, generator=data))
              for _ in range(BATCHES_PER_RANK[rank % len(BATCHES_PER_RANK)])]

    num_inputs = 0
    with model.join():
        for x, y in inputs:
            num_inputs += 1
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
    print(f"Rank {rank} has exhausted all {num_inputs} of its inputs!")
    return result(DDP, {"": module}, info={"num_inputs": num_inputs})
