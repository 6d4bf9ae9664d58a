"""examples/elastic_train.py as the launch tests run it: ``elastic_launch_worker.py HOLD_AT
[example's options]``. The only addition: a rank that did not join late holds before step
HOLD_AT until its daemon shows every rank of the job in it again. A real model's steps take
long enough for a replacement to arrive while the job still trains; the example's tiny steps
would let the survivors finish first, so the test holds them instead of guessing a pace.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path
from types import ModuleType

from commd.cli.status import query
from commd_client.torch import DistributedDataParallel

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "elastic_train.py"
HOLD_TIMEOUT_S = 60.0


def load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("elastic_train", EXAMPLE)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {EXAMPLE}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def hold_until_whole(world_size: int) -> None:
    """Until this node's daemon lists every rank of the job among its members."""
    job, socket = os.environ["COMMD_JOB"], os.environ["COMMD_SOCKET"]
    deadline = time.monotonic() + HOLD_TIMEOUT_S
    while True:
        jobs = [entry for entry in query(socket)["jobs"] if entry["job"] == job]
        if jobs and jobs[0]["members"] == list(range(world_size)):
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"the job never had all {world_size} ranks again")
        time.sleep(0.02)  # polling a condition, with a deadline


def main() -> None:
    hold_at, options = int(sys.argv[1]), sys.argv[2:]
    example = load_example()

    def before_step(step: int, ddp: DistributedDataParallel) -> None:
        if step == hold_at and not ddp.joined_at_step:
            hold_until_whole(ddp.endpoint.world_size)

    example.main(options, before_step)


if __name__ == "__main__":
    main()
