"""Train commd.models' small CNN with commd's DistributedDataParallel on synthetic data.

Run one process per rank, e.g. under torchrun with a commd daemon on every node::

    torchrun --nproc-per-node 2 examples/train.py --steps 30

or set the environment yourself: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE (as torchrun
does) and COMMD_SOCKET, COMMD_COORDINATOR, COMMD_JOB to point at the daemons. Every rank
trains on its own data (seeded by rank): noise images, each with a faint pattern of its class
(ten fixed patterns shared by all ranks), so there is a signal to learn and the loss falls
within 30 steps (from ln 10 = 2.30 towards 0). Every ``--log-every`` steps a rank prints its
mean loss over those steps; at the end each rank prints the sum of its parameters: equal sums
show the ranks agree.
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
_CLASSES = 10
# How visible a class's pattern is under the unit noise: at 0.2 the mean loss of four ranks
# falls from ~2.3 in the first 10 steps to ~1.2 in the next 10 and ~0.05 in the 10 after.
_SIGNAL = 0.2


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="training steps (default 30)")
    parser.add_argument("--batch-size", type=int, default=32, help="per-rank batch (default 32)")
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (default 1e-3)")
    parser.add_argument("--log-every", type=int, default=10, metavar="N",
                        help="print the mean loss of every N steps (default 10)")
    return parser.parse_args()


def class_patterns() -> torch.Tensor:
    """The ten classes' patterns, the same on every rank: smooth (4x4 upsampled, so the
    convolutions and pooling keep them) and scaled to unit standard deviation."""
    coarse = torch.randn(_CLASSES, 3, 4, 4, generator=torch.Generator().manual_seed(12345))
    patterns = F.interpolate(coarse, size=32, mode="bilinear", align_corners=False)
    return patterns / patterns.flatten(1).std(1).view(_CLASSES, 1, 1, 1)


def synthetic_data(rank: int, batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's batches: labels and noise seeded by rank, plus the labels' patterns."""
    patterns = class_patterns()
    gen = torch.Generator().manual_seed(1000 + rank)
    data = []
    for _ in range(_BATCHES_PER_RANK):
        y = torch.randint(0, _CLASSES, (batch_size,), generator=gen)
        x = torch.randn(batch_size, 3, 32, 32, generator=gen) + _SIGNAL * patterns[y]
        data.append((x, y))
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
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
        times: list[float] = []
        window: list[float] = []  # the losses since the last printed line
        loss = torch.tensor(float("nan"))
        for step in range(1, args.steps + 1):
            x, y = data[(step - 1) % len(data)]
            start = time.perf_counter()
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            times.append(time.perf_counter() - start)
            window.append(loss.item())
            if step % args.log_every == 0 or step == args.steps:
                print(f"rank {rank} step {step}/{args.steps} loss {sum(window) / len(window):.4f} "
                      f"(mean of steps {step - len(window) + 1}-{step})", flush=True)
                window.clear()
        # The first step includes registering with the daemon: leave it out of the mean.
        steady = times[1:] or times
        checksum = sum(p.detach().double().sum().item() for p in model.parameters())
        print(f"rank {rank} done: {args.steps} steps, mean step "
              f"{sum(steady) / len(steady) * 1e3:.1f} ms, final loss {loss.item():.4f}, "
              f"params checksum {checksum:.8f}", flush=True)


if __name__ == "__main__":
    main()
