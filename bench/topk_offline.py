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
* ``mask``: ``mc`` with DGC's momentum factor masking (u = 0 where sent);
* ``layer``: ``mc`` with the top-k taken per parameter tensor (``ratio`` of each), not over
  the whole gradient: every layer sends every step;
* ``global``: ``mc`` where both nodes send the same ``k`` indices, the top-k of the sum of
  their R + u (what a STAR leader would pick if it saw every node's values: the best choice
  of ``k`` positions for the sum);
* ``ef21``: EF21 (Richtárik et al., 2021): each node keeps an estimate of its gradient, sends
  the top-k of gradient − estimate and adds it to the estimate; the model steps with the mean
  of the estimates (dense, every position) under SGD momentum 0.9.

``--dense-steps N`` runs every compressed variant dense for its first N steps (DGC's warm-up).

    .venv/bin/python bench/topk_offline.py --variants ef,mc --ratios 0.01,0.03,0.05,0.1
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

import torch
from ddp_tasks import CLASSES, DEFAULT_LR, MOMENTUM, TeacherStream, deep_mlp
from torch import nn

from commd.cli.tables import markdown_table
from commd.testing.results import add_results_option, write_results

NODES = 2
BATCH = 64
VARIANTS = ("ef", "mc", "mask", "layer", "global", "ef21")
CORRECTED = ("mc", "mask", "layer", "global")  # momentum on the node: SGD without it


def train(variant: str, ratio: float, stream: int, steps: int, dense_steps: int = 0) -> float:
    """The final loss (mean of the last 10 steps) of one variant on one data stream."""
    model = deep_mlp()
    params = list(model.parameters())
    sizes = [p.numel() for p in params]
    elements = sum(sizes)
    streams = [TeacherStream(node, BATCH, stream) for node in range(NODES)]
    corrected = variant in CORRECTED
    optimizer = torch.optim.SGD(params, lr=DEFAULT_LR, momentum=0.0 if corrected else MOMENTUM)
    # what a node has not sent yet (ef21: the node's estimate of its gradient)
    residuals = [torch.zeros(elements) for _ in range(NODES)]
    velocities = [torch.zeros(elements) for _ in range(NODES)]
    k = max(1, int(ratio * elements))
    losses = []
    for step in range(steps):
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
        if variant == "dense" or step < dense_steps:
            _send_everything(variant, gradients, residuals, velocities, total)
        elif variant == "global":
            _send_global(k, gradients, residuals, velocities, total)
        else:
            for node, gradient in enumerate(gradients):
                _send_node(variant, ratio, k, sizes, gradient, residuals[node],
                           velocities[node], total)
        total /= NODES
        offset = 0
        for p in params:
            p.grad.copy_(total[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        optimizer.step()
    return statistics.fmean(losses[-10:])


def _send_everything(variant: str, gradients: list[torch.Tensor], residuals: list[torch.Tensor],
                     velocities: list[torch.Tensor], total: torch.Tensor) -> None:
    """A dense step: what each node holds goes out whole (dense training, or a warm-up step)."""
    for node, gradient in enumerate(gradients):
        if variant == "dense":
            total += gradient
        elif variant == "ef21":
            residuals[node].copy_(gradient)
            total += gradient
        else:
            if variant in CORRECTED:
                gradient = velocities[node].mul_(MOMENTUM).add_(gradient)
            total += residuals[node].add_(gradient)
            residuals[node].zero_()


def _send_global(k: int, gradients: list[torch.Tensor], residuals: list[torch.Tensor],
                 velocities: list[torch.Tensor], total: torch.Tensor) -> None:
    for node, gradient in enumerate(gradients):
        residuals[node].add_(velocities[node].mul_(MOMENTUM).add_(gradient))
    chosen = torch.stack(residuals).sum(dim=0).abs().topk(k).indices
    for residual in residuals:
        total[chosen] += residual[chosen]
        residual[chosen] = 0


def _send_node(variant: str, ratio: float, k: int, sizes: list[int], gradient: torch.Tensor,
               residual: torch.Tensor, velocity: torch.Tensor, total: torch.Tensor) -> None:
    """One node's top-k into ``total`` (its residual, velocity or estimate updated)."""
    if variant == "ef21":
        difference = gradient - residual
        chosen = difference.abs().topk(k).indices
        residual[chosen] += difference[chosen]
        total += residual
        return
    if variant in CORRECTED:
        velocity.mul_(MOMENTUM).add_(gradient)
        gradient = velocity
    residual.add_(gradient)
    if variant == "layer":
        chosen = torch.cat([offset + residual[offset:offset + size].abs().topk(
            max(1, int(ratio * size))).indices for offset, size in _segments(sizes)])
    else:
        chosen = residual.abs().topk(k).indices
    total[chosen] += residual[chosen]
    residual[chosen] = 0
    if variant == "mask":
        velocity[chosen] = 0


def _segments(sizes: list[int]) -> list[tuple[int, int]]:
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    return list(zip(offsets, sizes, strict=True))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="ef,mc",
                        help=f"comma-separated, of {', '.join(VARIANTS)} (default ef,mc; "
                             "each is described above)")
    parser.add_argument("--ratios", default="0.01,0.03,0.05,0.1",
                        help="comma-separated top-k ratios in (0, 1] (default "
                             "0.01,0.03,0.05,0.1)")
    parser.add_argument("--streams", type=int, default=5, help="data streams (default 5)")
    parser.add_argument("--steps", type=int, default=150, help="steps (default 150)")
    parser.add_argument("--dense-steps", type=int, default=0, metavar="N",
                        help="compressed variants run their first N steps dense (default 0)")
    add_results_option(parser, "topk-offline")
    args = parser.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; use {', '.join(VARIANTS)}")
    try:
        ratios = [float(r) for r in args.ratios.split(",") if r]
    except ValueError:
        parser.error(f"--ratios: not a list of numbers: {args.ratios!r}")
    if (args.streams < 1 or args.steps < 10 or not 0 <= args.dense_steps < args.steps
            or not ratios or not all(0 < r <= 1 for r in ratios)):
        parser.error("--streams ≥ 1, --steps ≥ 10, 0 ≤ --dense-steps < --steps, "
                     "ratios in (0, 1]")
    torch.set_num_threads(1)
    dense = statistics.fmean(train("dense", 1.0, s, args.steps) for s in range(args.streams))
    warm_up = f", the first {args.dense_steps} dense" if args.dense_steps else ""
    print(f"{args.steps} steps{warm_up}, {args.streams} stream(s); "
          f"dense final loss {dense:.3f}", flush=True)
    rows = []
    for variant in variants:
        for ratio in ratios:
            loss = statistics.fmean(train(variant, ratio, s, args.steps, args.dense_steps)
                                    for s in range(args.streams))
            rows.append({"variant": variant, "ratio": ratio, "final_loss": loss})
            print(f"{variant} {ratio:g}: {loss:.3f}", flush=True)
    results = {"steps": args.steps, "dense_steps": args.dense_steps, "streams": args.streams,
               "dense_final_loss": dense, "rows": rows}
    write_results("topk-offline", results, args.results)
    print(table(results))
    return 0


def table(results: dict[str, Any]) -> str:
    """Each variant's and ratio's final loss, and as a multiple of dense's."""
    dense = results["dense_final_loss"]
    return markdown_table(["variant", "ratio", "final loss", "× dense"], [
        [row["variant"], f"{row['ratio']:g}", f"{row['final_loss']:.3f}",
         f"{row['final_loss'] / dense:.3f}"] for row in results["rows"]], "lrrr")


if __name__ == "__main__":
    sys.exit(main())
