"""`make demo`: two commd daemons and four training ranks on this machine.

Node 0 and node 1 are two daemons on 127.0.0.1, each with two local ranks running
examples/train.py (a small CNN on synthetic data). The demo prints what the ranks do, the
daemons' view (`commd status`), and stops everything it started; the daemons' logs stay in a
fresh /tmp/commd-demo-* folder (the last line names them).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from commd.cli.status import query, render
from commd.testing.daemons import LocalDaemon, commd_segments
from commd.testing.processes import kill_all
from commd_protocol.status import read_status

HERE = Path(__file__).resolve().parent


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
                [sys.executable, str(HERE / "train.py"), "--steps", str(args.steps)],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            ))
        print(f"[demo] started {world} ranks ({args.ranks_per_node} per node)")
        halfway = threading.Event()
        printers = [threading.Thread(target=_relay, args=(p, halfway, args.steps // 2))
                    for p in ranks]
        for printer in printers:
            printer.start()
        if halfway.wait(timeout=300):
            status = read_status(query(daemons[0].socket))
            print("\n[demo] `commd status` on node 0 while training:")
            print(render(status))
            for job in status.jobs:
                print(f"[demo] plan of {job.job}: {len(job.groups)} group(s) over "
                      f"{job.layers} layers, planner {job.planner}, groups (forward "
                      f"layer indices) {job.groups}")
            print("[demo] `commd status --json` on node 1, jobs only:")
            print(json.dumps(query(daemons[1].socket)["jobs"], indent=1)[:1500])
            print()
        codes = [p.wait(timeout=600) for p in ranks]
        for printer in printers:
            printer.join()
        if any(codes):
            print(f"[demo] some ranks failed: exit codes {codes}", file=sys.stderr)
            return 1
        print("[demo] all ranks finished; their parameter checksums above agree")
        return 0
    finally:
        kill_all(ranks)
        for daemon in daemons:
            daemon.stop()
        left = [name for name in commd_segments() if name.startswith("commd-demo")]
        print(f"[demo] stopped {len(daemons)} daemons; shared-memory segments left: {len(left)}")
        logs = ", ".join(str(daemon.log_path) for daemon in daemons)
        print(f"[demo] the daemons' logs are kept: {logs}")


def _relay(process: subprocess.Popen[str], halfway: threading.Event, at_step: int) -> None:
    assert process.stdout is not None
    for line in process.stdout:
        print(line, end="", flush=True)
        if f"step {at_step}/" in line:
            halfway.set()


if __name__ == "__main__":
    sys.exit(main())
