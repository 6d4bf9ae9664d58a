"""Time to a validation loss on real text: commd's DDP against the strongest baselines torch
ships, 2 nodes × 1 rank.

A byte-level transformer LM (bench/text_lm.py: 4 layers, width 256, context 128, 3.3 M
parameters, 13 MB of gradients) learns the Python standard library's own sources, 5 % of the
files held out. Two nodes with one rank each, in two network namespaces whose links are shaped
to each of ``--rates`` (commd/testing/netbed.py; root needed), or on loopback
(``--rates loopback``).

Configurations (``--configs``), run alternately (ABC…CBA…ABC…), ``--repeats`` times each:

- ``fp16``: torch DDP with torch's ``fp16_compress_hook``: the 16-bit baseline. torch refuses
  ``bf16_compress_hook`` on CPU and Gloo (it asks for CUDA 11+ and NCCL 2.10+), so the fp16
  hook is the fair 16-bit baseline here;
- ``powersgd``: torch DDP with torch's PowerSGD comm hook (rank ``--powersgd-rank`` from step
  ``--powersgd-start``; one bucket, since with Gloo's default buckets its collectives race);
- ``torch``: torch DDP over Gloo, dense fp32: a reference, not a baseline;
- ``commd:COMPRESSION``: commd's DistributedDataParallel with ``compression=COMPRESSION``,
  any value commd's parser takes (it alone decides, and its message says what is wrong), e.g.
  ``commd:none`` (dense), ``commd:topk:auto``, ``commd:topk:auto:momentum=0.9`` (the daemon
  keeps the momentum, so the optimizer's own is 0, as docs/compression.md asks),
  ``commd:powersgd:4:start=10``, ``commd:auto``;
- ``commd:COMPRESSION+HOOK``: the same with a torch comm hook registered on commd's wrapper:
  ``+fp16`` (``fp16_compress_hook``) or ``+powersgd`` (``powerSGD_hook`` with
  ``PowerSGDState(process_group=None, matrix_approximation_rank=--powersgd-rank,
  start_powerSGD_iter=--powersgd-start)``), e.g. ``commd:none+fp16``. A hook (or a
  compression) the wrapper refuses fails that configuration with its CommdError, printed and
  kept in the JSON and the table; the others go on;
- ``single``: one process without DDP on rank 0's batches: the compute-only limit of a step;
  its curve is what one node alone learns in the same wall time (half the data per step);
- ``pair``: two such processes side by side, each on its own batches, exchanging nothing: the
  compute-only limit where the ranks share the machine's cores (as here, 2 cores for 2 ranks
  and their daemons); its curve is one node's.

**The target and the headline.** Per rate, the *best baseline* is whichever of ``powersgd`` and
``fp16`` ends ``--steps`` steps at the lower validation loss (the first in ``--configs`` on a
tie), and the target is that loss. The baselines train ``--steps`` steps; every other
configuration trains ``--max-steps`` (1.5 × ``--steps`` unless given), so that one that learns
less per step but steps faster can still get there; one that has not by its last step is
"not reached". For every configuration the table gives the wall time to the target and that
time × the best baseline's own (the issue's targets for ``commd:auto``: ≤ 0.8× at 1 Gbit/s,
≤ 0.6× at 100 Mbit/s), the validation loss at step ``--steps`` (ending no worse than the best
baseline: at most the target there), the median step × the best baseline's, and the
compute-only limit: the single process's step × the best baseline's.

Every rank trains with SGD (lr ``--lr`` after ``--warmup`` steps of linear warm-up, momentum
0.9; docs/benchmarks.md says why) on its own stream of random windows; both
ranks evaluate the validation loss on fixed held-out windows every ``--eval-every`` steps and at
step ``--steps``, and the clock stops while they do: the wall time is rank 0's training time
only. The curves and step times are means and medians over the repeats. Everything, every
curve and the provenance, goes to ``--json`` (bench/report.py renders its table into
docs/benchmarks.md); ``--plot`` draws validation loss against wall time, one panel per rate.

    python bench/time_to_loss.py                        # the headline: 1gbit and 100mbit (root)
    python bench/time_to_loss.py --rates loopback --configs torch,fp16,powersgd,commd:none \\
        --json /tmp/ttl.json                            # no root
    python bench/time_to_loss.py --rates 1gbit --configs fp16,powersgd,commd:topk:auto \\
        --json /tmp/t.json

The bare command (eight configurations, 200 steps for the baselines and 300 for the others,
two repeats, two rates) takes about an hour on a quiet 2-core machine: ~15 minutes at
1 Gbit/s, ~45 at 100 Mbit/s, where the dense fp32 runs (torch, commd:none: 13.3 MB a step,
~1.1 s on the wire) are half of it. (``--json`` elsewhere: runs that are not the headline do
not replace the committed result.)
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
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ddp_compare  # sibling files: bench/ is sys.path[0] of a script run from it
import text_lm

from commd.cli.tables import markdown_table
from commd.compression.spec import parse_compression
from commd.testing import netbed
from commd.testing.harness import rank_or_main
from commd.testing.ports import free_port
from commd.testing.processes import FinishTimeout, start_json_worker
from commd.testing.provenance import provenance

HERE = Path(__file__).resolve()

# Parsed when the bench runs, not when it is imported (commd's parser decides what a
# compression may be); {rank} and {start} are --powersgd-rank and --powersgd-start, so that
# commd's PowerSGD runs as torch's does.
DEFAULT_CONFIGS = ("torch,fp16,powersgd,commd:none,commd:none+fp16,"
                   "commd:powersgd:{rank}:start={start},commd:auto,single")
DEFAULT_STEPS = 200
MAX_STEPS_FACTOR = 1.5  # --max-steps unless given: the others' room to reach the target
DEFAULT_JSON = "bench/results/time-to-loss.json"
MOMENTUM = 0.9
HOOKS = {"fp16": "fp16 hook", "powersgd": "PowerSGD hook"}  # torch comm hooks: name → label
_JOBS = itertools.count()
# Where a step's time goes, medians per rank: both DDPs wait for the all-reduced gradients at
# the end of backward (an autograd callback), so the exposed communication is backward's.
# "cpu" is the rank process's CPU time in the step (every thread): beside the wall parts it
# shows what a rank computes against what it waits or is kept off the cores.
STEP_PARTS = ("forward", "backward", "optimizer", "cpu")


@dataclass(frozen=True)
class Config:
    """One way of training: ``impl`` torch, commd or single; ``compression`` commd's
    ``compression=`` ("none" for torch and single); ``hook`` the torch comm hook registered on
    the DDP wrapper: none, fp16 or powersgd."""

    impl: str
    compression: str = "none"
    hook: str = "none"

    @property
    def name(self) -> str:
        """As ``--configs`` spells it (and the JSON)."""
        if self.impl != "commd":
            return self.impl if self.hook == "none" else self.hook
        return f"commd:{self.compression}" + ("" if self.hook == "none" else f"+{self.hook}")

    @property
    def label(self) -> str:
        if self.impl == "single":
            return "single process (no DDP)"
        if self.impl == "pair":
            return "two processes (no DDP)"
        if self.impl == "torch":
            return {"none": "torch DDP", "fp16": "torch DDP + fp16 hook",
                    "powersgd": "torch DDP + PowerSGD"}[self.hook]
        base = "commd dense" if self.compression == "none" else f"commd {self.compression}"
        return base if self.hook == "none" else f"{base} + {HOOKS[self.hook]}"

    @property
    def ranks(self) -> int:
        return 1 if self.impl == "single" else 2


TORCH = Config("torch")
FP16 = Config("torch", hook="fp16")
POWERSGD = Config("torch", hook="powersgd")
SINGLE = Config("single")
PAIR = Config("pair")
BASELINES = (POWERSGD, FP16)  # the strongest torch ships (design.md, principle 15)
BY_LABEL = {config.label: config for config in (TORCH, FP16, POWERSGD, SINGLE, PAIR)}
NO_DDP = ("single", "pair")


def config_of(entry: str) -> Config:
    """One ``--configs`` entry (or a JSON ``config``) as a Config, its compression not checked;
    ValueError for what is none of the forms."""
    if entry == "torch":
        return TORCH
    if entry in HOOKS:
        return Config("torch", hook=entry)
    if entry == "single":
        return SINGLE
    if entry == "pair":
        return PAIR
    if entry.startswith("commd:"):
        compression, plus, hook = entry.removeprefix("commd:").rpartition("+")
        if not plus:
            compression, hook = hook, "none"
        elif hook not in HOOKS:
            raise ValueError(f"hook {hook!r}: use +fp16 or +powersgd, e.g. commd:none+fp16")
        if not compression:
            raise ValueError("name the compression, e.g. commd:none or commd:none+fp16")
        return Config("commd", compression, hook)
    raise ValueError("use torch, fp16, powersgd, single, pair, commd:COMPRESSION or "
                     "commd:COMPRESSION+HOOK (e.g. commd:none, commd:topk:auto, "
                     "commd:none+fp16)")


def parse_configs(text: str) -> list[Config]:
    """``torch,fp16,powersgd,commd:none+fp16,commd:topk:auto,single`` → configs, every commd
    compression checked by commd's own parser; ValueError naming a bad entry."""
    configs = []
    for entry in (e.strip() for e in text.split(",")):
        try:
            config = config_of(entry)
            if config.impl == "commd":
                parse_compression(config.compression)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"--configs {entry!r}: {exc}") from None
        configs.append(config)
    if len(set(configs)) != len(configs):
        raise ValueError(f"--configs {text!r} names a configuration twice")
    return configs


def schedule(configs: Sequence[Config], repeats: int) -> list[tuple[int, Config]]:
    """(repeat, config) in the order they run: forwards, then backwards, and so on
    (ABC CBA ABC …), so that a drift in load hits every configuration alike."""
    return [(repeat, config) for repeat in range(repeats)
            for config in (configs if repeat % 2 == 0 else configs[::-1])]


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


def eval_steps(last: int, every: int, also: int | None = None) -> list[int]:
    """0, every, 2·every, …, ``also`` (the baselines' last step) and ``last`` itself."""
    return sorted({*range(0, last, every), last, *([also] if also is not None else [])})


def steps_of(config: Config, steps: int, max_steps: int) -> int:
    """The baselines train ``steps``: their final loss is the target; the others
    ``max_steps``, to have room to reach it."""
    return steps if config in BASELINES else max_steps


# --- one rank (runs in its own process) -----------------------------------------------------------


def comm_hook(spec: Mapping[str, Any]) -> tuple[object, Callable[..., Any]] | None:
    """The (state, hook) that ``spec["hook"]`` names, as torch's docs register them."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    if spec["hook"] == "fp16":
        return None, default_hooks.fp16_compress_hook
    if spec["hook"] == "powersgd":
        # Error feedback and warm start are on by default; with them torch needs start ≥ 2.
        return psgd.PowerSGDState(process_group=None,
                                  matrix_approximation_rank=spec["powersgd_rank"],
                                  start_powerSGD_iter=spec["powersgd_start"]), psgd.powerSGD_hook
    return None


def wrap(model: Any, spec: dict[str, Any]) -> tuple[Any, Callable[[], None]]:
    """The model in torch's or commd's DDP with the config's comm hook, and how to close it.
    torch's PowerSGD goes through ddp_compare's wrapper (one bucket: see there)."""
    if spec["impl"] == "torch" and spec["hook"] == "powersgd":
        return ddp_compare.wrap_torch(model, {**spec, "compression": "powersgd"})
    wrapped, close = ddp_compare.wrap(model, spec)
    try:
        hook = comm_hook(spec)
        if hook is not None:
            wrapped.register_comm_hook(*hook)
    except BaseException:
        close()  # commd: leave the job at once; the error is the rank's result
        raise
    return wrapped, close


def daemon_momentum(spec: Mapping[str, Any]) -> float:
    """The momentum commd's daemon keeps under the config's compression (``:momentum=M``);
    0 without (and for torch and single), so the optimizer keeps its own."""
    if spec["impl"] != "commd":
        return 0.0
    parsed = parse_compression(spec["compression"])
    return float(getattr(parsed, "momentum", 0.0) or 0.0)


def _nothing() -> None:
    """What closes a model without DDP."""


def run_rank(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    torch.set_num_threads(spec["threads"])
    corpus = text_lm.load_corpus(spec["budget"])
    batches = text_lm.Batches(text_lm.as_tensor(corpus.train), spec["batch"], spec["rank"],
                              spec["seed"])
    windows = text_lm.validation_windows(text_lm.as_tensor(corpus.held_out),
                                         spec["val_windows"])
    model = text_lm.build_model()
    wrapped, close = (model, _nothing) if spec["impl"] in NO_DDP else wrap(model, spec)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=spec["lr"],
                                momentum=0.0 if daemon_momentum(spec) > 0 else MOMENTUM)
    # A linear warm-up: without it the first steps of momentum SGD throw the loss far above
    # its start before it falls (transformers' usual remedy).
    lr_schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / spec["warmup"]))
    evaluate_at = set(spec["eval_steps"])
    clock, curve, step_ms, train_loss = 0.0, [], [], []
    parts: list[tuple[float, float, float, float]] = []  # STEP_PARTS
    for step in range(spec["steps"] + 1):
        if step in evaluate_at:  # every rank evaluates, so neither waits for the other
            curve.append([step, round(clock, 4), text_lm.evaluate(model, windows)])
        if step == spec["steps"]:
            break
        inputs, targets = batches.next()  # outside the clock, as a data loader's prefetch
        start, cpu_start = time.perf_counter(), time.process_time()
        optimizer.zero_grad()
        loss = text_lm.loss(wrapped(inputs), targets)
        forward = time.perf_counter()
        loss.backward()
        backward = time.perf_counter()
        optimizer.step()
        lr_schedule.step()
        took = time.perf_counter() - start
        parts.append((forward - start, backward - forward, start + took - backward,
                      time.process_time() - cpu_start))
        clock += took
        step_ms.append(round(1e3 * took, 2))
        train_loss.append(round(float(loss.detach()), 4))
    checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
    ran = (ddp_compare.final_exchange(spec) if spec["impl"] == "commd" and spec["rank"] == 0
           else "")
    close()
    return {"curve": curve, "step_ms": step_ms, "train_loss": train_loss, "ran": ran,
            "checksum": checksum,
            "step_parts_ms": {name: round(1e3 * statistics.median(p[i] for p in parts), 2)
                              for i, name in enumerate(STEP_PARTS)}}


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

    def step_parts_ms(self) -> dict[str, float]:
        """Each part of the step (``STEP_PARTS``, and the daemons' CPU where commd ran), the
        median over the repeats that measured it (runs before a part existed lack it)."""
        names = dict.fromkeys(name for r in self.repeats for name in r.get("step_parts_ms", {}))
        return {name: statistics.median(r["step_parts_ms"][name] for r in self.repeats
                                        if name in r.get("step_parts_ms", {}))
                for name in names}

    def agree(self) -> bool | None:
        """Whether every repeat's ranks ended equal (None: ranks that train apart)."""
        if any(r["agree"] is None for r in self.repeats):
            return None
        return all(r["agree"] for r in self.repeats)


def reason(error: str) -> str:
    """What a failed job says in one line: the last line of its error (a rank's traceback
    ends with the exception and its message)."""
    lines = [line.strip() for line in error.splitlines() if line.strip()]
    last = lines[-1] if lines else "failed"
    return last if len(last) <= 300 else last[:297] + "..."


def run_job(config: Config, nodes: Sequence[ddp_compare.Node], args: argparse.Namespace,
            tag: str) -> dict[str, Any]:
    """One training job, a rank per node (one rank for ``single``); rank 0's result and whether
    the ranks' final parameters agree."""
    loopback = nodes[0].host == "127.0.0.1"
    count = next(_JOBS)
    port = free_port() if loopback else 29000 + (os.getpid() + count) % 1000
    job = f"ttl-{tag}-{config.impl}-{os.getpid()}-{count}"
    used = nodes[:config.ranks]
    steps = steps_of(config, args.steps, args.max_steps)
    processes = []
    try:
        for rank, node in enumerate(used):
            spec = {
                "impl": config.impl, "compression": config.compression, "hook": config.hook,
                "rank": rank, "world_size": len(used), "batch": args.batch, "steps": steps,
                "eval_steps": eval_steps(steps, args.eval_every, args.steps), "lr": args.lr,
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
    daemon_cpu = daemons_cpu_s(used) if config.impl == "commd" else None
    results = ddp_compare.rank_results(processes, used, args.timeout, config.label)
    if daemon_cpu is not None:
        # The daemons' CPU over the whole job (set-up and evaluations too, where they idle)
        # per step and node: what the daemons take from the ranks' shared cores.
        spent = daemons_cpu_s(used) - daemon_cpu
        results[0]["step_parts_ms"]["daemon_cpu"] = round(1e3 * spent / steps / len(used), 2)
    # two processes without DDP train apart: nothing to agree on
    agree = (None if config.impl in NO_DDP
             else len({round(r["checksum"], 6) for r in results}) == 1)
    return {**results[0], "agree": agree}


def daemons_cpu_s(nodes: Sequence[ddp_compare.Node]) -> float:
    """CPU seconds (user and system, every thread) the nodes' daemon processes have used so
    far: every process whose command line names a node's socket and is a daemon, found in
    /proc (namespaced nodes share this PID namespace)."""
    sockets = [node.socket.encode() for node in nodes]
    ticks = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes()
            stat = (entry / "stat").read_text()
        except OSError:  # it ended while we looked
            continue
        if b"commd.cli" in command and b"run" in command and any(s in command for s in sockets):
            fields = stat[stat.rindex(")") + 2:].split()
            ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


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
    """Every config ``--repeats`` times, alternating (``schedule``); a failed job is reported
    and the others go on."""
    outcomes = {config: Outcome() for config in configs}
    commd = any(config.impl == "commd" for config in configs)
    with ddp_compare.job_workdir(args) as workdir, \
            ddp_compare.daemons(nodes if commd else [], workdir.path):
        for repeat, config in schedule(configs, args.repeats):
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
                  f"{statistics.median(result['step_ms']):.1f} ms ("
                  + ", ".join(f"{k} {v:.0f}" for k, v in result["step_parts_ms"].items())
                  + "), validation loss "
                  f"{result['curve'][-1][2]:.3f} after {result['curve'][-1][1]:.1f} s, ran "
                  f"{result['ran'] or '-'}, ranks agree {result['agree']} "
                  f"({time.monotonic() - started:.0f} s)", flush=True)
    return outcomes


# --- the summary, the table, the JSON, the plot ---------------------------------------------------


def best_baseline(outcomes: Mapping[Config, Outcome]) -> Config | None:
    """Of the baselines that ran, the one whose mean curve ends at the lower validation loss
    (the first in ``outcomes`` on a tie); None when neither ran."""
    finals = {config: curve[-1][2] for config, outcome in outcomes.items()
              if config in BASELINES and (curve := outcome.mean_curve())
              and math.isfinite(curve[-1][2])}
    return min(finals, key=lambda config: finals[config]) if finals else None


def summarise(outcomes: Mapping[Config, Outcome]) -> dict[str, Any]:
    """The best baseline, its final validation loss (the target) and the step it ends at;
    per configuration its median step (× the best baseline's), mean validation curve, the
    validation loss at that step, and the wall time to the target (× the best baseline's)
    and the steps to it (how much of the time is the step's, how much the curve's). Without a
    baseline no target."""
    best = best_baseline(outcomes)
    best_curve = outcomes[best].mean_curve() if best else []
    target_step, _, target = best_curve[-1] if best_curve else (None, None, None)
    best_ms = outcomes[best].median_ms() if best else None
    best_time = (time_to_loss([(w, v) for _, w, v in best_curve], target)
                 if target is not None else None)
    limits = {config: outcome.median_ms() for config, outcome in outcomes.items()
              if config in (SINGLE, PAIR)}
    rows: dict[str, Any] = {}
    for config, outcome in outcomes.items():
        curve = outcome.mean_curve()
        ms = outcome.median_ms()
        reach = steps = None
        if curve and target is not None:
            reach = time_to_loss([(w, v) for _, w, v in curve], target)
            steps = time_to_loss([(float(s), v) for s, _, v in curve], target)
        at_target_step = [loss for step, _, loss in curve if step == target_step]
        rows[config.label] = {
            "config": config.name,
            "median_step_ms": ms,
            "step_x_best": ms / best_ms if ms and best_ms else None,
            "val_loss": [[step, loss] for step, _, loss in curve],
            "wall_s": [wall for _, wall, _ in curve],
            "loss_at_target_step": at_target_step[0] if at_target_step else None,
            "time_to_target_s": reach,
            "time_x_best": reach / best_time if reach is not None and best_time else None,
            "steps_to_target": steps,
            "step_parts_ms": outcome.step_parts_ms(),
            "agree": outcome.agree(), "repeats": len(outcome.repeats),
            "ran": sorted({r["ran"] for r in outcome.repeats} - {""}),
            "errors": sorted({reason(error) for error in outcome.errors}),
        }
    return {"best_baseline": best.label if best else None, "target_loss": target,
            "target_step": target_step, "best_time_s": best_time,
            "compute_limit_x": limit_x(limits.get(SINGLE), best_ms),
            "shared_cores_limit_x": limit_x(limits.get(PAIR), best_ms),
            "configs": rows}


def limit_x(limit_ms: float | None, best_ms: float | None) -> float | None:
    """A limit's step × the best baseline's (None where either did not run)."""
    return limit_ms / best_ms if limit_ms and best_ms else None


def headline(summary: Mapping[str, Any]) -> str:
    """The target and the compute-only limit, in words."""
    if summary["best_baseline"] is None:
        return "no baseline (fp16, powersgd) finished: no target"
    words = (f"target: the best baseline, {summary['best_baseline']}, ends its "
             f"{summary['target_step']} steps at {summary['target_loss']:.3f}")
    if summary["best_time_s"] is not None:
        words += f", reached after {summary['best_time_s']:.1f} s"
    if summary["compute_limit_x"] is not None:
        words += (f"; compute-only limit (the single process's step): "
                  f"{summary['compute_limit_x']:.2f}× its step")
    if summary.get("shared_cores_limit_x") is not None:
        words += (f"; on the shared cores (two processes without DDP side by side): "
                  f"{summary['shared_cores_limit_x']:.2f}×")
    return words


def table(summary: Mapping[str, Any]) -> str:
    def ratio(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    rows = []
    for label, row in summary["configs"].items():
        if not row["val_loss"]:
            rows.append([label, "failed", *["-"] * 8])
            continue
        last_step, last_loss = row["val_loss"][-1]
        at_step = row["loss_at_target_step"]
        reach = row["time_to_target_s"]
        rows.append([
            label, f"{row['median_step_ms']:.1f}", ratio(row["step_x_best"]),
            "-" if at_step is None else f"{at_step:.3f}", f"{last_loss:.3f} @ {last_step}",
            "not reached" if reach is None else f"{reach:.1f}", ratio(row["time_x_best"]),
            "-" if row["steps_to_target"] is None else f"{row['steps_to_target']:.0f}",
            ", ".join(row["ran"]) or "-", {None: "-", True: "yes", False: "NO"}[row["agree"]],
        ])
    target, step = summary["target_loss"], summary["target_step"]
    header = ["configuration", "median step ms", "step × best baseline",
              "val loss" if step is None else f"val loss @ {step}", "last val loss @ step",
              "s to the target" if target is None else f"s to {target:.3f}",
              "time × best baseline", "steps to it", "commd ran at the end", "ranks agree"]
    return markdown_table(header, rows, "lrrrrrrr")


PART_WORDS = {"forward": "forward", "backward": "backward (and the wait for the sums)",
              "optimizer": "optimizer", "cpu": "rank's CPU",
              "daemon_cpu": "daemon's CPU per node"}


def parts_table(summary: Mapping[str, Any]) -> str:
    """Where a step goes, per configuration (medians, ms): the rank's wall-clock parts, the
    rank process's CPU in them, and each daemon's CPU per step; on 2 shared cores the ranks'
    and the daemons' CPU together bound the step from below. '' where no run measured it."""
    measured = {label: row.get("step_parts_ms") or {}
                for label, row in summary["configs"].items()}
    names = [name for name in PART_WORDS if any(name in parts for parts in measured.values())]
    if not names:
        return ""
    rows = [[label, *("-" if name not in parts else f"{parts[name]:.0f}" for name in names)]
            for label, parts in measured.items() if parts]
    return markdown_table(["configuration", *(f"{PART_WORDS[name]} ms" for name in names)],
                          rows, "l" + "r" * len(names))


def failures(summary: Mapping[str, Any]) -> list[str]:
    """One Markdown line per configuration that failed a repeat, with why."""
    return [f"- {label} failed: {'; '.join(row['errors'])}"
            for label, row in summary["configs"].items() if row["errors"]]


def report(summary: Mapping[str, Any]) -> str:
    """One rate's results: the table, what failed, each under the target."""
    failed = failures(summary)
    parts = parts_table(summary)
    return "\n".join([f"({headline(summary)})", "", table(summary),
                      *(["", "Where a step goes:", "", parts] if parts else []),
                      *(["", *failed] if failed else [])])


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
        "batch_per_rank": args.batch, "steps": args.steps, "max_steps": args.max_steps,
        "eval_steps": eval_steps(args.max_steps, args.eval_every, args.steps),
        "repeats": args.repeats, "order": "forwards, then backwards (ABC CBA ABC …)",
        "threads": args.threads, "seed": args.seed, "rates": args.rates.split(","),
        "configs": [c.name for c in configs],
        "target": "the best baseline's (torch DDP + PowerSGD or + fp16 hook: the lower) "
                  "validation loss after --steps; the baselines train --steps, the others "
                  "--max-steps",
        "powersgd": {"rank": args.powersgd_rank, "start": args.powersgd_start},
        "wall_time": "rank 0's training steps only; evaluation excluded",
    }


def to_json(outcomes: Mapping[Config, Outcome]) -> dict[str, Any]:
    return {config.label: {"config": config.name,
                           "repeats": [{k: r[k] for k in ("curve", "step_ms", "train_loss",
                                                          "ran", "agree")}
                                       for r in outcome.repeats],
                           "errors": outcome.errors}
            for config, outcome in outcomes.items()}


def outcomes_from_json(runs: Mapping[str, Any]) -> dict[Config, Outcome]:
    """The outcomes ``to_json`` wrote, read back (bench/report.py summarises them again, so
    the table is always this file's rule over the data). torch's and the single process's
    configurations are known by their labels: runs written before the fp16 hook named torch
    DDP + PowerSGD's configuration "torch" too."""
    return {(BY_LABEL.get(label) or config_of(run["config"])):
            Outcome(repeats=list(run["repeats"]), errors=list(run["errors"]))
            for label, run in runs.items()}


COLOURS = {"torch DDP": "black", "torch DDP + fp16 hook": "tab:purple",
           "torch DDP + PowerSGD": "tab:orange", "commd dense": "tab:blue",
           "commd dense + fp16 hook": "tab:cyan", "commd dense + PowerSGD hook": "tab:pink",
           "commd powersgd:4:start=10": "tab:red", "commd auto": "tab:green",
           "commd topk:auto": "tab:olive", "commd topk:auto:momentum=0.9": "tab:brown",
           "single process (no DDP)": "grey", "two processes (no DDP)": "silver"}


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
            style = (":" if label.startswith(("single", "two processes")) else
                     "--" if label.startswith("torch DDP") else "-")
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
             f"{MOMENTUM}; baselines (dashed) {s['steps']} steps, the others {s['max_steps']};"
             f"\nmeans of {s['repeats']} repeat(s); thin line: the best baseline's final "
             f"validation loss (the target); the first evaluation (step 0) lies above the axes",
             ha="center", va="bottom", fontsize=8)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110, bbox_inches="tight")  # one panel is narrower than the caption
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
    p.add_argument("--configs", default=None,
                   help=f"comma-separated configurations, run in this order in the first "
                        f"repeat, backwards in the second, … (default "
                        f"{DEFAULT_CONFIGS.format(rank='R', start='S')}, R and S from "
                        f"--powersgd-rank and --powersgd-start)")
    p.add_argument("--repeats", type=int, default=2,
                   help="runs of every configuration, alternating; the table shows the mean "
                        "curve and the median step over them (default 2)")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS,
                   help=f"training steps of the baselines (fp16, powersgd): the best one's "
                        f"final validation loss is the target (default {DEFAULT_STEPS})")
    p.add_argument("--max-steps", type=int, default=None,
                   help="training steps of every other configuration, ≥ --steps: room to "
                        "reach the target (default 1.5 × --steps)")
    p.add_argument("--eval-every", type=int, default=20,
                   help="steps between validation evaluations; also at --steps and the last "
                        "step (default 20)")
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
                   help="PowerSGD's matrix_approximation_rank, torch's hook on either "
                        "wrapper (default 4)")
    p.add_argument("--powersgd-start", type=int, default=10,
                   help="PowerSGD's start_powerSGD_iter, dense before it; ≥ 2 (default 10)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--planner", default=None,
                   help="commd's merge planner (default: the daemon's)")
    p.add_argument("--timeout", type=float, default=1800.0,
                   help="seconds one job may take before it is killed (default 1800: a dense "
                        "job at 100 Mbit/s trains ~6 minutes)")
    p.add_argument("--json", default=DEFAULT_JSON, metavar="PATH",
                   help=f"where every curve, step time and the provenance go (default "
                        f"{DEFAULT_JSON}); '' for none")
    p.add_argument("--plot", default=None, metavar="PATH",
                   help="draw validation loss against wall time, one panel per rate (PNG)")
    p.add_argument("--keep-logs", action="store_true",
                   help="keep the daemons' logs (the directory is printed)")
    return p


def check(p: argparse.ArgumentParser, args: argparse.Namespace) -> list[Config]:
    """The configurations (the default list parsed now); a usage error (exit 2) naming a bad
    option. Sets ``args.max_steps`` when it was not given."""
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    if args.steps < 1:
        p.error("--steps must be at least 1")
    if args.max_steps is None:
        args.max_steps = math.ceil(MAX_STEPS_FACTOR * args.steps)
    if args.max_steps < args.steps:
        p.error(f"--max-steps must be at least --steps ({args.steps})")
    if args.eval_every < 1:
        p.error("--eval-every must be at least 1")
    if args.batch < 1 or args.val_windows < 1 or args.warmup < 1:
        p.error("--batch, --val-windows and --warmup must be at least 1")
    if args.powersgd_rank < 1:
        p.error("--powersgd-rank must be at least 1")
    if args.powersgd_start < 2:
        p.error("--powersgd-start must be ≥ 2 (torch's rule with error feedback)")
    for rate in args.rates.split(","):
        if rate != "loopback":
            try:
                netbed.rate_bits_per_s(rate)
            except ValueError as exc:
                p.error(f"--rates: {exc}")
    if args.configs is None:
        args.configs = DEFAULT_CONFIGS.format(rank=args.powersgd_rank, start=args.powersgd_start)
    try:
        return parse_configs(args.configs)
    except ValueError as exc:
        p.error(str(exc))


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
          f"{text_lm.CONTEXT} per rank, {args.steps} steps for the baselines and "
          f"{args.max_steps} for the others, {args.repeats} repeat(s), {os.cpu_count()} CPUs",
          flush=True)
    for rate in args.rates.split(","):
        with link(rate) as nodes:
            if nodes is None:
                continue
            outcomes = run_rate(rate, nodes, configs, args)
        summary = summarise(outcomes)
        result["rates"][rate] = {"summary": summary, "runs": to_json(outcomes)}
        print(f"\n{rate} {report(summary)}\n", flush=True)
        result["took_s"] = round(time.monotonic() - started)
        save(args.json, result)  # after every rate, so a later failure keeps this one
    if args.json:
        print(f"  every curve and step: {args.json}")
    if args.plot:
        plot(args.plot, result)
    if len(result["rates"]) > 1:  # all tables together at the end
        for rate, data in result["rates"].items():
            print(f"\n{rate} {report(data['summary'])}")
    print(f"\ncommand: {result['provenance']['command']}\ntook "
          f"{time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(rank_or_main(run_rank, main))
