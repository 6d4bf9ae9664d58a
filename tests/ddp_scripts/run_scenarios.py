"""Run the porting scenarios on every rank, one after another, in one process per rank.

The scenario scripts (tutorial.py, dcgan.py, uneven_inputs.py, multinode_trainer.py,
nanogpt.py) each pick their DDP class with one line: commd's when DDP_IMPL=commd, else
torch's. This runner starts the ranks in one of two ways, as real scripts do:

- ``--launch spawn``: the tutorial's ``torch.multiprocessing.spawn``; each process sets
  MASTER_ADDR and MASTER_PORT itself and calls ``init_process_group("gloo", rank=...,
  world_size=...)``. No RANK, WORLD_SIZE or LOCAL_RANK in the environment.
- ``--launch env``: torchrun's; the caller starts one process per rank with RANK,
  WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT set, and the script
  calls ``init_process_group("gloo")``.

Each rank writes ``OUT/rank<N>.pt`` (torch.save of a dict) after every scenario, so a rank
killed while stuck still leaves the scenarios it finished. A scenario that raises is
recorded as ``{"error": ..., "traceback": ...}`` and the next one runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

import dcgan
import multinode_trainer
import nanogpt
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import tutorial
import uneven_inputs

Scenario = Callable[[int, int, str, int], dict[str, Any]]


def checkpoint(rank: int, world_size: int, workdir: str, seed: int) -> dict[str, Any]:
    """The tutorial's demo_checkpoint, then the multinode Trainer's snapshot and resume."""
    demo = tutorial.demo_checkpoint(rank, world_size, workdir, seed)
    trainer = multinode_trainer.run(rank, world_size, workdir, seed)
    return {
        "ddp_class": demo["ddp_class"],
        "ddp_classes": [demo["ddp_class"], trainer["ddp_class"]],
        "params": {**{f"tutorial.{k}": v for k, v in demo["params"].items()},
                   **{f"trainer.{k}": v for k, v in trainer["params"].items()}},
        "buffers": [*(f"tutorial.{k}" for k in demo["buffers"]),
                    *(f"trainer.{k}" for k in trainer["buffers"])],
        "values": {f"tutorial.{k}": v for k, v in demo["values"].items()},
        "info": {"tutorial": demo["info"], "trainer": trainer["info"]},
    }


# In this order; a scenario's data seed is 1000 * (its position, from 1) + rank.
SCENARIOS: dict[str, Scenario] = {
    "basic": tutorial.demo_basic,
    "gan": dcgan.train,
    "keywords": tutorial.demo_keywords,
    "join": uneven_inputs.train,
    "checkpoint": checkpoint,
    "accumulation": nanogpt.train,
    "allreduce_beside": tutorial.demo_allreduce_beside,
    "rewrap": tutorial.demo_rewrap,
}


def run_all(rank: int, world_size: int, launch: str, out: str, names: list[str]) -> None:
    path = os.path.join(out, f"rank{rank}.pt")
    record: dict[str, Any] = {"rank": rank, "world_size": world_size, "launch": launch,
                              "impl": os.environ.get("DDP_IMPL", "torch"), "scenarios": {},
                              "finished": False}
    for index, (name, scenario) in enumerate(SCENARIOS.items(), start=1):
        if name not in names:
            continue
        print(f"rank {rank}: {name} starts", flush=True)
        try:
            outcome = scenario(rank, world_size, out, 1000 * index + rank)
        except Exception as exc:
            outcome = {"error": f"{type(exc).__name__}: {exc}",
                       "traceback": traceback.format_exc()}
            print(f"rank {rank}: {name} failed:\n{outcome['traceback']}", file=sys.stderr,
                  flush=True)
        record["scenarios"][name] = outcome
        save(record, path)
        print(f"rank {rank}: {name} {'failed' if 'error' in outcome else 'done'}", flush=True)
    record["finished"] = True
    save(record, path)


def save(record: dict[str, Any], path: str) -> None:
    torch.save(record, path + ".tmp")
    os.replace(path + ".tmp", path)


def spawned(rank: int, world_size: int, master_port: int, out: str, names: list[str]) -> None:
    """One rank under torch.multiprocessing.spawn, set up as in the DDP tutorial."""
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = str(master_port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        run_all(rank, world_size, "spawn", out, names)
    finally:
        dist.destroy_process_group()


def torchrun_style(out: str, names: list[str]) -> None:
    """One rank started with torchrun's environment."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        run_all(dist.get_rank(), dist.get_world_size(), "env", out, names)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--launch", choices=("spawn", "env"), required=True)
    parser.add_argument("--out", required=True, help="folder for rank<N>.pt and checkpoints")
    parser.add_argument("--world-size", type=int, default=3, help="spawn only")
    parser.add_argument("--master-port", type=int, default=29500, help="spawn only")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS),
                        help="comma-separated subset (default: all)")
    args = parser.parse_args()
    names = args.scenarios.split(",")
    unknown = set(names) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenarios {sorted(unknown)}; known: {list(SCENARIOS)}")
    if args.launch == "spawn":
        mp.spawn(spawned, args=(args.world_size, args.master_port, args.out, names),
                 nprocs=args.world_size, join=True)
    else:
        torchrun_style(args.out, names)


if __name__ == "__main__":
    main()
