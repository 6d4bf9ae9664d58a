"""The Trainer of pytorch/examples' distributed/ddp-tutorial-series/multinode.py, on CPU:
DataLoader with a DistributedSampler, rank 0 saves a snapshot of ``model.module``'s state,
and a new Trainer loads it into the plain module before wrapping a new DDP. The only line a
port changes is the import.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from porting_kit import result
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

if os.environ.get("DDP_IMPL") == "commd":
    from commd_client.torch import DistributedDataParallel as DDP
else:
    from torch.nn.parallel import DistributedDataParallel as DDP


class MyTrainDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, size: int) -> None:
        self.size = size
        data = torch.Generator().manual_seed(7)  # the same dataset on every rank
        self.data = [(torch.rand(20, generator=data), torch.rand(1, generator=data))
                     for _ in range(size)]

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[index]


class Trainer:
    def __init__(self, model: torch.nn.Module, train_data: DataLoader[Any],
                 optimizer: torch.optim.Optimizer, save_every: int, snapshot_path: str) -> None:
        self.global_rank = dist.get_rank()
        self.model = model
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.epochs_run = 0
        self.snapshot_path = snapshot_path
        if os.path.exists(snapshot_path):
            print("Loading snapshot")
            self._load_snapshot(snapshot_path)
        self.model = DDP(self.model)

    def _load_snapshot(self, snapshot_path: str) -> None:
        snapshot = torch.load(snapshot_path, map_location="cpu", weights_only=True)
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"Resuming training from snapshot at Epoch {self.epochs_run}")

    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor) -> None:
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.mse_loss(output, targets)
        loss.backward()
        self.optimizer.step()

    def _run_epoch(self, epoch: int) -> None:
        b_sz = len(next(iter(self.train_data))[0])
        print(f"[GPU{self.global_rank}] Epoch {epoch} | Batchsize: {b_sz} | "
              f"Steps: {len(self.train_data)}")
        self.train_data.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
        for source, targets in self.train_data:
            self._run_batch(source, targets)

    def _save_snapshot(self, epoch: int) -> None:
        snapshot = {
            "MODEL_STATE": self.model.module.state_dict(),
            "EPOCHS_RUN": epoch,
        }
        torch.save(snapshot, self.snapshot_path)
        print(f"Epoch {epoch} | Training snapshot saved at {self.snapshot_path}")

    def train(self, max_epochs: int) -> None:
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if self.global_rank == 0 and epoch % self.save_every == 0:
                self._save_snapshot(epoch)


def load_train_objs() -> tuple[Dataset[Any], torch.nn.Module, torch.optim.Optimizer]:
    train_set = MyTrainDataset(64)  # load your dataset
    model = torch.nn.Linear(20, 1)  # load your model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    return train_set, model, optimizer


def prepare_dataloader(dataset: Dataset[Any], batch_size: int) -> DataLoader[Any]:
    return DataLoader(dataset, batch_size=batch_size, pin_memory=False, shuffle=False,
                      sampler=DistributedSampler(dataset))


def main(rank: int, workdir: str, save_every: int, total_epochs: int, batch_size: int,
         snapshot_path: str = "snapshot.pt") -> Trainer:
    snapshot_path = os.path.join(workdir, snapshot_path)
    dataset, model, optimizer = load_train_objs()
    train_data = prepare_dataloader(dataset, batch_size)
    trainer = Trainer(model, train_data, optimizer, save_every, snapshot_path)
    trainer.train(total_epochs)
    return trainer


def run(rank: int, world_size: int, workdir: str, seed: int) -> dict[str, Any]:
    """A first run saves snapshots; a second, as after a restart, resumes from the last."""
    torch.manual_seed(100 + rank)
    first = main(rank, workdir, save_every=2, total_epochs=3, batch_size=8)
    dist.barrier()  # the snapshot is written before anyone restarts
    torch.manual_seed(200 + rank)  # the restarted process builds different weights
    second = main(rank, workdir, save_every=2, total_epochs=5, batch_size=8)
    dist.barrier()
    if rank == 0:
        os.remove(second.snapshot_path)
    modules = {"first.": first.model.module, "second.": second.model.module}
    return result(DDP, modules, info={"resumed_at": second.epochs_run})
