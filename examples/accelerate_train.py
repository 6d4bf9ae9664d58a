"""A Hugging Face Accelerate training script on CPUs with commd averaging the gradients.

The script is Accelerate's usual loop; the only commd line is the import. With a commd daemon
running on every node (``COMMD_SOCKET`` and ``COMMD_COORDINATOR`` pointing at it, as for
``examples/train.py``)::

    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no \\
        --dynamo_backend no examples/accelerate_train.py --epochs 3

(``--multi_gpu`` is how ``accelerate launch`` starts several local processes; ``cpu=True``
below makes each one a CPU rank on Gloo.) Plain ``python examples/accelerate_train.py`` runs a
single process without any daemon. Each rank trains on its shard of one synthetic dataset
whose labels come from a fixed "teacher", with gradient accumulation and clipping; at the end
every rank prints the sum of its parameters: equal sums show the ranks agree.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from commd_client.accelerate import Accelerator  # was: from accelerate import Accelerator


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=3, help="epochs (default 3)")
    parser.add_argument("--compression", default=None,
                        help="commd's compression, e.g. topk:auto (default: none)")
    return parser.parse_args()


def synthetic_data(samples: int = 2048) -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    teacher = torch.randn(32, 10, generator=gen)
    x = torch.randn(samples, 32, generator=gen)
    return TensorDataset(x, (x @ teacher).argmax(1))


def main() -> None:
    args = parse_args()
    extra = {"compression": args.compression} if args.compression else {}
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2, **extra)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = DataLoader(synthetic_data(), batch_size=32, shuffle=True,
                        generator=torch.Generator().manual_seed(1))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    loss = torch.tensor(float("nan"))
    for epoch in range(args.epochs):
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(x), y)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
        accelerator.print(f"epoch {epoch + 1}/{args.epochs} loss {loss.item():.4f}")
    checksum = sum(float(p.detach().sum()) for p in accelerator.unwrap_model(model).parameters())
    print(f"rank {accelerator.process_index} done: {accelerator.num_processes} process(es), "
          f"{type(model).__module__}.{type(model).__name__}, params checksum {checksum:.8f}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
