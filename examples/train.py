"""Train commd.models' small CNN with commd's DistributedDataParallel on synthetic data.

Run one process per rank, e.g. under torchrun with a commd daemon on every node::

    torchrun --nproc-per-node 2 examples/train.py --steps 30

or set the environment yourself: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE (as torchrun
does) and COMMD_SOCKET, COMMD_COORDINATOR, COMMD_JOB to point at the daemons. Every rank
trains on its own data (seeded by rank); the labels come from a fixed random "teacher", so
the loss goes down. At the end each rank prints the sum of its parameters: equal sums show
the ranks agree.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F

from commd.models import small_cnn
from commd_client.torch import DistributedDataParallel

_BATCHES_PER_RANK = 8  # each rank cycles through its own small synthetic dataset


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="training steps (default 30)")
    parser.add_argument("--batch-size", type=int, default=32, help="per-rank batch (default 32)")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")
    return parser.parse_args()


def synthetic_data(rank: int, batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's batches: inputs seeded by rank, labels from one teacher shared by all."""
    teacher = torch.randn(3 * 32 * 32, 10, generator=torch.Generator().manual_seed(12345))
    gen = torch.Generator().manual_seed(1000 + rank)
    data = []
    for _ in range(_BATCHES_PER_RANK):
        x = torch.randn(batch_size, 3, 32, 32, generator=gen)
        data.append((x, (x.flatten(1) @ teacher).argmax(1)))
    return data


def main() -> None:
    args = parse_args()
    rank = int(os.environ.get("RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if "OMP_NUM_THREADS" not in os.environ:  # ranks of one node share its cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    torch.manual_seed(rank)  # different initial weights: the wrapper broadcasts rank 0's
    data = synthetic_data(rank, args.batch_size)
    with DistributedDataParallel(small_cnn()) as model:
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        times: list[float] = []
        loss = torch.tensor(float("nan"))
        for step in range(1, args.steps + 1):
            x, y = data[(step - 1) % len(data)]
            start = time.perf_counter()
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            times.append(time.perf_counter() - start)
            print(f"rank {rank} step {step}/{args.steps} loss {loss.item():.4f} "
                  f"step {times[-1] * 1e3:.1f} ms", flush=True)
        # The first step includes registering with the daemon: leave it out of the mean.
        steady = times[1:] or times
        checksum = sum(p.detach().double().sum().item() for p in model.parameters())
        print(f"rank {rank} done: {args.steps} steps, mean step "
              f"{sum(steady) / len(steady) * 1e3:.1f} ms, final loss {loss.item():.4f}, "
              f"params checksum {checksum:.8f}", flush=True)


if __name__ == "__main__":
    main()
