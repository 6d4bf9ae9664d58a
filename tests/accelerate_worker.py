"""A Hugging Face Accelerate training script, written the way Accelerate's examples are, run by
``tests/daemon/test_accelerate.py`` with stock ``accelerate.Accelerator`` (ACC_IMPL=stock) or
``commd_client.accelerate.Accelerator`` (ACC_IMPL=commd): the one line that differs.

A small model with BatchNorm on a seeded synthetic dataset through a prepared DataLoader, SGD
with momentum and a StepLR schedule, ``Accelerator(cpu=True, gradient_accumulation_steps=2)``,
in phases:

1. ``accumulate``: one epoch inside ``accelerator.accumulate(model)`` (``no_sync`` on every
   other micro-batch), ``clip_grad_norm_`` on the synchronising ones;
2. ``no_sync``: two forwards inside ``accelerator.no_sync(model)``, the first backward
   outside it (accumulated locally), the second inside ``trigger_sync_in_backward``;
3. ``save_state``, one epoch of plain steps, ``load_state`` (back to the saved point), the same
   epoch again: it must end where the first one did.

Launched by the caller with torchrun's environment (RANK, WORLD_SIZE, …), by
``accelerate launch``, or as one plain process (no distribution). ``--variant custom`` passes
``DistributedDataParallelKwargs(broadcast_buffers=False, bucket_cap_mb=1,
gradient_as_bucket_view=True, comm_hook=FP16)`` (not ``find_unused_parameters=True``: torch
DDP then fails in ``trigger_sync_in_backward``, "marked ready twice"); ``--compression``
(commd only) is passed as ``Accelerator(compression=...)``; ``--construct-only`` only
constructs ``Accelerator()`` (without ``cpu=True``) and exits.

Each rank writes ``OUT/rank<N>.pt``: the model's state (parameters and buffers) after every
phase, the prepared model's class, what it logs of its set-up (``_get_ddp_logging_data``:
comm hook, buffer broadcast), whether ``unwrap_model`` returned the module given to
``prepare``, the clip norms; or ``{"error": ...}`` (then it exits 1).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

if os.environ.get("ACC_IMPL") == "commd":
    from commd_client.accelerate import Accelerator
else:
    from accelerate import Accelerator

SAMPLES, BATCH = 64, 8


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.norm = nn.BatchNorm1d(16)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.norm(self.body(x))))


def dataset() -> TensorDataset:
    gen = torch.Generator().manual_seed(2024)
    x = torch.randn(SAMPLES, 8, generator=gen)
    y = (x[:, :3] * torch.tensor([1.0, -2.0, 0.5])).argmax(1)
    return TensorDataset(x, y)


def pairs(loader: Any) -> Iterator[tuple[Any, Any]]:
    batches = list(loader)
    yield from zip(batches[0::2], batches[1::2], strict=True)


def train(out: Path, variant: str, compression: str | None) -> dict[str, Any]:
    handlers = None
    if variant == "custom":
        handlers = [DistributedDataParallelKwargs(broadcast_buffers=False, bucket_cap_mb=1,
                                                  gradient_as_bucket_view=True,
                                                  comm_hook=DDPCommunicationHookType.FP16)]
    extra = {"compression": compression} if compression else {}
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2, kwargs_handlers=handlers,
                              **extra)
    torch.manual_seed(7 + accelerator.process_index)  # rank 0's weights must be broadcast
    raw = Net()
    optimizer = torch.optim.SGD(raw.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.7)
    loader = DataLoader(dataset(), batch_size=BATCH)
    model, optimizer, loader, scheduler = accelerator.prepare(raw, optimizer, loader, scheduler)
    record: dict[str, Any] = {
        "ddp_class": f"{type(model).__module__}.{type(model).__qualname__}",
        "unwrapped_is_raw": accelerator.unwrap_model(model) is raw,
        "raw_marked": getattr(raw, "_is_accelerate_prepared", False),  # prepared again: rewrap
        "world_size": accelerator.num_processes,
        "distributed_type": str(accelerator.distributed_type),
        "norms": [], "states": {},
    }
    if accelerator.num_processes > 1:  # what torch DDP (or commd's) logs of its set-up
        logged = model._get_ddp_logging_data()
        record["logged"] = {key: logged.get(key) for key in ("comm_hook", "broadcast_buffers")}

    def snapshot(name: str) -> None:
        state = accelerator.unwrap_model(model).state_dict()
        record["states"][name] = {k: v.detach().clone() for k, v in state.items()}

    def loss_of(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x), y)

    for batch in loader:  # 1. gradient accumulation, 2 micro-batches per step
        with accelerator.accumulate(model):
            accelerator.backward(loss_of(batch))
            if accelerator.sync_gradients:
                norm = accelerator.clip_grad_norm_(model.parameters(), 0.5)
                record["norms"].append(float(norm))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    snapshot("accumulate")

    for first, second in pairs(loader):  # 2. no_sync, then trigger_sync_in_backward
        with accelerator.no_sync(model):
            loss_a, loss_b = loss_of(first), loss_of(second)
        accelerator.backward(loss_a)  # local only
        with accelerator.trigger_sync_in_backward(model):
            accelerator.backward(loss_b)  # reduces a + b
        optimizer.step()
        optimizer.zero_grad()
    snapshot("no_sync")

    checkpoint = out / "checkpoint"
    accelerator.save_state(str(checkpoint))  # 3. save, train, load, train the same again

    def plain_epoch() -> None:
        for batch in loader:
            accelerator.backward(loss_of(batch))
            accelerator.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()

    plain_epoch()
    snapshot("after_save")
    accelerator.load_state(str(checkpoint))
    snapshot("loaded")
    plain_epoch()
    snapshot("resumed")
    accelerator.wait_for_everyone()
    return record


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--variant", choices=("default", "custom"), default="default")
    parser.add_argument("--compression", default=None)
    parser.add_argument("--construct-only", action="store_true",
                        help="only Accelerator() (no cpu=True), then exit")
    args = parser.parse_args()
    if args.construct_only:
        Accelerator()
        return
    rank = int(os.environ.get("RANK", "0"))
    try:
        record = train(args.out, args.variant, args.compression)
    except Exception as exc:  # the test reads the error, then the exit code says it failed
        traceback.print_exc()
        torch.save({"error": f"{type(exc).__name__}: {exc}"}, args.out / f"rank{rank}.pt")
        sys.exit(1)
    torch.save(record, args.out / f"rank{rank}.pt")


if __name__ == "__main__":
    main()
