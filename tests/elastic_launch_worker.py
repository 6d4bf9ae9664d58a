"""examples/elastic_train.py as the launch tests run it: ``elastic_launch_worker.py HOLD_AT
[example's options]``. The only addition: every rank but ``--crash-rank`` holds before step
HOLD_AT until its daemon shows the crashed rank back in the job. A real model's steps take
long enough for a replacement to arrive while the job still trains; the example's tiny steps
would let the survivors finish first, so the test holds them instead of guessing a pace.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from rejoin_ddp_worker import hold_until_joined

from commd_client.torch import DistributedDataParallel

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "elastic_train.py"


def load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("elastic_train", EXAMPLE)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {EXAMPLE}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    hold_at, options = int(sys.argv[1]), sys.argv[2:]
    example = load_example()
    crash_rank = example.parse_args(options).crash_rank

    def before_step(step: int, ddp: DistributedDataParallel) -> None:
        if step == hold_at and ddp.endpoint.rank != crash_rank:
            hold_until_joined({"joiner_rank": crash_rank})

    example.main(options, before_step)


if __name__ == "__main__":
    main()
