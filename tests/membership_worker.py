"""One rank of a ``fault_tolerance="continue"`` job for the membership-visibility tests: like
tolerant_worker (commd.testing.ranks' integer gradients averaged through the node's daemon, a
victim that vanishes in ``die_at``), with two gates so that a test can look at the daemons while the
job is alive:

- ``gate_before``: before that iteration, touch ``gated-RANK`` in ``progress_dir`` and wait
  for ``go`` (a test arms ``commd trace`` there, between two whole iterations);
- ``hold_after``: after that iteration, touch ``held-RANK`` and wait for ``release`` (the
  survivors are then in the new epoch, their job alive, for status and metrics).

The last stdout line is a JSON object: digests, epochs and world sizes per iteration, the
members at the end, or the error.

Usage: python membership_worker.py '<json spec>'
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from tolerant_worker import digest

from commd.testing.processes import await_file
from commd.testing.rank_worker import client_for, reported
from commd.testing.ranks import value


def main() -> None:
    spec: dict[str, Any] = json.loads(sys.argv[1])
    rank = spec["rank"]
    out: dict[str, Any] = {"rank": rank, "digests": [], "epochs": [], "world_sizes": []}
    progress = Path(spec["progress_dir"])
    timeout = spec["timeout"]
    with reported(out), client_for(spec, local_rank=0, local_world_size=1) as client:
        layers = [(name, size) for name, size in spec["layers"]]
        grads = client.register(layers, dtype="float64", op="avg", planner="wfbp")
        for iteration in range(spec["iterations"]):
            if iteration == spec.get("gate_before"):
                (progress / f"gated-{rank}").touch()
                await_file(progress / "go", timeout)
            victim = iteration == spec.get("die_at")
            if victim:
                (progress / "victim").touch()
            elif iteration == spec.get("loss_at"):
                await_file(progress / "victim", timeout)
            for index, (_, size) in enumerate(layers):
                grads[index][:] = value(rank, iteration, index, size)
            client.ready(range(len(layers)))
            if victim:
                os._exit(17)  # its node's collectives are on the wire: die while there
            client.wait()
            out["digests"].append(digest(grads))
            out["epochs"].append(client.epoch)
            out["world_sizes"].append(client.world_size)
            if iteration == spec.get("hold_after"):
                (progress / f"held-{rank}").touch()
                await_file(progress / "release", timeout)
        out["members"] = list(client.members)


if __name__ == "__main__":
    main()
