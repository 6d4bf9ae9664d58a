"""One rank of a ``fault_tolerance="continue"`` job for the real-fault tests (a stopped
daemon, a cut link): commd.testing.ranks' integer gradients averaged through the node's
daemon, a digest of every iteration's result with the membership it ran in, as tolerant_worker.py
writes them, plus when and how it failed.

The fault is injected from outside at a hold (``holds``: a list of ``{"name", "at",
"ranks"}``): before iteration ``at`` every rank of ``ranks`` touches
``<progress_dir>/<name>-held-<rank>`` and waits for ``<progress_dir>/<name>-go``; every other
rank goes on, marks its layers, touches ``<progress_dir>/<name>-marked-<rank>`` and waits
for the result. The test waits for those files, injects the fault, then touches the ``go``
file: the fault lands in that iteration on every rank, whatever the machine's speed, either
between two iterations (all held) or while the other ranks wait for the held ones.

A replacement (started later with a lost rank's number) joins the running job, touches
``<progress_dir>/joined-<rank>`` and runs from the iteration the job is at (``joined_at``).

The last line of stdout is JSON: ``digests``, ``epochs``, ``world_sizes``, ``members``,
``joined_at``; on a
CommdError also ``error``, ``code``, ``error_type`` and ``error_at`` (``time.time()`` when
it was raised, to compare with the moment of the fault).

Usage: python ft_fault_worker.py '<json spec>'
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from tolerant_worker import digest

from commd.testing.processes import await_file
from commd.testing.rank_worker import client_for
from commd.testing.ranks import value
from commd_client import CommdError


def await_go(progress: Path, name: str, rank: int, timeout: float) -> None:
    (progress / f"{name}-held-{rank}").touch()
    await_file(progress / f"{name}-go", timeout)


def main() -> None:
    spec: dict[str, Any] = json.loads(sys.argv[1])
    rank = spec["rank"]
    out: dict[str, Any] = {"rank": rank, "digests": [], "epochs": [], "world_sizes": []}
    progress = Path(spec["progress_dir"])
    try:
        with client_for(spec, fault_tolerance="continue") as client:
            layers = [(name, size) for name, size in spec["layers"]]
            grads = client.register(layers, dtype="float64", op="avg", planner="wfbp")
            out["joined_at"] = client.joined_at  # 0, or where a replacement came in
            if client.joined_at:
                (progress / f"joined-{rank}").touch()
            holds = {hold["at"]: hold for hold in spec["holds"]}
            for iteration in range(client.joined_at, spec["iterations"]):
                hold = holds.get(iteration)
                held = hold is not None and rank in hold["ranks"]
                if held and hold is not None:
                    await_go(progress, hold["name"], rank, spec["timeout"])
                for index, (_, size) in enumerate(layers):
                    grads[index][:] = value(rank, iteration, index, size)
                client.ready(range(len(layers)))
                if hold is not None and not held:
                    (progress / f"{hold['name']}-marked-{rank}").touch()
                client.wait()
                out["digests"].append(digest(grads))
                out["epochs"].append(client.epoch)
                out["world_sizes"].append(client.world_size)
            out["members"] = list(client.members)
    except CommdError as exc:
        out.update(error=str(exc), code=str(exc.code), error_type=type(exc).__name__,
                   error_at=time.time())
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
