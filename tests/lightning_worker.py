"""A Lightning training script, run by tests/daemon/test_lightning.py under ``strategy="ddp"`` and
under commd's strategy from the same seeds; every rank saves what it ended with.

Launch ``lightning``: started once, Lightning's own launcher (``start_method="popen"``, the way
``strategy="ddp"`` launches) re-runs this script for rank 1, on one node (``devices=2``).
Launch ``torchrun``: the test starts one process per rank with torchrun's environment
(``TORCHELASTIC_RUN_ID`` …), one node each (``num_nodes=2``, ``devices=1``).
Launch ``spawn`` (phase ``spawned``, strategies ``ddp_spawn`` / ``commd_spawn``): Lightning
spawns both ranks from this process and hands rank 0's trained model back to it.

Phases, each recorded per rank (parameters and buffers; each fit's wrapper and whether it was
closed by the strategy's teardown):

- ``auto``: automatic optimisation, ``accumulate_grad_batches=2``, ``gradient_clip_val``, a
  BatchNorm model; one epoch, ``trainer.save_checkpoint``; then a fresh model and trainer
  resume from it (``ckpt_path=``) for a second epoch, then ``trainer.test``.
- ``manual``: manual optimisation, a GAN-ish toy with two optimizers toggled, two
  ``manual_backward`` per step, BatchNorm in the generator.
- ``hook`` (commd only): ``ddp_comm_hook=fp16_compress_hook``; the hook the wrapper logged.
- ``bad`` (commd only): an option the daemon refuses; the error's text is recorded.

``--strategy`` picks how the strategy is given: ``ddp`` (Lightning's name), ``commd`` (the
registered name, after ``import commd_client.lightning``) or ``class``
(``CommdDDPStrategy(...)``).
"""

from __future__ import annotations

import argparse
import logging
import os
import traceback
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

BATCH = 4
SAMPLES = 64  # 8 batches per rank per epoch at 2 ranks
WRAPPERS: list[Any] = []  # the strategy's model wrapper of each fit, seen in training


def note_wrapper(module: pl.LightningModule) -> None:
    WRAPPERS.append(module.trainer.strategy.model)


def wrappers() -> list[tuple[str, bool | None]]:
    """Each fit's wrapper class, and for commd's whether it is closed (None: torch's)."""
    return [(f"{type(w).__module__}.{type(w).__qualname__}", getattr(w, "_closed", None))
            for w in WRAPPERS]


def data(seed: int, features: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(SAMPLES, features, generator=generator)
    y = x[:, :1] * 0.5 - x[:, 1:2] + 0.1 * torch.randn(SAMPLES, 1, generator=generator)
    return TensorDataset(x, y)


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(),
                                 nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def on_train_start(self) -> None:
        note_wrapper(self)

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)

    def test_step(self, batch: Any, index: int) -> None:
        x, y = batch
        self.log("test_loss", F.mse_loss(self(x), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(data(1, 6), batch_size=BATCH)

    def test_dataloader(self) -> DataLoader[Any]:
        return DataLoader(data(2, 6), batch_size=BATCH)


class Gan(pl.LightningModule):
    """Two optimizers toggled per step, as Lightning's GAN example does."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(),
                                       nn.Linear(8, 2))
        self.discriminator = nn.Sequential(nn.Linear(2, 8), nn.LeakyReLU(0.2), nn.Linear(8, 1))

    def on_train_start(self) -> None:
        note_wrapper(self)

    def training_step(self, batch: Any, index: int) -> None:
        real, noise = batch[0][:, :2], batch[0][:, 2:]
        opt_g, opt_d = self.optimizers()  # type: ignore[misc,attr-defined]
        ones = torch.ones(real.shape[0], 1)
        self.toggle_optimizer(opt_d)
        fake = self.generator(noise).detach()
        d_loss = (F.binary_cross_entropy_with_logits(self.discriminator(real), ones)
                  + F.binary_cross_entropy_with_logits(self.discriminator(fake), 0 * ones))
        self.manual_backward(d_loss)
        opt_d.step()
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)
        self.toggle_optimizer(opt_g)
        g_loss = F.binary_cross_entropy_with_logits(self.discriminator(self.generator(noise)),
                                                    ones)
        self.manual_backward(g_loss)
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [torch.optim.Adam(self.generator.parameters(), lr=0.01),
                torch.optim.SGD(self.discriminator.parameters(), lr=0.05, momentum=0.5)]

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(data(3, 6), batch_size=BATCH)


def strategy(kind: str, **options: Any) -> Any:
    if kind == "ddp":
        return "ddp_find_unused_parameters_true" if options else "ddp"
    if kind == "ddp_spawn":
        return kind
    import commd_client.lightning as commd_lightning

    if kind in ("commd", "commd_spawn") and not options:
        return kind
    return commd_lightning.CommdDDPStrategy(**options)


def trainer(args: argparse.Namespace, strategy_: Any, **extra: Any) -> pl.Trainer:
    devices, nodes = (1, 2) if args.launch == "torchrun" else (2, 1)
    return pl.Trainer(accelerator="cpu", devices=devices, num_nodes=nodes, strategy=strategy_,
                      logger=False, enable_progress_bar=False, enable_model_summary=False,
                      enable_checkpointing=False, deterministic=True, **extra)


def state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def run_auto(args: argparse.Namespace, record: dict[str, Any]) -> None:
    fit = {"max_epochs": 1, "accumulate_grad_batches": 2, "gradient_clip_val": 0.05}
    pl.seed_everything(0, workers=True)
    model = Regressor()
    first = trainer(args, strategy(args.strategy), **fit)
    first.fit(model)
    record["strategy_class"] = type(first.strategy).__name__
    record["auto_epoch1"] = state(model)
    checkpoint = args.out / "auto.ckpt"
    first.save_checkpoint(checkpoint)
    record["wrappers_after_fit"] = wrappers()
    pl.seed_everything(1, workers=True)  # a different init: the checkpoint must restore
    resumed = Regressor()
    fit["max_epochs"] = 2
    second = trainer(args, strategy(args.strategy), **fit)
    second.fit(resumed, ckpt_path=checkpoint)
    record["auto_epoch2"] = state(resumed)
    record["global_step"] = second.global_step
    tested = second.test(resumed, verbose=False)
    record["test_loss"] = float(tested[0]["test_loss"])
    record["wrappers_after_test"] = wrappers()


def run_spawned(args: argparse.Namespace, record: dict[str, Any]) -> None:
    """``start_method="spawn"``: the ranks are children of this process; rank 0's trained
    state comes back here, as Lightning's spawn launcher returns it."""
    pl.seed_everything(0, workers=True)
    model = Regressor()
    run = trainer(args, strategy(args.strategy), max_epochs=1, accumulate_grad_batches=2,
                  gradient_clip_val=0.05)
    run.fit(model)
    record["strategy_class"] = type(run.strategy).__name__
    record["spawned"] = state(model)


def run_manual(args: argparse.Namespace, record: dict[str, Any]) -> None:
    pl.seed_everything(0, workers=True)
    model = Gan()
    run = trainer(args, strategy(args.strategy, find_unused_parameters=True), max_epochs=1)
    run.fit(model)
    record["manual"] = state(model)
    record["manual_steps"] = run.global_step
    record["wrappers_after_manual"] = wrappers()


def run_hook(args: argparse.Namespace, record: dict[str, Any]) -> None:
    """``ddp_comm_hook=fp16_compress_hook`` on the CPU: registered on commd's wrapper."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    pl.seed_everything(0, workers=True)
    model = Regressor()
    hooked = strategy("class", ddp_comm_hook=default_hooks.fp16_compress_hook)
    trainer(args, hooked, max_epochs=1).fit(model)
    record["hook_logged"] = WRAPPERS[-1]._get_ddp_logging_data().get("comm_hook")
    record["hook_trained"] = state(model)


def run_bad(args: argparse.Namespace, record: dict[str, Any]) -> None:
    """An option only the daemon can judge: the run must fail with CommdError naming it."""
    from commd_client import CommdError

    pl.seed_everything(0, workers=True)
    try:
        trainer(args, strategy("class", compression="topk:lots"), max_epochs=1).fit(Regressor())
    except CommdError as exc:
        record["bad_error"] = f"{type(exc).__name__}: {exc}"
    record["wrappers_after_bad"] = wrappers()


def rank() -> int:
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", choices=("ddp", "commd", "class", "ddp_spawn",
                                               "commd_spawn"), required=True)
    parser.add_argument("--launch", choices=("lightning", "torchrun", "spawn"), required=True)
    parser.add_argument("--phases", default="auto,manual")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")  # Lightning's advice on workers and logging
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    record: dict[str, Any] = {}
    try:
        for phase in args.phases.split(","):
            {"auto": run_auto, "manual": run_manual, "bad": run_bad, "hook": run_hook,
             "spawned": run_spawned}[phase](args, record)
    except BaseException as exc:
        record["error"] = "".join(traceback.format_exception(exc))
        raise
    finally:
        # Lightning's launcher sets RANK-less children: the global rank is the process group's
        record["wrappers"] = wrappers()
        if torch.distributed.is_initialized():
            record["rank"] = torch.distributed.get_rank()
        torch.save(record, args.out / f"rank{record.get('rank', rank())}.pt")


if __name__ == "__main__":
    main()
