"""Train through a crash: commd's DistributedDataParallel with fault_tolerance="continue".

When a rank dies, the others finish the step in flight among themselves and go on; a
replacement (torchrun's --max-restarts on the dead rank's node, or you by hand) joins the
running job with a live peer's model, optimizer and step, and starts where the job is. Launch
one ``torchrun --standalone`` per node, so that one node's crash restarts that node only
(docs/fault-tolerance.md, "Launching")::

    COMMD_NODE_RANK=0 COMMD_NNODES=3 COMMD_JOB=elastic COMMD_COORDINATOR=node0:29600 \\
        torchrun --standalone --nnodes=1 --nproc-per-node=1 --max-restarts=3 \\
        examples/elastic_train.py --steps 100 --step-time 0.1 --crash-at 20 --crash-rank 2

Data: each epoch starts with a DistributedSampler over the ranks alive then; a rank that is
lost mid-epoch leaves its shard untrained until the next epoch, which re-shards by
``ddp.world_size``. Each rank keeps its batch size, so the global batch shrinks with the world
(the learning rate is yours to rescale; commd does not). At the end every rank prints one
``elastic_train:`` line with the steps it ran and a checksum of its parameters: the ranks'
checksums are equal, the replacement's included.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from commd_client.torch import DistributedDataParallel

# Called before each step with the step and the wrapper (tests hold the survivors there).
BeforeStep = Callable[[int, DistributedDataParallel], None]


class StepCounter:
    """The loop's own state: registered with ``ddp.register_state`` so that a replacement
    receives it with the model and the optimizer."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = state["step"]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100,
                        help="training steps in all (default 100)")
    parser.add_argument("--epochs", type=int, default=4,
                        help="epochs the steps are split into; the data is re-sharded at each "
                             "epoch's start (default 4)")
    parser.add_argument("--batch-size", type=int, default=16, help="per-rank batch (default 16)")
    parser.add_argument("--samples", type=int, default=1536, help="dataset size (default 1536)")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")
    parser.add_argument("--step-time", type=float, default=0.0, metavar="SECONDS",
                        help="sleep this long in every step, standing in for a real model's "
                             "compute so that a restarted rank arrives while the job still "
                             "trains (default 0)")
    parser.add_argument("--crash-at", type=int, default=None, metavar="STEP",
                        help="simulate a crash in this step's backward (once: see --crash-marker)")
    parser.add_argument("--crash-rank", type=int, default=None, metavar="R",
                        help="the rank that crashes at --crash-at")
    parser.add_argument("--crash-marker", type=Path, default=None, metavar="PATH",
                        help="file written just before the crash; while it exists the rank does "
                             "not crash again, so its restart trains on (default: "
                             "<tmp>/elastic_train-<COMMD_JOB>-rank<R>.crashed)")
    args = parser.parse_args(argv)
    if args.steps < 1 or not 1 <= args.epochs <= args.steps:
        parser.error("--steps must be at least 1 and --epochs between 1 and --steps")
    if args.batch_size < 1 or args.samples < args.batch_size:
        parser.error("--batch-size must be at least 1 and at most --samples")
    if not 0 <= args.step_time <= 60:
        parser.error("--step-time must be between 0 and 60 seconds")
    if (args.crash_at is None) != (args.crash_rank is None):
        parser.error("--crash-at and --crash-rank go together")
    if args.crash_marker is None and args.crash_rank is not None:
        job = os.environ.get("COMMD_JOB", "default")
        args.crash_marker = (Path(tempfile.gettempdir())
                             / f"elastic_train-{job}-rank{args.crash_rank}.crashed")
    return args


def synthetic_dataset(samples: int) -> TensorDataset:
    """The same on every rank (seeded): inputs and the targets of a fixed random teacher."""
    generator = torch.Generator().manual_seed(1234)
    x = torch.randn(samples, 16, generator=generator)
    teacher = torch.randn(16, 1, generator=generator)
    return TensorDataset(x, torch.tanh(x @ teacher))


def shard_batches(dataset: TensorDataset, ddp: DistributedDataParallel, rank: int,
                  epoch: int, batch_size: int, skip: int) -> Iterator[list[torch.Tensor]]:
    """This rank's batches for ``epoch``, sharded over the ranks alive now, from batch
    ``skip`` on (a replacement joins mid-epoch); they repeat if the epoch has more steps."""
    # The ranks alive now share the dataset; this rank takes the shard of its place among them.
    sampler: DistributedSampler[tuple[torch.Tensor, ...]] = DistributedSampler(
        dataset, num_replicas=ddp.world_size, rank=ddp.members.index(rank), shuffle=True,
        seed=0, drop_last=True)
    sampler.set_epoch(epoch)  # a new order each epoch, the same on every rank
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True)
    seen = 0
    while True:
        for batch in loader:
            if seen >= skip:
                yield batch
            seen += 1


def crash_now(marker: Path) -> None:
    """Leave the marker, then die as a crashed process does: no clean-up, exit code 1."""
    marker.write_text(f"crashed at pid {os.getpid()}\n")
    os._exit(1)


def say(line: str) -> None:
    """One line in one write: the ranks of a node share torchrun's output, and print's two
    writes (the text, then the newline) of two ranks can interleave."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def checksum(model: nn.Module) -> str:
    """A digest of the parameters' exact bytes: equal on ranks whose replicas are equal."""
    data = b"".join(p.detach().contiguous().numpy().tobytes() for p in model.parameters())
    return hashlib.sha256(data).hexdigest()[:16]


def main(argv: Sequence[str] | None = None, before_step: BeforeStep | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(0)
    head = nn.Linear(32, 1)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), head)
    ddp = DistributedDataParallel(model, fault_tolerance="continue")
    rank = ddp.endpoint.rank  # the job-wide rank (COMMD_NODE_RANK under one torchrun per node)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    counter = StepCounter()
    # A replacement loads the live peer's state of each name here, at once.
    ddp.register_state("optimizer", optimizer)
    ddp.register_state("counter", counter)
    dataset = synthetic_dataset(args.samples)
    steps_per_epoch = -(-args.steps // args.epochs)
    crash = (args.crash_at is not None and rank == args.crash_rank
             and not args.crash_marker.exists())
    if ddp.joined_at_step:
        say(f"rank {rank}: joined the running job at step {ddp.joined_at_step}, "
            f"world size {ddp.world_size}")
    batches: Iterator[list[torch.Tensor]] = iter(())
    for step in range(ddp.joined_at_step, args.steps):
        epoch, offset = divmod(step, steps_per_epoch)
        if offset == 0 or step == ddp.joined_at_step:
            # Survivors keep their shards until here; now the ranks alive share the data.
            batches = shard_batches(dataset, ddp, rank, epoch, args.batch_size, skip=offset)
        if before_step is not None:
            before_step(step, ddp)
        x, y = next(batches)
        time.sleep(args.step_time)
        loss = nn.functional.mse_loss(ddp(x), y)
        if crash and step == args.crash_at:
            # Dies inside backward, after its first gradient is handed to commd.
            head.weight.register_hook(lambda grad: crash_now(args.crash_marker))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        counter.step += 1
        if offset == steps_per_epoch - 1 or step == args.steps - 1:
            say(f"rank {rank}: epoch {epoch} done at step {step + 1}, world size "
                f"{ddp.world_size}, loss {loss.item():.5f}")
    say(f"elastic_train: rank={rank} joined_at={ddp.joined_at_step} "
        f"steps_run={args.steps - ddp.joined_at_step} counter={counter.step} "
        f"world_size={ddp.world_size} members={','.join(map(str, ddp.members))} "
        f"checksum={checksum(model)}")
    ddp.close()


if __name__ == "__main__":
    main()
