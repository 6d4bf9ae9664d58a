"""Time to a validation loss on real text: commd's DDP against torch DDP, 2 nodes × 1 rank.

A byte-level transformer LM (bench/text_lm.py: 4 layers, width 256, context 128, 3.3 M
parameters, 13 MB of gradients) learns the Python standard library's own sources, 5 % of the
files held out. Two nodes with one rank each, in two network namespaces whose links are shaped
to each of ``--rates`` (commd/testing/netbed.py; root needed), or on loopback
(``--rates loopback``).

Configurations (``--configs``), run alternately (ABC…ABC…), ``--repeats`` times each:

- ``torch``: torch DDP over Gloo, dense;
- ``powersgd``: torch DDP with torch's PowerSGD comm hook (rank ``--powersgd-rank`` from step
  ``--powersgd-start``; one bucket, since with Gloo's default buckets its collectives race);
- ``commd:COMPRESSION``: commd's DistributedDataParallel, e.g. ``commd:none`` (dense),
  ``commd:topk:auto``, ``commd:topk:auto:momentum=0.9`` (the daemon keeps the momentum, so the
  optimizer's own is 0, as docs/compression.md asks);
- ``single``: one process without DDP on rank 0's batches: the compute-only limit of a step;
  its curve is what one node alone learns in the same wall time (half the data per step).

Every rank trains with SGD (lr ``--lr`` after ``--warmup`` steps of linear warm-up, momentum
0.9; docs/benchmarks.md says why) on its own stream of random windows; both
ranks evaluate the validation loss on fixed held-out windows every ``--eval-every`` steps, and
the clock stops while they do: the wall time is rank 0's training time only. Per rate it
prints a Markdown table: median step time (× torch DDP), validation loss at the middle and last
evaluation, and the wall time and steps to reach torch DDP's final validation loss (× torch
DDP's; "not reached" when the curve never gets there), all from the mean over the repeats.
Everything, every curve and the provenance, goes to ``--json``; ``--plot`` draws validation
loss against wall time, one panel per rate.

    python bench/time_to_loss.py                        # the headline: 1gbit and 100mbit (root)
    python bench/time_to_loss.py --rates loopback --json /tmp/ttl.json   # no root
    python bench/time_to_loss.py --rates 1gbit --configs torch,commd:topk:auto --json /tmp/t.json

(``--json`` elsewhere: runs that are not the headline do not replace the committed result.)
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ddp_compare  # sibling files: bench/ is sys.path[0] of a script run from it
import text_lm

from commd.compression.topk import parse_compression
from commd.testing import netbed
from commd.testing.harness import rank_or_main
from commd.testing.ports import free_port
from commd.testing.processes import FinishTimeout, start_json_worker
from commd.testing.provenance import provenance
from commd.testing.tables import markdown_table

HERE = Path(__file__).resolve()

DEFAULT_CONFIGS = "torch,powersgd,commd:none,commd:topk:auto,commd:topk:auto:momentum=0.9,single"
DEFAULT_JSON = "bench/results/time-to-loss.json"
MOMENTUM = 0.9
_JOBS = itertools.count()


@dataclass(frozen=True)
class Config:
    """One way of training: ``impl`` torch, commd or single; ``compression`` commd's value,
    "powersgd" (torch's hook) or "none"."""

    impl: str
    compression: str = "none"

    @property
    def label(self) -> str:
        if self.impl == "single":
            return "single process (no DDP)"
        if self.impl == "torch":
            return "torch DDP + PowerSGD" if self.compression == "powersgd" else "torch DDP"
        return "commd dense" if self.compression == "none" else f"commd {self.compression}"

    @property
    def ranks(self) -> int:
        return 1 if self.impl == "single" else 2


TORCH = Config("torch")


def parse_configs(text: str) -> list[Config]:
    """``torch,powersgd,commd:none,commd:topk:auto,single`` → configs; ValueError naming a bad
    entry."""
    configs = []
    for entry in (e.strip() for e in text.split(",")):
        if entry == "torch":
            configs.append(TORCH)
        elif entry == "powersgd":
            configs.append(Config("torch", "powersgd"))
        elif entry == "single":
            configs.append(Config("single"))
        elif entry.startswith("commd:"):
            compression = entry.removeprefix("commd:")
            try:
                parse_compression(compression)
            except (ValueError, TypeError) as exc:
                raise ValueError(f"--configs {entry!r}: {exc}") from None
            configs.append(Config("commd", compression))
        else:
            raise ValueError(f"--configs {entry!r}: use torch, powersgd, single or "
                             f"commd:COMPRESSION (e.g. commd:none, commd:topk:auto)")
    if len(set(configs)) != len(configs):
        raise ValueError(f"--configs {text!r} names a configuration twice")
    return configs


# --- the time-to-loss computation -----------------------------------------------------------------


def time_to_loss(curve: Sequence[tuple[float, float]], target: float) -> float | None:
    """The first wall time at which ``curve`` — (wall time, validation loss) at each evaluation,
    in order — reaches ``target``, interpolated linearly between the two evaluations around it;
    None when it never does."""
    if not curve:
        raise ValueError("an empty curve reaches nothing")
    if any(later[0] < earlier[0] for earlier, later in itertools.pairwise(curve)):
        raise ValueError("the curve's wall times must not decrease")
    previous: tuple[float, float] | None = None
    for wall, loss in curve:
        if loss <= target:  # a NaN loss never reaches it
            if previous is None or not previous[1] > loss:
                return wall
            (wall0, loss0) = previous
            return wall0 + (loss0 - target) / (loss0 - loss) * (wall - wall0)
        if not math.isnan(loss):
            previous = (wall, loss)
    return None


def eval_steps(steps: int, every: int) -> list[int]:
    """0, every, 2·every, …, and ``steps`` itself."""
    return sorted({*range(0, steps, every), steps})


# --- one rank (runs in its own process) -----------------------------------------------------------


def run_rank(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    torch.set_num_threads(spec["threads"])
    corpus = text_lm.load_corpus(spec["budget"])
    batches = text_lm.Batches(text_lm.as_tensor(corpus.train), spec["batch"], spec["rank"],
                              spec["seed"])
    windows = text_lm.validation_windows(text_lm.as_tensor(corpus.held_out),
                                         spec["val_windows"])
    model = text_lm.build_model()
    wrapped, close = (model, lambda: None) if spec["impl"] == "single" else ddp_compare.wrap(
        model, spec)
    compression = parse_compression(spec["compression"]) if spec["impl"] == "commd" else None
    corrected = compression is not None and compression.momentum > 0
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=spec["lr"],
                                momentum=0.0 if corrected else MOMENTUM)
    # A linear warm-up: without it the first steps of momentum SGD throw the loss far above
    # its start before it falls (transformers' usual remedy).
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / spec["warmup"]))
    evaluate_at = set(spec["eval_steps"])
    clock, curve, step_ms, train_loss = 0.0, [], [], []
    for step in range(spec["steps"] + 1):
        if step in evaluate_at:  # every rank evaluates, so neither waits for the other
            curve.append([step, round(clock, 4), text_lm.evaluate(model, windows)])
        if step == spec["steps"]:
            break
        inputs, targets = batches.next()  # outside the clock, as a data loader's prefetch
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = text_lm.loss(wrapped(inputs), targets)
        loss.backward()
        optimizer.step()
        schedule.step()
        took = time.perf_counter() - start
        clock += took
        step_ms.append(round(1e3 * took, 2))
        train_loss.append(round(float(loss.detach()), 4))
    checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
    ran = (ddp_compare.final_exchange(spec) if spec["impl"] == "commd" and spec["rank"] == 0
           else "")
    close()
    return {"curve": curve, "step_ms": step_ms, "train_loss": train_loss, "ran": ran,
            "checksum": checksum}


# --- jobs, repeats, rates -------------------------------------------------------------------------


@dataclass
class Outcome:
    """What one configuration's repeats at one rate gave (rank 0's clock and curves)."""

    repeats: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def median_ms(self) -> float | None:
        medians = [statistics.median(r["step_ms"]) for r in self.repeats if r["step_ms"]]
        return statistics.median(medians) if medians else None

    def mean_curve(self) -> list[tuple[int, float, float]]:
        """(step, wall time, validation loss) at each evaluation, means over the repeats."""
        if not self.repeats:
            return []
        curves = [r["curve"] for r in self.repeats]
        return [(points[0][0], statistics.fmean(p[1] for p in points),
                 statistics.fmean(p[2] for p in points)) for points in zip(*curves, strict=True)]

    def agree(self) -> bool:
        return all(r["agree"] for r in self.repeats)


def run_job(config: Config, nodes: Sequence[ddp_compare.Node], args: argparse.Namespace,
            tag: str) -> dict[str, Any]:
    """One training job, a rank per node (one rank for ``single``); rank 0's result and whether
    the ranks' final parameters agree."""
    loopback = nodes[0].host == "127.0.0.1"
    count = next(_JOBS)
    port = free_port() if loopback else 29000 + (os.getpid() + count) % 1000
    job = f"ttl-{tag}-{config.impl}-{os.getpid()}-{count}"
    used = nodes[:config.ranks]
    processes = []
    try:
        for rank, node in enumerate(used):
            spec = {
                "impl": config.impl, "compression": config.compression, "rank": rank,
                "world_size": len(used), "batch": args.batch, "steps": args.steps,
                "eval_steps": eval_steps(args.steps, args.eval_every), "lr": args.lr,
                "warmup": args.warmup,
                "seed": args.seed, "budget": args.budget, "val_windows": args.val_windows,
                "threads": args.threads, "planner": args.planner, "timeout": args.timeout,
                "job": job, "powersgd_rank": args.powersgd_rank,
                "powersgd_start": args.powersgd_start, "coordinator": nodes[0].address,
                "socket": node.socket, "master": f"{nodes[0].host}:{port}",
            }
            env = {"GLOO_SOCKET_IFNAME": node.ifname, "OMP_NUM_THREADS": str(args.threads)}
            processes.append(start_json_worker(node.wrap([sys.executable, str(HERE), "_rank"]),
                                               spec, env=env))
    except BaseException:
        for process in processes:
            process.kill()
            process.wait()
        raise
    results = ddp_compare.rank_results(processes, used, args.timeout, config.label)
    return {**results[0], "agree": len({round(r["checksum"], 6) for r in results}) == 1}


@contextlib.contextmanager
def link(rate: str) -> Iterator[list[ddp_compare.Node] | None]:
    """Two nodes: on loopback for ``loopback``, else in namespaces shaped to ``rate`` (None,
    and why printed, where namespaces cannot be used)."""
    if rate == "loopback":
        yield ddp_compare.loopback_nodes(2)
        return
    with ddp_compare.limited_link(rate) as nodes:
        yield nodes


def run_rate(rate: str, nodes: Sequence[ddp_compare.Node], configs: Sequence[Config],
             args: argparse.Namespace) -> dict[Config, Outcome]:
    """Every config ``--repeats`` times, alternating; a failed job is reported and the others
    go on."""
    outcomes = {config: Outcome() for config in configs}
    commd = any(config.impl == "commd" for config in configs)
    with ddp_compare.job_workdir(args) as workdir, \
            ddp_compare.daemons(nodes if commd else [], workdir.path):
        for repeat, config in itertools.product(range(args.repeats), configs):
            outcome = outcomes[config]
            started = time.monotonic()
            try:
                result = run_job(config, nodes, args, rate)
            except (RuntimeError, FinishTimeout) as exc:
                outcome.errors.append(str(exc))
                workdir.keep = True  # the error names the daemons' logs
                print(f"  {rate} #{repeat + 1} {config.label}: FAILED\n{exc}", flush=True)
                continue
            outcome.repeats.append(result)
            print(f"  {rate} #{repeat + 1} {config.label}: median step "
                  f"{statistics.median(result['step_ms']):.1f} ms, validation loss "
                  f"{result['curve'][-1][2]:.3f} after {result['curve'][-1][1]:.1f} s, ran "
                  f"{result['ran'] or '-'}, ranks agree {result['agree']} "
                  f"({time.monotonic() - started:.0f} s)", flush=True)
    return outcomes


# --- the summary, the table, the JSON, the plot ---------------------------------------------------


def summarise(outcomes: dict[Config, Outcome]) -> dict[str, Any]:
    """Per configuration: median step (× torch DDP), mean validation curve, the wall time to
    torch DDP's final validation loss (× torch DDP's) and the steps to it (how much of the
    time is the step's, how much the curve's). Without torch DDP no target."""
    torch = outcomes.get(TORCH)
    torch_curve = torch.mean_curve() if torch else []
    target = torch_curve[-1][2] if torch_curve else None
    torch_ms = torch.median_ms() if torch else None
    torch_time = (time_to_loss([(w, v) for _, w, v in torch_curve], target)
                  if target is not None else None)
    rows: dict[str, Any] = {}
    for config, outcome in outcomes.items():
        curve = outcome.mean_curve()
        ms = outcome.median_ms()
        reach = steps = None
        if curve and target is not None:
            reach = time_to_loss([(w, v) for _, w, v in curve], target)
            steps = time_to_loss([(float(s), v) for s, _, v in curve], target)
        rows[config.label] = {
            "median_step_ms": ms,
            "step_x_torch": ms / torch_ms if ms and torch_ms else None,
            "val_loss": [[step, loss] for step, _, loss in curve],
            "wall_s": [wall for _, wall, _ in curve],
            "time_to_target_s": reach,
            "time_x_torch": reach / torch_time if reach is not None and torch_time else None,
            "steps_to_target": steps,
            "agree": outcome.agree(), "repeats": len(outcome.repeats),
            "ran": sorted({r["ran"] for r in outcome.repeats} - {""}),
        }
    return {"target_loss": target, "configs": rows}


def table(summary: dict[str, Any]) -> str:
    rows = []
    middle = None
    for label, row in summary["configs"].items():
        if not row["val_loss"]:
            rows.append([label, "failed", *["-"] * 8])
            continue
        losses = row["val_loss"]
        middle = losses[len(losses) // 2]
        reach = row["time_to_target_s"]
        rows.append([
            label, f"{row['median_step_ms']:.1f}",
            f"{row['step_x_torch']:.2f}" if row["step_x_torch"] is not None else "-",
            f"{middle[1]:.3f}", f"{losses[-1][1]:.3f}",
            "not reached" if reach is None else f"{reach:.1f}",
            f"{row['time_x_torch']:.2f}" if row["time_x_torch"] is not None else "-",
            "-" if row["steps_to_target"] is None else f"{row['steps_to_target']:.0f}",
            ", ".join(row["ran"]) or "-", "yes" if row["agree"] else "NO",
        ])
    mid = f"val loss @ {middle[0]}" if middle else "val loss (middle)"
    target = summary["target_loss"]
    reach = f"s to {target:.3f}" if target is not None else "s to torch's final loss"
    header = ["configuration", "median step ms", "× torch DDP", mid, "final val loss", reach,
              "× torch DDP", "steps to it", "commd ran at the end", "ranks agree"]
    return markdown_table(header, rows, "lrrrrrrr")


def settings(args: argparse.Namespace, configs: Sequence[Config]) -> dict[str, Any]:
    corpus = text_lm.load_corpus(args.budget)
    model = text_lm.build_model()
    return {
        "model": {"layers": text_lm.LAYERS, "width": text_lm.WIDTH, "heads": text_lm.HEADS,
                  "context": text_lm.CONTEXT, "parameters": sum(p.numel() for p in
                                                                model.parameters()),
                  "gradient_bytes": text_lm.gradient_bytes(model)},
        "data": {"budget": args.budget, "train_bytes": len(corpus.train),
                 "held_out_bytes": len(corpus.held_out), "train_files": len(corpus.train_files),
                 "held_out_files": len(corpus.held_out_files),
                 "val_windows": args.val_windows},
        "optimizer": {"name": "SGD", "lr": args.lr, "warmup_steps": args.warmup,
                      "momentum": MOMENTUM,
                      "momentum_with_commd_correction": 0.0},
        "batch_per_rank": args.batch, "steps": args.steps,
        "eval_steps": eval_steps(args.steps, args.eval_every), "repeats": args.repeats,
        "threads": args.threads, "seed": args.seed, "rates": args.rates.split(","),
        "configs": [c.label for c in configs],
        "powersgd": {"rank": args.powersgd_rank, "start": args.powersgd_start},
        "wall_time": "rank 0's training steps only; evaluation excluded",
    }


def to_json(outcomes: dict[Config, Outcome]) -> dict[str, Any]:
    return {config.label: {"config": config.impl if config.impl != "commd" else
                           f"commd:{config.compression}",
                           "repeats": [{k: r[k] for k in ("curve", "step_ms", "train_loss",
                                                          "ran", "agree")}
                                       for r in outcome.repeats],
                           "errors": outcome.errors}
            for config, outcome in outcomes.items()}


COLOURS = {"torch DDP": "black", "torch DDP + PowerSGD": "tab:orange",
           "commd dense": "tab:blue", "commd topk:auto": "tab:green",
           "commd topk:auto:momentum=0.9": "tab:red", "single process (no DDP)": "grey"}


def plot(path: str, result: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = {rate: data for rate, data in result["rates"].items() if data["summary"]["configs"]}
    if not rates:
        print(f"  nothing to plot: {path} not written")
        return
    fig, axes = plt.subplots(1, len(rates), figsize=(6.4 * len(rates), 4.8), squeeze=False)
    for ax, (rate, data) in zip(axes[0], rates.items(), strict=True):
        summary = data["summary"]
        later: list[float] = []  # the losses after the first evaluation set the y range
        for label, row in summary["configs"].items():
            if not row["val_loss"]:
                continue
            losses = [loss for _, loss in row["val_loss"]]
            later += losses[1:]
            style = ":" if label.startswith("single") else "--" if label == "torch DDP" else "-"
            ax.plot(row["wall_s"], losses, style, marker=".", label=label,
                    color=COLOURS.get(label), linewidth=1.4)
        if summary["target_loss"] is not None:
            ax.axhline(summary["target_loss"], color="black", linewidth=0.6, alpha=0.5)
        if later:
            ax.set_ylim(min(later) - 0.05, max(later) + 0.15)
        ax.set_title("loopback" if rate == "loopback" else f"2 nodes at {rate}")
        ax.set_xlabel("wall time of training (s), evaluation excluded")
        ax.set_ylabel("validation loss (nats per byte)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    s = result["settings"]
    fig.text(0.5, 0.005, f"byte-level transformer ({s['model']['parameters'] / 1e6:.1f} M "
             f"parameters) on the Python standard library, batch {s['batch_per_rank']}×"
             f"{s['model']['context']} bytes per rank, SGD lr {s['optimizer']['lr']} momentum "
             f"{MOMENTUM}, {s['steps']} steps;\nmeans of {s['repeats']} repeat(s); thin line: "
             f"torch DDP's final validation loss (the target); the first evaluation (step 0) "
             f"lies above the axes", ha="center", va="bottom", fontsize=8)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"  picture: {path}")


# --- command line ---------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--rates", default="1gbit,100mbit",
                   help="comma-separated link rates (tc syntax, e.g. 1gbit, 100mbit), one pair "
                        "of network namespaces each (root), or loopback: no namespaces, no "
                        "root (default 1gbit,100mbit)")
    p.add_argument("--configs", default=DEFAULT_CONFIGS,
                   help=f"comma-separated configurations, run in this order in every repeat "
                        f"(default {DEFAULT_CONFIGS})")
    p.add_argument("--repeats", type=int, default=2,
                   help="runs of every configuration, alternating; the table shows the mean "
                        "curve and the median step over them (default 2)")
    p.add_argument("--steps", type=int, default=150, help="training steps per run (default 150)")
    p.add_argument("--eval-every", type=int, default=15,
                   help="steps between validation evaluations; also at the last step "
                        "(default 15)")
    p.add_argument("--batch", type=int, default=4,
                   help="windows of 128 bytes per rank and step (default 4)")
    p.add_argument("--lr", type=float, default=0.05,
                   help="SGD learning rate, momentum 0.9 (default 0.05)")
    p.add_argument("--warmup", type=int, default=20,
                   help="steps of linear learning-rate warm-up from lr/N to lr (default 20)")
    p.add_argument("--seed", type=int, default=0, help="the ranks' data streams (default 0)")
    p.add_argument("--budget", type=int, default=text_lm.DEFAULT_BUDGET,
                   help=f"bytes of stdlib source read, 5 %% of files held out (default "
                        f"{text_lm.DEFAULT_BUDGET})")
    p.add_argument("--val-windows", type=int, default=text_lm.VAL_WINDOWS,
                   help=f"held-out windows of the validation loss (default {text_lm.VAL_WINDOWS})")
    p.add_argument("--powersgd-rank", type=int, default=4,
                   help="PowerSGD's matrix_approximation_rank (default 4)")
    p.add_argument("--powersgd-start", type=int, default=10,
                   help="PowerSGD's start_powerSGD_iter, dense before it; ≥ 2 (default 10)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--planner", default=None,
                   help="commd's merge planner (default: the daemon's)")
    p.add_argument("--timeout", type=float, default=900.0,
                   help="seconds one job may take before it is killed (default 900)")
    p.add_argument("--json", default=DEFAULT_JSON, metavar="PATH",
                   help=f"where every curve, step time and the provenance go (default "
                        f"{DEFAULT_JSON}); '' for none")
    p.add_argument("--plot", default=None, metavar="PATH",
                   help="draw validation loss against wall time, one panel per rate (PNG)")
    p.add_argument("--keep-logs", action="store_true",
                   help="keep the daemons' logs (the directory is printed)")
    return p


def check(p: argparse.ArgumentParser, args: argparse.Namespace) -> list[Config]:
    """The configurations; a usage error (exit 2) naming a bad option."""
    try:
        configs = parse_configs(args.configs)
    except ValueError as exc:
        p.error(str(exc))
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    if args.steps < 1:
        p.error("--steps must be at least 1")
    if args.eval_every < 1:
        p.error("--eval-every must be at least 1")
    if args.batch < 1 or args.val_windows < 1 or args.warmup < 1:
        p.error("--batch, --val-windows and --warmup must be at least 1")
    if args.powersgd_start < 2:
        p.error("--powersgd-start must be ≥ 2 (torch's rule with error feedback)")
    for rate in args.rates.split(","):
        if rate != "loopback":
            try:
                netbed.rate_bits_per_s(rate)
            except ValueError as exc:
                p.error(f"--rates: {exc}")
    return configs


def save(path: str, result: dict[str, Any]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    configs = check(p, args)
    started = time.monotonic()
    command = None if argv is None else ["bench/time_to_loss.py", *argv]
    result: dict[str, Any] = {"provenance": provenance(command),
                              "settings": settings(args, configs), "rates": {}}
    s = result["settings"]
    print(f"time to loss: {s['model']['parameters'] / 1e6:.2f} M parameters "
          f"({s['model']['gradient_bytes'] / 1e6:.1f} MB of gradients), "
          f"{s['data']['train_bytes'] / 1e6:.1f} MB of training text, "
          f"{s['data']['held_out_bytes'] / 1e6:.2f} MB held out; batch {args.batch}×"
          f"{text_lm.CONTEXT} per rank, {args.steps} steps, {args.repeats} repeat(s), "
          f"{os.cpu_count()} CPUs", flush=True)
    for rate in args.rates.split(","):
        with link(rate) as nodes:
            if nodes is None:
                continue
            outcomes = run_rate(rate, nodes, configs, args)
        summary = summarise(outcomes)
        result["rates"][rate] = {"summary": summary, "runs": to_json(outcomes)}
        print(f"\n{rate}:\n{table(summary)}\n", flush=True)
        result["took_s"] = round(time.monotonic() - started)
        save(args.json, result)  # after every rate, so a later failure keeps this one
    if args.json:
        print(f"  every curve and step: {args.json}")
    if args.plot:
        plot(args.plot, result)
    if len(result["rates"]) > 1:  # all tables together at the end
        for rate, data in result["rates"].items():
            print(f"\n{rate}:\n{table(data['summary'])}")
    print(f"\ncommand: {result['provenance']['command']}")
    return 0


if __name__ == "__main__":
    sys.exit(rank_or_main(run_rank, main))
