"""Step time of commd's DistributedDataParallel against torch DDP over Gloo, same machine.

Two nodes with one rank each:

- loopback: two daemons on 127.0.0.1 (torch DDP: two ranks on 127.0.0.1);
- limited: two network namespaces whose links are shaped with `tc … tbf rate RATE`
  (commd/testing/netbed.py); node 1's daemon and rank run inside its namespace. Needs root and
  `ip netns`; skipped otherwise. One bed per rate of ``--rates``.

Without ``--compression``, every rank trains the listed models on one fixed synthetic batch of
its own with SGD; the step time (zero_grad, forward, backward, step) is measured after
``--warmup`` steps, so commd's runtime profiler has re-planned by then. Prints a table with the
ratio commd/torch (below 1: commd is faster).

With ``--compression none,topk:0.01,topk:auto`` it compares gradient compressions on a task
that can be learnt (bench/ddp_tasks.py: deep_mlp on a fixed random teacher, a fresh batch per
rank and step, the same seeds for every variant): commd DDP once per value, torch DDP dense and
torch DDP with its PowerSGD comm hook. Per link a table of step time (against torch DDP dense)
and final loss (against commd dense); ``--plot`` draws the loss curves.

    python bench/ddp_compare.py                       # both links, default models
    python bench/ddp_compare.py --rates 100mbit --steps 20
    python bench/ddp_compare.py --compression none,topk:0.01,topk:auto --plot loss.png
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ddp_tasks  # a sibling file: bench/ is sys.path[0] of a script run from it

from commd.cli.tables import markdown_table
from commd.compression.spec import CompressionSpec, parse_compression
from commd.testing.harness import rank_or_main
from commd.testing.ports import free_port
from commd.testing.processes import FinishTimeout, finish, start_json_worker, stop_process
from commd.testing.results import add_results_option, write_results

HERE = Path(__file__).resolve()
_JOBS = itertools.count()

MODELS = {
    # name: (description, batch size)
    "small_cnn": ("commd.models small_cnn: 10 tensors, 0.59 M parameters", 32),
    "deep_mlp": ("48 x Linear(256, 256): 96 small tensors, 3.2 M parameters", 64),
}
LOSS_TAIL = 10  # the final loss: the mean of the last this many steps
LOSS_MARGIN = 0.05  # the target: a final loss at most 5 % above dense's
SMOOTH = 9  # steps in the plot's centred moving average


@dataclass(frozen=True)
class Variant:
    """One way of averaging gradients: ``impl`` torch or commd, with a compression."""

    impl: str
    compression: str = "none"  # commd's compression=, or "powersgd" (torch's comm hook)

    @property
    def label(self) -> str:
        if self.impl == "torch":
            return "torch DDP PowerSGD" if self.compression == "powersgd" else "torch DDP"
        return f"commd {self.compression}"


# --- the model and one rank's training loop (runs in the rank's process) --------------------------


def build_model(name: str) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    if name == "small_cnn":
        from commd.models import small_cnn

        return small_cnn()
    if name == "deep_mlp":
        layers: list[nn.Module] = [nn.Linear(256, 256)]
        for _ in range(47):
            layers += [nn.ReLU(), nn.Linear(256, 256)]
        return nn.Sequential(*layers)
    raise ValueError(f"unknown model {name!r}; valid: {', '.join(MODELS)}")


def synthetic_batch(name: str, rank: int, batch: int) -> tuple[Any, Any]:
    import torch

    gen = torch.Generator().manual_seed(rank)
    shape = (3, 32, 32) if name == "small_cnn" else (256,)
    classes = 10 if name == "small_cnn" else 256
    return torch.randn(batch, *shape, generator=gen), torch.randint(0, classes, (batch,),
                                                                     generator=gen)


def wrap(model: Any, spec: dict[str, Any]) -> tuple[Any, Callable[[], None]]:
    """The model in torch's or commd's DDP, and how to close it."""
    if spec["impl"] == "torch":
        return wrap_torch(model, spec)
    from commd_client.torch import DistributedDataParallel

    wrapped = DistributedDataParallel(
        model, job=spec["job"], rank=spec["rank"], world_size=spec["world_size"],
        local_rank=0, local_world_size=1, coordinator=spec["coordinator"],
        socket=spec["socket"], planner=spec["planner"], timeout=spec["timeout"],
        compression=spec["compression"],
    )
    return wrapped, wrapped.close


def wrap_torch(model: Any, spec: dict[str, Any]) -> tuple[Any, Callable[[], None]]:
    """torch DDP over Gloo, dense or with torch's PowerSGD comm hook."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    dist.init_process_group(
        "gloo", init_method=f"tcp://{spec['master']}", rank=spec["rank"],
        world_size=spec["world_size"],
    )
    if spec["compression"] != "powersgd":
        return TorchDDP(model), dist.destroy_process_group
    # One bucket: the hook issues its P and Q all-reduces from Gloo's callback thread, so with
    # two buckets they race the next bucket's all-reduce and the ranks' collectives mismatch
    # ("op.preamble.length <= op.nbytes"); torch's default buckets make two of deep_mlp.
    size_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    wrapped = TorchDDP(model, bucket_cap_mb=int(size_mb) + 1)
    # Error feedback and warm start are on by default; with them torch needs start ≥ 2.
    state = psgd.PowerSGDState(
        process_group=None, matrix_approximation_rank=spec["powersgd_rank"],
        start_powerSGD_iter=spec["powersgd_start"],
    )
    wrapped.register_comm_hook(state, psgd.powerSGD_hook)
    return wrapped, dist.destroy_process_group


def batches(spec: dict[str, Any]) -> Iterator[tuple[Any, Any]]:
    """The teacher task draws a fresh batch every step; the timing task reuses one."""
    if spec["task"] == "teacher":
        stream = ddp_tasks.TeacherStream(spec["rank"], spec["batch"], spec["seed"])
        while True:
            yield stream.next()
    yield from itertools.repeat(synthetic_batch(spec["model"], spec["rank"], spec["batch"]))


def run_rank(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(spec["threads"])
    teacher = spec["task"] == "teacher"
    model = ddp_tasks.deep_mlp() if teacher else build_model(spec["model"])
    wrapped, close = wrap(model, spec)
    if teacher:  # with momentum correction the daemon keeps the momentum, not the optimizer
        compression = parse_compression(spec["compression"]) if spec["impl"] == "commd" else None
        corrected = isinstance(compression, CompressionSpec) and compression.momentum > 0
        optimizer = ddp_tasks.optimizer(wrapped.parameters(), spec["lr"],
                                        0.0 if corrected else ddp_tasks.MOMENTUM)
    else:
        optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.01)
    loss_of = ddp_tasks.loss if teacher else F.cross_entropy
    times, losses = [], []
    phases: list[tuple[float, float, float]] = []  # forward, backward, optimizer step
    data = batches(spec)
    for _ in range(spec["warmup"] + spec["steps"]):
        x, y = next(data)  # outside the timed step, as a data loader's prefetch would be
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = loss_of(wrapped(x), y)
        forward = time.perf_counter()
        loss.backward()
        backward = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
        phases.append((forward - start, backward - forward, start + times[-1] - backward))
        losses.append(float(loss.detach()))
    checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
    ran = final_exchange(spec) if spec["impl"] == "commd" and spec["rank"] == 0 else ""
    held_out = float("nan")
    if teacher:
        inputs, labels = ddp_tasks.held_out()
        with torch.no_grad():
            held_out = float(ddp_tasks.loss(model(inputs), labels))
    close()
    measured = times[spec["warmup"]:]
    split = [1e3 * statistics.fmean(p[i] for p in phases[spec["warmup"]:]) for i in range(3)]
    return {"mean_ms": 1e3 * statistics.fmean(measured), "phases_ms": split,
            "median_ms": 1e3 * statistics.median(measured), "checksum": checksum,
            "losses": losses, "held_out": held_out, "ran": ran,
            "step_ms": [round(1e3 * t, 2) for t in times]}


def final_exchange(spec: dict[str, Any]) -> str:
    """What the job's groups ran at the end, from the daemon's status: ``dense`` (also for a
    job without compression), ``EXCHANGE@RATIO`` (the most groups' top-k exchange) or
    ``lowrank`` (PowerSGD); "" when the daemon gives no status."""
    from commd.cli.status import NoDaemon, query

    try:
        status = query(spec["socket"], timeout_s=5.0)
    except NoDaemon:
        return ""
    for job in status.get("jobs", []):
        if job["job"].startswith(spec["job"]) and job.get("compression"):
            kinds = job.get("exchanges") or ["dense"]
            kind = max(set(kinds), key=kinds.count)
            ratio = job.get("ratio") or 0
            return kind if kind == "dense" or not ratio else f"{kind}@{ratio:.3g}"
    return ""


# --- daemons and ranks as processes, on loopback or inside namespaces -----------------------------


def serve_daemon(workdir: str, name: str, host: str) -> None:
    """Child process: run a LocalDaemon, print its address, stop it when stdin closes."""
    from commd.testing.daemons import LocalDaemon

    daemon = LocalDaemon(workdir, name, listen_host=host)
    try:
        print(f"READY {daemon.address} {daemon.socket}", flush=True)
        sys.stdin.read()
    finally:
        daemon.stop()


@dataclass
class Node:
    host: str  # the address peers reach this node at
    wrap: Callable[[list[str]], list[str]]  # runs a command on this node
    ifname: str  # the interface Gloo uses (torch DDP)
    daemon: subprocess.Popen[str] | None = None
    address: str = ""
    socket: str = ""


@contextlib.contextmanager
def daemons(nodes: Sequence[Node], workdir: str) -> Iterator[None]:
    try:
        for index, node in enumerate(nodes):
            node.daemon = subprocess.Popen(
                node.wrap([sys.executable, str(HERE), "_daemon", workdir, f"node{index}",
                           node.host]),
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            )
            assert node.daemon.stdout is not None
            line = node.daemon.stdout.readline().split()
            if not line or line[0] != "READY":
                raise RuntimeError(f"daemon of node {index} did not start; see {workdir}")
            node.address, node.socket = line[1], line[2]
        yield
    finally:
        for node in nodes:
            if node.daemon is not None:  # EOF: it stops its daemon and exits
                stop_process(node.daemon, grace_s=30, close_stdin=True)
                node.daemon = None


def model_and_batch(entry: str, args: argparse.Namespace) -> tuple[str, int]:
    """``deep_mlp`` or ``deep_mlp@256`` (that batch size per rank)."""
    name, _, batch = entry.partition("@")
    if name not in MODELS:
        raise SystemExit(f"unknown model {name!r}; valid: {', '.join(MODELS)}")
    return name, int(batch) if batch else args.batch_size or MODELS[name][1]


def run_job(variant: Variant, entry: str, nodes: Sequence[Node], args: argparse.Namespace,
            tag: str, seed: int = 0) -> dict[str, Any]:
    """One job of len(nodes) ranks; returns rank 0's timings, the ranks' mean loss per step
    and whether the ranks agree. ``seed``: the teacher task's data stream."""
    port = free_port() if nodes[0].host == "127.0.0.1" else 29000 + os.getpid() % 1000
    model, batch = model_and_batch(entry, args)
    name = f"{variant.impl}-{re.sub('[^a-z0-9.]', '', variant.compression)}"
    job = f"bench-{tag.replace(' ', '-')}-{model}-{name}-{os.getpid()}-{next(_JOBS)}"
    processes = []
    for rank, node in enumerate(nodes):
        spec = {
            "impl": variant.impl, "compression": variant.compression, "task": args.task,
            "model": model, "rank": rank, "world_size": len(nodes), "batch": batch,
            "warmup": args.warmup, "steps": args.steps, "threads": args.threads,
            "planner": args.planner, "timeout": args.timeout, "job": job, "lr": args.lr,
            "seed": seed,
            "powersgd_rank": args.powersgd_rank, "powersgd_start": args.powersgd_start,
            "coordinator": nodes[0].address, "socket": node.socket,
            "master": f"{nodes[0].host}:{port}",
        }
        env = {"GLOO_SOCKET_IFNAME": node.ifname, "OMP_NUM_THREADS": "1"}
        processes.append(start_json_worker(node.wrap([sys.executable, str(HERE), "_rank"]), spec,
                                           env=env))
    results = rank_results(processes, nodes, args.timeout, variant.label)
    agree = len({round(r["checksum"], 6) for r in results}) == 1
    losses = [statistics.fmean(step) for step in zip(*(r["losses"] for r in results),
                                                     strict=True)]
    return {**results[0], "losses": losses, "agree": agree}


def rank_results(processes: Sequence[subprocess.Popen[str]], nodes: Sequence[Node],
                 timeout: float, label: str) -> list[dict[str, Any]]:
    """Each rank's JSON result (its last line of output), in rank order; a rank that failed
    raises with its stderr's tail and where its daemon's log is."""
    results = []
    for rank, done in enumerate(finish(processes, timeout)):
        if done.returncode != 0:
            raise RuntimeError(f"{label} rank {rank} failed (daemon logs in "
                               f"{Path(nodes[rank].socket).parent}):\n{done.stderr[-3000:]}")
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return results


@dataclass
class Workdir:
    """The daemons' logs: kept with --keep-logs, on an error or when ``keep`` is set."""

    path: str
    keep: bool = False


@contextlib.contextmanager
def job_workdir(args: argparse.Namespace) -> Iterator[Workdir]:
    workdir = Workdir(tempfile.mkdtemp(prefix="commd-bench-"), args.keep_logs)
    yield workdir
    if workdir.keep:
        print(f"  daemon logs: {workdir.path}")
    else:
        shutil.rmtree(workdir.path, ignore_errors=True)


# --- the comparison without compression: step time per model --------------------------------------


def compare(link: str, nodes: Sequence[Node], models: Sequence[str],
            args: argparse.Namespace) -> list[list[str]]:
    rows = []
    impls = args.impls.split(",")
    with job_workdir(args) as workdir, daemons(nodes if "commd" in impls else [], workdir.path):
        for model in models:
            means: dict[str, list[float]] = {"torch": [], "commd": []}
            agree = True
            for repeat in range(args.repeats):  # alternate, so load drifts hit both alike
                for impl in impls:
                    result = run_job(Variant(impl), model, nodes, args, link)
                    means[impl].append(result["mean_ms"])
                    agree = agree and result["agree"]
                    print(f"  {link} {model} #{repeat + 1} {impl}: {result['mean_ms']:.1f} ms "
                          f"per step (median {result['median_ms']:.1f}; forward/backward/step "
                          f"{'/'.join(f'{t:.1f}' for t in result['phases_ms'])})", flush=True)
            if not all(means.values()):
                continue  # one implementation only (--impls): no ratio
            torch_ms, commd_ms = (statistics.median(means[i]) for i in ("torch", "commd"))
            name, batch = model_and_batch(model, args)
            rows.append([link, f"{name}, batch {batch}", f"{torch_ms:.1f}", f"{commd_ms:.1f}",
                         f"{commd_ms / torch_ms:.2f}", "yes" if agree else "NO"])
    return rows


TIMING_HEADER = ["link", "model", "torch ms/step", "commd ms/step", "commd/torch", "ranks agree"]


def timing_rows(args: argparse.Namespace) -> list[list[str]]:
    rows = []
    if not args.skip_loopback:
        rows += compare("loopback", loopback_nodes(2), args.loopback_models.split(","), args)
    for rate in [] if args.skip_limited else args.rates.split(","):
        with limited_link(rate) as nodes:
            if nodes is not None:
                rows += compare(f"tbf {rate}", nodes, args.limited_models.split(","), args)
    return rows


def timing_table(results: dict[str, Any]) -> str:
    """The step-time table of a run without --compression (its results file's ``rows``)."""
    return markdown_table(TIMING_HEADER, results["rows"])


# --- the comparison with compression: step time and loss per variant ------------------------------


@dataclass
class Outcome:
    """What the repeats of one variant on one link gave."""

    means_ms: list[float] = field(default_factory=list)
    curves: list[list[float]] = field(default_factory=list)  # loss per step, per repeat
    step_ms: list[list[float]] = field(default_factory=list)  # rank 0's steps, per repeat
    held_out: list[float] = field(default_factory=list)  # the final model's, per repeat
    ran: list[str] = field(default_factory=list)  # commd's exchange at the end, per repeat
    agree: bool = True
    errors: list[str] = field(default_factory=list)

    def mean_curve(self) -> list[float]:
        return [statistics.fmean(step) for step in zip(*self.curves, strict=True)]

    def final_loss(self) -> float:
        return statistics.fmean(self.mean_curve()[-LOSS_TAIL:])

    def held_out_loss(self) -> float:
        return statistics.fmean(self.held_out)

    def stream_losses(self) -> list[float]:
        """Each repeat's (data stream's) final loss."""
        return [statistics.fmean(curve[-LOSS_TAIL:]) for curve in self.curves]


def streams_within(outcome: Outcome, dense: Outcome, margin: float = LOSS_MARGIN) -> str:
    """"k of n": the streams whose final loss is at most ``margin`` above dense's on the same
    stream (the repeats of both ran the same data streams, in order); "-" if they differ."""
    mine, base = outcome.stream_losses(), dense.stream_losses()
    if not mine or len(mine) != len(base):
        return "-"
    within = sum(loss <= (1 + margin) * reference for loss, reference in zip(mine, base,
                                                                            strict=True))
    return f"{within} of {len(mine)}"


def variants_of(args: argparse.Namespace) -> list[Variant]:
    impls = args.impls.split(",")
    chosen = [Variant("torch")] if "torch" in impls else []
    chosen += [Variant("torch", "powersgd")] if "powersgd" in impls else []
    if "commd" in impls:
        chosen += [Variant("commd", value) for value in args.compression.split(",")]
    return chosen


def run_variants(link: str, nodes: Sequence[Node], args: argparse.Namespace
                 ) -> dict[Variant, Outcome]:
    """Every variant ``--repeats`` times, alternating; a failed job is reported, not fatal
    (the daemon may be mid-change), and the others go on."""
    variants = variants_of(args)
    outcomes = {variant: Outcome() for variant in variants}
    commd = any(variant.impl == "commd" for variant in variants)
    entry = f"deep_mlp@{args.batch_size or MODELS['deep_mlp'][1]}"
    with job_workdir(args) as workdir, daemons(nodes if commd else [], workdir.path):
        for repeat, variant in itertools.product(range(args.repeats), variants):
            outcome = outcomes[variant]
            started = time.monotonic()
            try:
                result = run_job(variant, entry, nodes, args, link, seed=repeat)
            except (RuntimeError, FinishTimeout) as exc:
                outcome.errors.append(str(exc))
                workdir.keep = True  # the error names the daemons' logs
                print(f"  {link} #{repeat + 1} {variant.label}: FAILED\n{exc}", flush=True)
                continue
            outcome.means_ms.append(result["mean_ms"])
            outcome.curves.append(result["losses"])
            outcome.step_ms.append(result["step_ms"])
            outcome.held_out.append(result["held_out"])
            outcome.ran.append(result["ran"])
            outcome.agree = outcome.agree and result["agree"]
            print(f"  {link} #{repeat + 1} {variant.label}: {result['mean_ms']:.1f} ms per step "
                  f"(median {result['median_ms']:.1f}), final loss "
                  f"{statistics.fmean(result['losses'][-LOSS_TAIL:]):.3f}, held-out "
                  f"{result['held_out']:.3f}, ran {result['ran'] or '-'}, ranks agree "
                  f"{result['agree']}, {time.monotonic() - started:.0f} s", flush=True)
    return outcomes


def variant_table(outcomes: dict[Variant, Outcome]) -> str:
    """``variant_rows`` in Markdown."""
    return markdown_table(*variant_rows(outcomes))


def variant_rows(outcomes: dict[Variant, Outcome]) -> tuple[list[str], list[list[str]]]:
    """The header and a row of cells per variant: variant, ms/step, against torch DDP and
    against PowerSGD, final loss, against commd dense, the streams within LOSS_MARGIN of
    dense's, held-out loss, ranks agree."""
    def median_ms(variant: Variant) -> float | None:
        outcome = outcomes.get(variant)
        return statistics.median(outcome.means_ms) if outcome and outcome.means_ms else None

    torch_ms, powersgd_ms = median_ms(Variant("torch")), median_ms(Variant("torch", "powersgd"))
    commd_dense = outcomes.get(Variant("commd", "none"))
    dense = commd_dense if commd_dense and commd_dense.curves else None
    rows = []
    for variant, outcome in outcomes.items():
        if not outcome.means_ms:
            rows.append([variant.label, "failed", *["-"] * 9])
            continue
        ms, loss, held = (statistics.median(outcome.means_ms), outcome.final_loss(),
                          outcome.held_out_loss())
        spread = (f" ({min(outcome.means_ms):.0f}–{max(outcome.means_ms):.0f})"
                  if len(outcome.means_ms) > 1 else "")
        rows.append([
            variant.label, f"{ms:.1f}{spread}", f"{ms / torch_ms:.2f}" if torch_ms else "-",
            f"{ms / powersgd_ms:.2f}" if powersgd_ms else "-",
            f"{loss:.3f}", f"{loss / dense.final_loss():.3f}" if dense else "-",
            streams_within(outcome, dense) if dense else "-",
            f"{held:.3f}", f"{held / dense.held_out_loss():.3f}" if dense else "-",
            ", ".join(sorted(set(outcome.ran) - {""})) or "-", "yes" if outcome.agree else "NO",
        ])
    header = ["variant", "ms/step", "× torch DDP", "× PowerSGD", f"final loss (last {LOSS_TAIL})",
              "× commd none", f"streams ≤ +{LOSS_MARGIN:.0%}", "held-out loss", "× commd none",
              "ran at the end", "ranks agree"]
    return header, rows


def compression_tables(args: argparse.Namespace) -> dict[str, dict[Variant, Outcome]]:
    """Every link's outcomes; prints each link's table as soon as it is done."""
    links: dict[str, dict[Variant, Outcome]] = {}

    def measure(link: str, nodes: Sequence[Node]) -> None:
        links[link] = run_variants(link, nodes, args)
        print(f"\n{link}:\n{variant_table(links[link])}\n", flush=True)

    if not args.skip_loopback:
        measure("loopback", loopback_nodes(2))
    for rate in [] if args.skip_limited else args.rates.split(","):
        with limited_link(rate) as nodes:
            if nodes is not None:
                measure(f"tbf {rate}", nodes)
    return links


def smooth(values: Sequence[float], window: int = SMOOTH) -> list[float]:
    """Centred moving average; shorter windows at the ends."""
    half = window // 2
    return [statistics.fmean(values[max(0, i - half):i + half + 1]) for i in range(len(values))]


def plot(path: str, links: dict[str, dict[Variant, Outcome]], args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = {link: outcomes for link, outcomes in links.items()
             if any(o.curves for o in outcomes.values())}
    if not shown:
        print(f"  no loss curves to plot: {path} not written")
        return
    fig, axes = plt.subplots(1, len(shown), figsize=(5.2 * len(shown), 4.4), sharey=True,
                             squeeze=False)
    for ax, (link, outcomes) in zip(axes[0], shown.items(), strict=True):
        for variant, outcome in outcomes.items():
            if outcome.curves:
                torch = variant.impl == "torch"  # dashed, on top: torch DDP ≡ commd none
                ax.plot(smooth(outcome.mean_curve()), "--" if torch else "-",
                        label=variant.label, linewidth=1.2, zorder=3 if torch else 2)
        ax.axvline(args.warmup, color="grey", linestyle=":", linewidth=1)
        ax.set_title(link)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("training loss (cross-entropy)")
    axes[0][0].legend(fontsize=8)
    fig.text(0.5, 0.01, f"deep_mlp on a random teacher, 2 nodes × 1 rank, batch "
             f"{args.batch_size or MODELS['deep_mlp'][1]} per rank; each step's loss on fresh "
             f"data, mean of the 2 ranks and of {args.repeats} data stream(s),\nsmoothed by a "
             f"centred {SMOOTH}-step moving average; dotted: end of the warm-up", ha="center",
             fontsize=8)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110, bbox_inches="tight")  # the caption is wider than one panel
    plt.close(fig)
    print(f"  loss curves: {path}")


def links_json(links: dict[str, dict[Variant, Outcome]]) -> dict[str, Any]:
    return {link: {variant.label: {"means_ms": o.means_ms, "losses": o.curves,
                                   "held_out": o.held_out, "step_ms": o.step_ms, "ran": o.ran,
                                   "agree": o.agree, "errors": o.errors}
                   for variant, o in outcomes.items()}
            for link, outcomes in links.items()}


def links_from_json(data: dict[str, Any]) -> dict[str, dict[Variant, Outcome]]:
    """The outcomes ``links_json`` wrote, read back (for bench/report.py)."""
    def variant(label: str) -> Variant:
        if label.startswith("torch DDP"):
            return Variant("torch", "powersgd" if label.endswith("PowerSGD") else "none")
        return Variant("commd", label.removeprefix("commd "))

    return {link: {variant(label): Outcome(
                means_ms=o["means_ms"], curves=o["losses"], step_ms=o["step_ms"],
                held_out=o["held_out"], ran=o["ran"], agree=o["agree"], errors=o["errors"])
                   for label, o in outcomes.items()}
            for link, outcomes in data.items()}


def save_json(path: str, links: dict[str, dict[Variant, Outcome]], command: str) -> None:
    data = {"command": command, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "links": links_json(links)}
    Path(path).write_text(json.dumps(data, indent=1))
    print(f"  every step's loss and time, every repeat: {path}")


# --- links ----------------------------------------------------------------------------------------


def loopback_nodes(count: int) -> list[Node]:
    return [Node("127.0.0.1", lambda command: command, "lo") for _ in range(count)]


@contextlib.contextmanager
def limited_link(rate: str) -> Iterator[list[Node] | None]:
    """Two nodes in network namespaces, links shaped to ``rate``; None (and why, printed) when
    namespaces cannot be used here."""
    from commd.testing.netbed import NetBed, NetBedUnavailable, available

    ok, why = available()
    if not ok:
        print(f"  limited link skipped: {why}")
        yield None
        return
    with contextlib.ExitStack() as stack:
        try:
            bed = stack.enter_context(NetBed(nodes=2, rate=rate))
        except NetBedUnavailable as exc:
            print(f"  limited link skipped: {exc}")
            bed = None
        yield None if bed is None else [
            Node(bed.address(i), functools.partial(bed.argv, i), "eth0") for i in range(2)
        ]


# --- command line ---------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] + " With --compression: gradient compressions, "
        "step time and training loss.", formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--compression", default=None, metavar="LIST",
                   help="comma-separated commd compressions, e.g. none,topk:0.01,topk:auto "
                        "(values as for DistributedDataParallel(compression=...)); each runs "
                        "as a commd variant, besides torch DDP dense and PowerSGD, on the "
                        "teacher task (bench/ddp_tasks.py). Without it: the step-time "
                        "comparison of the models below, as before")
    p.add_argument("--impls", default=None,
                   help="which variants run: torch (DDP dense), powersgd (torch DDP with its "
                        "PowerSGD hook; needs --compression), commd (once per --compression "
                        "value, else dense). Default torch,commd; with --compression "
                        "torch,powersgd,commd")
    p.add_argument("--steps", type=int, default=50,
                   help="measured steps, after the warm-up (default 50)")
    p.add_argument("--warmup", type=int, default=100,
                   help="unmeasured first steps (default 100: commd's plan search, and "
                        "topk:auto's exploration and trials, take the first 50-80 steps); the "
                        "loss is recorded from step 0")
    p.add_argument("--rates", "--rate", dest="rates", default=None,
                   help="comma-separated tbf rates of the limited links, one test bed each "
                        "(default 1gbit; with --compression 1gbit,100mbit)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--loopback-models", default="small_cnn,deep_mlp",
                   help="without --compression: comma-separated; MODEL@BATCH sets that row's "
                        "batch size")
    p.add_argument("--limited-models", default="deep_mlp,deep_mlp@256",
                   help="without --compression: comma-separated; MODEL@BATCH sets that row's "
                        "batch size")
    p.add_argument("--batch-size", type=int, default=0,
                   help="per-rank batch for every model (default: each model's own; "
                        "deep_mlp's is 64)")
    p.add_argument("--skip-loopback", action="store_true", help="no loopback link")
    p.add_argument("--skip-limited", action="store_true", help="no tbf-limited links")
    p.add_argument("--repeats", type=int, default=None,
                   help="runs per variant, alternating; tables show medians (default 3; with "
                        "--compression 1, and repeat i trains on data stream i: the losses "
                        "are means over the repeats)")
    p.add_argument("--planner", default=None,
                   help="commd merge planner (default: the daemon's, optimal)")
    p.add_argument("--keep-logs", action="store_true",
                   help="keep the daemons' logs (the directory is printed)")
    p.add_argument("--timeout", type=float, default=None,
                   help="per job, seconds (default 120; with --compression 600)")
    compression_options(p)
    return p


def compression_options(p: argparse.ArgumentParser) -> None:
    """The options that only --compression uses."""
    p.add_argument("--lr", type=float, default=ddp_tasks.DEFAULT_LR,
                   help="with --compression: SGD learning rate (momentum "
                        f"{ddp_tasks.MOMENTUM}; default {ddp_tasks.DEFAULT_LR})")
    p.add_argument("--powersgd-rank", type=int, default=4,
                   help="PowerSGD's matrix_approximation_rank (default 4)")
    p.add_argument("--powersgd-start", type=int, default=10,
                   help="PowerSGD's start_powerSGD_iter: dense all-reduce before it (default "
                        "10; torch needs ≥ 2 with its default error feedback and warm start)")
    p.add_argument("--plot", default=None, metavar="PATH",
                   help="with --compression: write the loss curves, one subplot per link, "
                        "as a PNG")
    add_results_option(p, "ddp-compare", "ddp-compare-compression")
    p.add_argument("--json", default=None, metavar="PATH",
                   help="with --compression: write every step's loss and rank 0's time "
                        "of every step, per repeat, as JSON")


def resolve(args: argparse.Namespace) -> None:
    """The defaults that depend on --compression, and checks."""
    compressing = args.compression is not None
    args.task = "teacher" if compressing else "fixed"
    # One repeat with compression: the 100mbit dense jobs alone take ~3 minutes each.
    defaults = ({"impls": "torch,powersgd,commd", "rates": "1gbit,100mbit", "repeats": 1,
                 "timeout": 600.0} if compressing else
                {"impls": "torch,commd", "rates": "1gbit", "repeats": 3, "timeout": 120.0})
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    valid = {"torch", "powersgd", "commd"} if compressing else {"torch", "commd"}
    unknown = set(args.impls.split(",")) - valid
    if unknown:
        raise SystemExit(f"--impls: unknown {', '.join(sorted(unknown))}; valid here: "
                         f"{', '.join(sorted(valid))}")
    if compressing and args.powersgd_start < 2:
        raise SystemExit("--powersgd-start must be ≥ 2 (torch's rule with error feedback)")


def header_lines(args: argparse.Namespace) -> Iterable[str]:
    what = ("compressions" if args.compression is not None else "commd DDP vs torch DDP (Gloo)")
    yield (f"{what}, 2 nodes x 1 rank, {args.warmup} warm-up + {args.steps} measured steps, "
           f"{args.threads} torch thread(s) per rank, {os.cpu_count()} CPUs, load average "
           f"{os.getloadavg()[0]:.1f}")
    if args.compression is not None:
        yield (f"  task: deep_mlp on a random teacher (bench/ddp_tasks.py), batch "
               f"{args.batch_size or MODELS['deep_mlp'][1]} per rank, SGD lr {args.lr} "
               f"momentum {ddp_tasks.MOMENTUM}; PowerSGD rank {args.powersgd_rank} from step "
               f"{args.powersgd_start}")
        return
    for name, (description, batch) in MODELS.items():
        yield f"  {name}: {description}, batch {args.batch_size or batch} per rank"


def main() -> int:
    args = parser().parse_args()
    resolve(args)
    command = shlex.join(["python", *sys.argv])
    started = time.monotonic()
    for line in header_lines(args):
        print(line, flush=True)
    if args.compression is None:
        results: dict[str, Any] = {"rows": timing_rows(args)}
        write_results("ddp-compare", results, args.results)
        print(f"\nload average at the end: {os.getloadavg()[0]:.1f}")
        print(timing_table(results))
    else:
        links = compression_tables(args)
        write_results("ddp-compare-compression",
                      {"compression": args.compression, "links": links_json(links)}, args.results)
        print(f"load average at the end: {os.getloadavg()[0]:.1f}")
        for link, outcomes in links.items():
            print(f"\n{link}:\n{variant_table(outcomes)}")
        if args.plot:
            plot(args.plot, links, args)
        if args.json:
            save_json(args.json, links, command)
    print(f"\ncommand: {command}\ntook {time.monotonic() - started:.0f} s "
          f"({time.strftime('%Y-%m-%d %H:%M')})")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["_daemon"]:
        serve_daemon(*sys.argv[2:5])
    else:
        sys.exit(rank_or_main(run_rank, main))
