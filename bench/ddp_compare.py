"""Step time of commd's DistributedDataParallel against torch DDP over Gloo, same machine.

Two nodes with one rank each:

- loopback: two daemons on 127.0.0.1 (torch DDP: two ranks on 127.0.0.1);
- limited: two network namespaces whose links are shaped with `tc … tbf rate RATE`
  (bench/netbed.py); node 1's daemon and rank run inside its namespace. Needs root and
  `ip netns`; skipped otherwise.

Every rank trains the same model on its own synthetic data with SGD; the step time (zero_grad,
forward, backward, step) is measured after ``--warmup`` steps, so commd's runtime profiler has
re-planned by then. Prints a table with the ratio commd/torch (below 1: commd is faster).

    python bench/ddp_compare.py                       # both links, default models
    python bench/ddp_compare.py --rate 100mbit --steps 20
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from commd.testing.processes import finish, start_json_worker, stop_process

HERE = Path(__file__).resolve()
_JOBS = itertools.count()
sys.path.insert(0, str(HERE.parent))  # netbed

MODELS = {
    # name: (description, batch size)
    "small_cnn": ("commd.models small_cnn: 10 tensors, 0.59 M parameters", 32),
    "deep_mlp": ("48 x Linear(256, 256): 96 small tensors, 3.2 M parameters", 64),
}


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


def run_rank(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(spec["threads"])
    model = build_model(spec["model"])
    if spec["impl"] == "torch":
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as TorchDDP

        dist.init_process_group(
            "gloo", init_method=f"tcp://{spec['master']}", rank=spec["rank"],
            world_size=spec["world_size"],
        )
        wrapped: Any = TorchDDP(model)
        close: Callable[[], None] = dist.destroy_process_group
    else:
        from commd_client.torch import DistributedDataParallel

        wrapped = DistributedDataParallel(
            model, job=spec["job"], rank=spec["rank"], world_size=spec["world_size"],
            local_rank=0, local_world_size=1, coordinator=spec["coordinator"],
            socket=spec["socket"], planner=spec["planner"], timeout=spec["timeout"],
        )
        close = wrapped.close
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.01)
    x, y = synthetic_batch(spec["model"], spec["rank"], spec["batch"])
    times = []
    phases: list[tuple[float, float, float]] = []  # forward, backward, optimizer step
    for _ in range(spec["warmup"] + spec["steps"]):
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = F.cross_entropy(wrapped(x), y)
        forward = time.perf_counter()
        loss.backward()
        backward = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
        phases.append((forward - start, backward - forward, start + times[-1] - backward))
    checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
    close()
    measured = times[spec["warmup"]:]
    split = [1e3 * statistics.fmean(p[i] for p in phases[spec["warmup"]:]) for i in range(3)]
    return {"mean_ms": 1e3 * statistics.fmean(measured), "phases_ms": split,
            "median_ms": 1e3 * statistics.median(measured), "checksum": checksum}


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


def model_and_batch(entry: str, args: argparse.Namespace) -> tuple[str, int]:
    """``deep_mlp`` or ``deep_mlp@256`` (that batch size per rank)."""
    name, _, batch = entry.partition("@")
    if name not in MODELS:
        raise SystemExit(f"unknown model {name!r}; valid: {', '.join(MODELS)}")
    return name, int(batch) if batch else args.batch_size or MODELS[name][1]


def run_job(impl: str, entry: str, nodes: Sequence[Node], args: argparse.Namespace,
            tag: str) -> dict[str, Any]:
    """One job of len(nodes) ranks; returns rank 0's timings and whether the ranks agree."""
    port = free_port() if nodes[0].host == "127.0.0.1" else 29000 + os.getpid() % 1000
    model, batch = model_and_batch(entry, args)
    job = f"bench-{tag.replace(' ', '-')}-{model}-{impl}-{os.getpid()}-{next(_JOBS)}"
    processes = []
    for rank, node in enumerate(nodes):
        spec = {
            "impl": impl, "model": model, "rank": rank, "world_size": len(nodes),
            "batch": batch, "warmup": args.warmup,
            "steps": args.steps, "threads": args.threads, "planner": args.planner,
            "timeout": args.timeout, "job": job,
            "coordinator": nodes[0].address, "socket": node.socket,
            "master": f"{nodes[0].host}:{port}",
        }
        env = {"GLOO_SOCKET_IFNAME": node.ifname, "OMP_NUM_THREADS": "1"}
        processes.append(start_json_worker(node.wrap([sys.executable, str(HERE), "_rank"]), spec,
                                           env=env))
    results = []
    for rank, done in enumerate(finish(processes, args.timeout)):
        if done.returncode != 0:
            raise RuntimeError(f"{impl} rank {rank} failed (daemon logs in "
                               f"{Path(nodes[rank].socket).parent}):\n{done.stderr[-3000:]}")
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    agree = len({round(r["checksum"], 6) for r in results}) == 1
    return {**results[0], "agree": agree}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


# --- the comparison ---------------------------------------------------------------------------


def compare(link: str, nodes: Sequence[Node], models: Sequence[str],
            args: argparse.Namespace) -> list[list[str]]:
    rows = []
    workdir = tempfile.mkdtemp(prefix="commd-bench-")  # daemon logs stay there on a failure
    with daemons(nodes, workdir):
        for model in models:
            means: dict[str, list[float]] = {"torch": [], "commd": []}
            agree = True
            for repeat in range(args.repeats):  # alternate, so load drifts hit both alike
                for impl in args.impls.split(","):
                    result = run_job(impl, model, nodes, args, link)
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
    if args.keep_logs:
        print(f"  daemon logs: {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return rows


def loopback_nodes(count: int) -> list[Node]:
    return [Node("127.0.0.1", lambda command: command, "lo") for _ in range(count)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=50, help="measured steps (default 50)")
    parser.add_argument("--warmup", type=int, default=100,
                        help="unmeasured first steps (default 100: commd's plan search "
                             "measures a few plans for 10 steps each first)")
    parser.add_argument("--rate", default="1gbit", help="limited link's tbf rate (1gbit)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--loopback-models", default="small_cnn,deep_mlp",
                        help="comma-separated; MODEL@BATCH sets that row's batch size")
    parser.add_argument("--limited-models", default="deep_mlp,deep_mlp@256",
                        help="comma-separated; MODEL@BATCH sets that row's batch size")
    parser.add_argument("--batch-size", type=int, default=0,
                        help="per-rank batch for every model (default: each model's own)")
    parser.add_argument("--skip-loopback", action="store_true")
    parser.add_argument("--skip-limited", action="store_true")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs per implementation, alternating; the table shows medians")
    parser.add_argument("--planner", default=None,
                        help="commd merge planner (default: the daemon's, optimal)")
    parser.add_argument("--impls", default="torch,commd",
                        help="which to run (e.g. commd alone, to look at its daemons' logs "
                             "with --keep-logs)")
    parser.add_argument("--keep-logs", action="store_true",
                        help="keep the daemons' logs (the directory is printed)")
    parser.add_argument("--timeout", type=float, default=120.0, help="per job, seconds")
    args = parser.parse_args()

    print(f"commd DDP vs torch DDP (Gloo), 2 nodes x 1 rank, {args.warmup} warm-up + "
          f"{args.steps} measured steps, {args.threads} torch thread(s) per rank, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    for name, (description, batch) in MODELS.items():
        print(f"  {name}: {description}, batch {args.batch_size or batch} per rank")
    rows = []
    if not args.skip_loopback:
        rows += compare("loopback", loopback_nodes(2), args.loopback_models.split(","), args)
    if not args.skip_limited:
        rows += limited(args)
    header = ["link", "model", "torch ms/step", "commd ms/step", "commd/torch", "ranks agree"]
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f}")
    print(markdown_table(header, rows))
    return 0


def limited(args: argparse.Namespace) -> list[list[str]]:
    from netbed import NetBed, NetBedUnavailable, available

    ok, why = available()
    if not ok:
        print(f"  limited link skipped: {why}")
        return []
    try:
        with NetBed(nodes=2, rate=args.rate) as bed:
            nodes = [
                Node(bed.address(i), functools.partial(bed.argv, i), "eth0")
                for i in range(2)
            ]
            return compare(f"tbf {args.rate}", nodes, args.limited_models.split(","), args)
    except NetBedUnavailable as exc:
        print(f"  limited link skipped: {exc}")
        return []


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(c)) for c in column) for column in zip(header, *rows, strict=True)]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"
              for row in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_rank":
        print(json.dumps(run_rank(json.loads(sys.argv[2]))), flush=True)
    elif len(sys.argv) > 1 and sys.argv[1] == "_daemon":
        serve_daemon(*sys.argv[2:5])
    else:
        sys.exit(main())
