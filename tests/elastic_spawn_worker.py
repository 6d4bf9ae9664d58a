"""examples/elastic_train.py under ``torch.multiprocessing.spawn``, one spawn per node, as the
launch tests run it: ``elastic_spawn_worker.py NPROCS HOLD_AT [example's options]``.

spawn gives each process its local rank; COMMD_NODE_RANK and COMMD_NNODES (set by the test, as
a user sets them on each node) make the job-wide rank. When one process fails, spawn ends the
node's other processes and raises (its own rule), so the node is lost whole; running this
again on the node brings its ranks back into the running job. Each rank runs
elastic_launch_worker.py's main: the example, holding the ranks that did not join late
before HOLD_AT until the job is whole again.
"""

from __future__ import annotations

import os
import sys

import torch.multiprocessing as mp
from elastic_launch_worker import main as run_rank


def rank_main(local_rank: int, nprocs: int, argv: list[str]) -> None:
    # what torchrun would set for one node of ``nprocs`` ranks
    os.environ.update(RANK=str(local_rank), WORLD_SIZE=str(nprocs),
                      LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE=str(nprocs))
    sys.argv = [sys.argv[0], *argv]
    run_rank()


def main() -> None:
    nprocs, argv = int(sys.argv[1]), sys.argv[2:]
    mp.spawn(rank_main, args=(nprocs, argv), nprocs=nprocs)


if __name__ == "__main__":
    main()
