"""What top-k costs in loss on the DDP task, without daemons: two simulated nodes in one process.

The same task, model, data streams and optimizer as bench/ddp_compare.py (bench/ddp_tasks.py),
two nodes of one rank each, global top-k over the flat gradient (torch.topk; not commd's tie
rule, which only matters for equal magnitudes). Each variant trains ``--steps`` steps on each
of ``--streams`` data streams; the table shows the final loss (mean of the last 10 steps, both
nodes' batches) averaged over the streams, against dense training's.

* ``dense``: the mean gradient, SGD with momentum 0.9;
* ``ef``: error feedback (each node sends the top-k of R + g and keeps the rest), SGD with
  momentum 0.9 on the sum — what ``topk:R`` did under SGD momentum before the DDP wrapper
  corrected it on the rank (and what it still does through the plain client);
* ``mc``: momentum correction (u = m·u + g, the top-k of R + u, SGD without momentum) — what
  ``topk:R:momentum=0.9`` does, and ``topk:R`` through the DDP wrapper under SGD momentum 0.9
  (the same update);
* ``mask``: ``mc`` with DGC's momentum factor masking (u = 0 where sent).

    .venv/bin/python bench/topk_offline.py --variants ef,mc --ratios 0.01,0.03,0.05,0.1
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ddp_tasks import CLASSES, DEFAULT_LR, MOMENTUM, TeacherStream, deep_mlp

NODES = 2
BATCH = 64
VARIANTS = ("ef", "mc", "mask")


def train(variant: str, ratio: float, stream: int, steps: int) -> float:
    """The final loss (mean of the last 10 steps) of one variant on one data stream."""
    model = deep_mlp()
    params = list(model.parameters())
    elements = sum(p.numel() for p in params)
    streams = [TeacherStream(node, BATCH, stream) for node in range(NODES)]
    corrected = variant in ("mc", "mask")
    optimizer = torch.optim.SGD(params, lr=DEFAULT_LR, momentum=0.0 if corrected else MOMENTUM)
    residuals = [torch.zeros(elements) for _ in range(NODES)]
    velocities = [torch.zeros(elements) for _ in range(NODES)]
    k = max(1, int(ratio * elements))
    losses = []
    for _ in range(steps):
        gradients, step_losses = [], []
        for node in range(NODES):
            x, y = streams[node].next()
            model.zero_grad()
            loss = nn.functional.cross_entropy(model(x)[:, :CLASSES], y)
            loss.backward()
            step_losses.append(loss.item())
            gradients.append(torch.cat([p.grad.reshape(-1) for p in params]))
        losses.append(statistics.fmean(step_losses))
        total = torch.zeros(elements)
        for node, gradient in enumerate(gradients):
            if variant == "dense":
                total += gradient
                continue
            if corrected:
                velocities[node].mul_(MOMENTUM).add_(gradient)
                gradient = velocities[node]
            residuals[node].add_(gradient)
            chosen = residuals[node].abs().topk(k).indices
            total[chosen] += residuals[node][chosen]
            residuals[node][chosen] = 0
            if variant == "mask":
                velocities[node][chosen] = 0
        total /= NODES
        offset = 0
        for p in params:
            p.grad.copy_(total[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        optimizer.step()
    return statistics.fmean(losses[-10:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default="ef,mc", help=f"of {', '.join(VARIANTS)}")
    parser.add_argument("--ratios", default="0.01,0.03,0.05,0.1")
    parser.add_argument("--streams", type=int, default=5, help="data streams (default 5)")
    parser.add_argument("--steps", type=int, default=150, help="steps (default 150)")
    args = parser.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; use {', '.join(VARIANTS)}")
    ratios = [float(r) for r in args.ratios.split(",") if r]
    if args.streams < 1 or args.steps < 10 or not all(0 < r <= 1 for r in ratios):
        parser.error("--streams ≥ 1, --steps ≥ 10, ratios in (0, 1]")
    torch.set_num_threads(1)
    dense = statistics.fmean(train("dense", 1.0, s, args.steps) for s in range(args.streams))
    print(f"{args.steps} steps, {args.streams} streams; dense final loss {dense:.3f}")
    print("| variant | ratio | final loss | × dense |\n|---|---|---|---|")
    for variant in variants:
        for ratio in ratios:
            loss = statistics.fmean(train(variant, ratio, s, args.steps)
                                    for s in range(args.streams))
            print(f"| {variant} | {ratio:g} | {loss:.3f} | {loss / dense:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
