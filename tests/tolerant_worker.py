"""One rank of a ``fault_tolerance="continue"`` job for the fault-tolerance tests: writes
commd.testing.ranks' integer gradients, averages them through the node's daemon and prints,
as its last JSON line, a digest of every iteration's result with the membership it ran in.

A rank with ``joiner`` set is a replacement started later with a lost rank's number: it
joins the running job and trains from the iteration the job is at (``Client.joined_at``);
the others hold before ``hold_at`` until it is in (or until the test creates the file
``hold_for`` in ``progress_dir``, e.g. once it has killed a daemon). ``holds``, a list of
``[iteration, file]``, adds more such gates; before each held iteration the rank touches
``held-<iteration>-<rank>``.

A rank given ``die_at`` vanishes in that iteration without a goodbye (``os._exit``), either
before marking anything (``die_when="before_ready"``) or after marking every layer
(``"after_ready"``: its node's collectives are then on the wire when it dies). Every other
rank waits (``progress_dir``) until the victim is in that iteration, so the loss lands there.

Usage: python tolerant_worker.py '<json spec>'
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

from commd.testing.processes import await_file
from commd.testing.rank_worker import client_for, reported
from commd.testing.ranks import value


def digest(arrays: list[np.ndarray]) -> str:
    return hashlib.sha256(b"".join(a.tobytes() for a in arrays)).hexdigest()


def main() -> None:
    spec: dict[str, Any] = json.loads(sys.argv[1])
    rank = spec["rank"]
    out: dict[str, Any] = {"rank": rank, "digests": [], "epochs": [], "world_sizes": []}
    progress = Path(spec["progress_dir"])
    with reported(out), client_for(spec) as client:
        layers = [(name, size) for name, size in spec["layers"]]
        grads = client.register(layers, dtype="float64", op="avg", planner="wfbp",
                                compression=spec.get("compression", "none"))
        out["joined_at"] = client.joined_at  # 0, or where a replacement came in
        if spec.get("joiner"):
            (progress / "joined").touch()
        gates = {iteration: name for iteration, name in spec.get("holds", [])}
        for iteration in range(client.joined_at, spec["iterations"]):
            if iteration == spec.get("hold_at"):  # until the replacement is in, or
                await_file(progress / spec.get("hold_for", "joined"), spec["timeout"])
            if iteration in gates:
                (progress / f"held-{iteration}-{rank}").touch()
                await_file(progress / gates[iteration], spec["timeout"])
            victim = iteration == spec.get("die_at")
            if victim:
                (progress / "victim").touch()
            elif iteration == spec.get("loss_at"):
                await_file(progress / "victim", spec["timeout"])
            for index, (_, size) in enumerate(layers):
                grads[index][:] = value(rank, iteration, index, size)
            if victim and spec.get("die_when") == "before_ready":
                os._exit(17)
            client.ready(range(len(layers)))
            if victim:
                # its node's collectives go on the wire: die while they are there
                os._exit(17)
            client.wait()
            out["digests"].append(digest(grads))
            out["epochs"].append(client.epoch)
            out["world_sizes"].append(client.world_size)
        out["members"] = list(client.members)


if __name__ == "__main__":
    main()
