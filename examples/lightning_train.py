"""Train a small BatchNorm MLP with PyTorch Lightning, gradients averaged by commd.

The only commd line is the strategy: ``Trainer(strategy="commd")`` after ``import
commd_client.lightning`` (or ``strategy=CommdDDPStrategy(compression="topk:auto")``). With a
commd daemon on this machine (``commd run --socket /tmp/commd/commd.sock``)::

    COMMD_SOCKET=/tmp/commd/commd.sock python examples/lightning_train.py --devices 2

Lightning starts the second rank itself (as for ``strategy="ddp"``). ``--strategy ddp`` runs
the same script on torch's DDP: the printed checksums are the same. Needs
``pip install 'commd[gloo,lightning]'``.
"""

from __future__ import annotations

import argparse
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from commd_client.lightning import CommdDDPStrategy  # the import registers strategy="commd"


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(),
                                 nn.Linear(64, 1))

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def dataset() -> TensorDataset:
    """A fixed random linear "teacher" with noise: the loss goes down."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 16, generator=generator)
    teacher = torch.randn(16, 1, generator=generator)
    return TensorDataset(x, x @ teacher + 0.1 * torch.randn(2048, 1, generator=generator))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=2, help="ranks on this node (default 2)")
    parser.add_argument("--epochs", type=int, default=3, help="epochs (default 3)")
    parser.add_argument("--strategy", default="commd", help="commd (default) or ddp")
    parser.add_argument("--compression", default=None,
                        help="commd's compression, e.g. topk:auto (default: none)")
    args = parser.parse_args()
    strategy: Any = args.strategy
    if args.compression:
        strategy = CommdDDPStrategy(compression=args.compression)
    pl.seed_everything(0)
    model = Regressor()
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy,
                         max_epochs=args.epochs, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(model, DataLoader(dataset(), batch_size=32))
    checksum = sum(float(p.detach().sum()) for p in model.parameters())
    print(f"rank {trainer.global_rank} done: {trainer.global_step} steps, final loss "
          f"{float(trainer.callback_metrics['loss']):.4f}, params checksum {checksum:.8f}",
          flush=True)


if __name__ == "__main__":
    main()
