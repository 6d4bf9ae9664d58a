"""`make demo`: two commd daemons and four training ranks on this machine.

Node 0 and node 1 are two daemons on 127.0.0.1, each with two local ranks running
examples/train.py (a small CNN learning a synthetic task). Halfway through, the demo prints
node 0's `commd status` (the view an operator reads), the plan of the job, and a few fields of
each job from node 1's `commd status --json`, as one complete JSON object. When the ranks are
done it prints one line per rank: its mean loss per 10 steps (falling), its step time and its
parameters' checksum; the last lines compare the checksums (equal: the ranks hold the same
model) and stop everything it started. The daemons' logs stay in a fresh /tmp/commd-demo-*
folder (the last line names them).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from commd.cli.status import query, render
from commd.testing.daemons import LocalDaemon, commd_segments
from commd.testing.processes import kill_all
from commd_protocol.status import read_status

HERE = Path(__file__).resolve().parent
# examples/train.py's lines: one per --log-every steps, and the last one
_WINDOW = re.compile(r"^rank \d+ step (\d+)/\d+ loss ([\d.]+) \(mean of steps (\d+-\d+)\)")
_DONE = re.compile(r"^rank \d+ done: .*mean step ([\d.]+) ms.*params checksum (\S+)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30, help="training steps per rank")
    parser.add_argument("--nodes", type=int, default=2, help="daemons to start")
    parser.add_argument("--ranks-per-node", type=int, default=2)
    args = parser.parse_args()
    world = args.nodes * args.ranks_per_node
    workdir = Path(tempfile.mkdtemp(prefix="commd-demo-"))
    daemons: list[LocalDaemon] = []
    ranks: list[subprocess.Popen[str]] = []
    try:
        for node in range(args.nodes):
            daemons.append(LocalDaemon(workdir, f"node{node}"))
            print(f"[demo] node {node}: daemon pid {daemons[-1].process.pid}, "
                  f"socket {daemons[-1].socket}, peers on {daemons[-1].address}")
        for rank in range(world):
            node = rank // args.ranks_per_node
            env = {
                **os.environ, "RANK": str(rank), "WORLD_SIZE": str(world),
                "LOCAL_RANK": str(rank % args.ranks_per_node),
                "LOCAL_WORLD_SIZE": str(args.ranks_per_node),
                "COMMD_SOCKET": daemons[node].socket,
                "COMMD_COORDINATOR": daemons[0].address, "COMMD_JOB": "demo",
                "OMP_NUM_THREADS": "1",
            }
            ranks.append(subprocess.Popen(
                [sys.executable, str(HERE / "train.py"), "--steps", str(args.steps),
                 "--log-every", "10"],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            ))
        print(f"[demo] started {world} ranks ({args.ranks_per_node} per node); each prints "
              "one line when it is done")
        halfway = threading.Event()
        outputs: list[list[str]] = [[] for _ in ranks]
        readers = [threading.Thread(target=_collect, args=(p, out, halfway, args.steps // 2))
                   for p, out in zip(ranks, outputs, strict=True)]
        for reader in readers:
            reader.start()
        if halfway.wait(timeout=300):
            status = read_status(query(daemons[0].socket))
            print("\n[demo] `commd status` on node 0 while training:")
            print(render(status))
            for job in status.jobs:
                print(f"[demo] plan of {job.job}: {len(job.groups)} group(s) over "
                      f"{job.layers} layers, planner {job.planner}, groups (forward "
                      f"layer indices) {job.groups}")
            print("[demo] `commd status --json` on node 1, a few fields of each job "
                  "(--json gives them all):")
            print(json.dumps(brief(query(daemons[1].socket))))
            print()
        codes = [p.wait(timeout=600) for p in ranks]
        for reader in readers:
            reader.join()
        return _summarise(outputs, codes)
    finally:
        kill_all(ranks)
        for daemon in daemons:
            daemon.stop()
        left = [name for name in commd_segments() if name.startswith("commd-demo")]
        print(f"[demo] stopped {len(daemons)} daemons; shared-memory segments left: {len(left)}")
        logs = ", ".join(str(daemon.log_path) for daemon in daemons)
        print(f"[demo] the daemons' logs are kept: {logs}")


# What `make demo` shows of each job from `commd status --json`: who runs where, how far it
# got and the plan (the full object has dozens of fields per job: docs/status.md).
BRIEF_FIELDS = ("job", "state", "world_size", "local_ranks", "node_index", "nodes",
                "iteration", "planner", "plan_version", "groups")


def brief(status: dict[str, Any]) -> dict[str, Any]:
    """A small, complete object from a daemon's status: its version and backend, and
    BRIEF_FIELDS of each job."""
    return {
        "version": status.get("version"),
        "backend": status.get("backend"),
        "jobs": [{name: job.get(name) for name in BRIEF_FIELDS}
                 for job in status.get("jobs", [])],
    }


def _collect(process: subprocess.Popen[str], lines: list[str], halfway: threading.Event,
             at_step: int) -> None:
    """Keep a rank's lines for its summary; set ``halfway`` once it has logged ``at_step``."""
    assert process.stdout is not None
    for line in process.stdout:
        lines.append(line.rstrip("\n"))
        window = _WINDOW.match(line)
        if window and int(window[1]) >= at_step:
            halfway.set()


def _summarise(outputs: list[list[str]], codes: list[int]) -> int:
    """One line per rank (its loss per 10 steps, step time, checksum), then the verdict."""
    checksums: list[str] = []
    for rank, (lines, code) in enumerate(zip(outputs, codes, strict=True)):
        done = next((m for m in map(_DONE.match, lines) if m), None)
        if code or done is None:  # show everything the rank said: the error is in there
            print(f"[demo] rank {rank} failed (exit code {code}); its output:", file=sys.stderr)
            print("\n".join(lines), file=sys.stderr)
            return 1
        losses = " → ".join(m[2] for m in map(_WINDOW.match, lines) if m)
        print(f"[demo] rank {rank}: mean loss per 10 steps {losses}; "
              f"{done[1]} ms a step; params checksum {done[2]}")
        checksums.append(done[2])
    if len(set(checksums)) != 1:
        print(f"[demo] the ranks' parameter checksums differ: {checksums}", file=sys.stderr)
        return 1
    print(f"[demo] all {len(checksums)} ranks finished with the same parameters "
          f"(checksum {checksums[0]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
