"""What handing the gradients over costs the rank: a fresh tensor copied in, or a zeroed view.

commd's DDP wrapper reduces gradients in place in a shared buffer. After
``zero_grad()`` (``set_to_none=True``, torch's default) autograd hands each gradient over as a
fresh tensor, and the wrapper's hook copies it into the buffer, one pass (under the rank's
momentum correction the velocity is written from it in that pass). After
``zero_grad(set_to_none=False)`` ``.grad`` stays the view: zeroed in one pass, autograd adds
the gradient into it in a second, and the correction then adds and copies in place: the way
every step ran while the wrapper re-attached zeroed views at each forward.

Both ways run in one job, alternating step by step on both ranks (2 nodes × 1 rank on
loopback, deep_mlp on the teacher task of bench/ddp_tasks.py, SGD momentum 0.9), so the
machine's noise falls on both alike. Printed per compression: rank 0's median step and
backward (with the hand-over) per way, and the paired ratio: the median over adjacent
pairs of fresh ÷ zeroed (below 1: the fresh tensor is cheaper).

    python bench/grad_handover.py                                    # none, topk:0.04:allgather
    python bench/grad_handover.py --compression topk:0.04:allgather --steps 400
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ddp_compare  # sibling files: bench/ is sys.path[0] of a script run from it
import ddp_tasks

from commd.compression.topk import parse_compression
from commd.testing.harness import rank_or_main
from commd.testing.processes import start_json_worker
from commd.testing.results import add_results_option, write_results
from commd.testing.tables import markdown_table

HERE = Path(__file__).resolve()

WAYS = ("fresh", "zeroed")  # zero_grad(set_to_none=True), zero_grad(set_to_none=False)


def run_rank(spec: dict[str, Any]) -> dict[str, Any]:
    """One rank: steps alternate between the two ways; rank 0's step and backward seconds."""
    import torch

    torch.set_num_threads(1)
    model = ddp_tasks.deep_mlp()
    wrapped, close = ddp_compare.wrap(model, spec)
    optimizer = ddp_tasks.optimizer(wrapped.parameters(), 0.01, ddp_tasks.MOMENTUM)
    stream = ddp_tasks.TeacherStream(spec["rank"], 64, 0)
    steps: dict[str, list[float]] = {way: [] for way in WAYS}
    backwards: dict[str, list[float]] = {way: [] for way in WAYS}
    try:
        for step in range(spec["warmup"] + spec["steps"]):
            way = WAYS[step % 2]
            x, y = stream.next()
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=way == "fresh")
            loss = ddp_tasks.loss(wrapped(x), y)
            forward = time.perf_counter()
            loss.backward()
            backward = time.perf_counter()
            optimizer.step()
            if step >= spec["warmup"]:
                steps[way].append(time.perf_counter() - start)
                backwards[way].append(backward - forward)
    finally:
        close()
    return {"steps": steps, "backwards": backwards}


def paired_ratio(fresh: Sequence[float], zeroed: Sequence[float]) -> float:
    """The median of fresh[i] / zeroed[i]: adjacent steps, so slow spells hit both."""
    if not fresh or len(fresh) != len(zeroed):
        raise ValueError("paired_ratio needs two equally long, non-empty series")
    return statistics.median(f / z for f, z in zip(fresh, zeroed, strict=True))


def summary_row(compression: str, result: dict[str, Any]) -> list[str]:
    steps, backwards = result["steps"], result["backwards"]
    count = min(len(steps["fresh"]), len(steps["zeroed"]))

    def ms(values: Sequence[float]) -> str:
        return f"{1e3 * statistics.median(values):.1f}"

    return [compression, ms(steps["fresh"]), ms(steps["zeroed"]),
            f"{paired_ratio(steps['fresh'][:count], steps['zeroed'][:count]):.3f}",
            ms(backwards["fresh"]), ms(backwards["zeroed"]),
            f"{paired_ratio(backwards['fresh'][:count], backwards['zeroed'][:count]):.3f}"]


def run_job(compression: str, nodes: Sequence[ddp_compare.Node], args: argparse.Namespace,
            ) -> dict[str, Any]:
    job = f"handover-{os.getpid()}-{compression.replace(':', '-')}"
    processes = []
    for rank, node in enumerate(nodes):
        spec = {"impl": "commd", "job": job, "rank": rank, "world_size": len(nodes),
                "compression": compression, "planner": None, "steps": args.steps,
                "warmup": args.warmup, "timeout": args.timeout,
                "coordinator": nodes[0].address, "socket": node.socket}
        processes.append(start_json_worker([sys.executable, str(HERE), "_rank"], spec,
                                           env={"OMP_NUM_THREADS": "1"}))
    return ddp_compare.rank_results(processes, nodes, args.timeout, compression)[0]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--compression", default="none,topk:0.04:allgather",
                   help="comma-separated commd compressions, one job each (default "
                        "none,topk:0.04:allgather: a forced exchange, since on loopback "
                        "`auto` would pick dense)")
    p.add_argument("--steps", type=int, default=300,
                   help="measured steps after the warm-up, half of them each way (default 300)")
    p.add_argument("--warmup", type=int, default=100,
                   help="unmeasured first steps: commd's plan search (default 100)")
    p.add_argument("--timeout", type=float, default=300.0, help="per job, seconds")
    p.add_argument("--keep-logs", action="store_true", help="keep the daemons' logs")
    add_results_option(p, "grad-handover")
    return p


def table(results: dict[str, Any]) -> str:
    header = ["compression", "step ms fresh", "step ms zeroed", "step fresh/zeroed (paired)",
              "backward ms fresh", "backward ms zeroed", "backward fresh/zeroed (paired)"]
    return markdown_table(header, results["rows"])


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error(f"--steps must be at least 2 (one step each way), got {args.steps}")
    if args.warmup < 0:
        p.error(f"--warmup must not be negative, got {args.warmup}")
    compressions = [c.strip() for c in args.compression.split(",")]
    for compression in compressions:
        try:
            parse_compression(compression)
        except ValueError as exc:
            p.error(f"--compression {compression!r}: {exc}")
    started = time.monotonic()
    print(f"2 nodes x 1 rank on loopback, deep_mlp batch 64, {args.warmup} warm-up + "
          f"{args.steps} measured steps alternating the two ways, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}", flush=True)
    rows = []
    for compression in compressions:
        nodes = ddp_compare.loopback_nodes(2)
        with ddp_compare.job_workdir(args) as workdir, ddp_compare.daemons(nodes, workdir.path):
            rows.append(summary_row(compression, run_job(compression, nodes, args)))
    results = {"steps": args.steps, "warmup": args.warmup, "rows": rows}
    write_results("grad-handover", results, args.results)
    print(table(results))
    print(f"\ncommand: {shlex.join(['python', *sys.argv])}\ntook "
          f"{time.monotonic() - started:.0f} s ({time.strftime('%Y-%m-%d %H:%M')}), "
          f"load average at the end {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(rank_or_main(run_rank, main))
