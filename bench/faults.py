"""The fault matrix: how long until every rank of a job hears of a fault, and what it is told.

    .venv/bin/python bench/faults.py                 # every fault, 2 daemons x 2 ranks
    .venv/bin/python bench/faults.py --faults kill-rank,stop-daemon

For each fault a fresh job of 2 daemons x 2 ranks (commd.testing.rank_worker, endless) runs on
127.0.0.1 (the link fault: in two network namespaces, root only); once every rank has
registered, the fault strikes node 1 (rank 3, or its daemon, or its link). Reported per rank:
seconds from the fault to its error, and the error's first words; then what was left behind
(processes still running, commd files in /dev/shm, socket files, network namespaces).

- kill-rank: SIGKILL rank 3            - stop-rank: SIGSTOP rank 3 (a stall; named after
- kill-daemon: SIGKILL node 1's daemon   --stall-warn-s, fails after --stall-timeout-s)
- stop-daemon: SIGSTOP node 1's daemon - link-down: `ip link set eth0 down` in node 1's netns
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from commd.cli.tables import markdown_table
from commd.testing.daemons import LocalDaemon, commd_segments
from commd.testing.processes import kill_all
from commd.testing.ranks import JobSpec, await_registered, collect, start_ranks
from commd.testing.results import add_results_option, write_results

FAULTS = ("kill-rank", "stop-rank", "kill-daemon", "stop-daemon", "link-down")
LAYERS = [("conv.weight", 27), ("conv.bias", 3), ("fc.weight", 130), ("fc.bias", 10)]
STALL_FLAGS = ["--stall-warn-s", "5", "--stall-timeout-s", "10"]


def run_fault(fault: str, workdir: Path) -> dict[str, Any]:
    """One fault on a fresh job; the time to error on every rank, and what remained."""
    bed: Any = None
    if fault == "link-down":
        from commd.testing.netbed import NetBed, NetBedUnavailable

        try:
            bed = NetBed(nodes=2, rate=None).__enter__()
        except NetBedUnavailable as exc:
            return {"fault": fault, "skipped": str(exc)}
    before = commd_segments()
    flags = ["--backend", "gloo", *(STALL_FLAGS if fault == "stop-rank" else [])]
    daemons: list[LocalDaemon] = []
    processes: list[subprocess.Popen[str]] = []
    stops: list[str] = []  # daemons that did not stop cleanly on SIGTERM
    try:
        for node in range(2):
            daemons.append(LocalDaemon(
                workdir, f"{fault}-{node}", *flags,
                listen_host=bed.address(node) if bed else "127.0.0.1",
                prefix=bed.argv(node, []) if bed else ()))
        spec = JobSpec(f"faults-{fault}", daemons, 2, LAYERS, iterations=10**6, timeout=120,
                       overrides={r: {"skip_results": True} for r in range(4)})
        processes = start_ranks(spec)
        await_registered(processes)
        strike = _strike(fault, processes, daemons, bed)
        struck = time.monotonic()
        strike()
        ranks = _errors(fault, processes, struck)
    finally:
        for process in processes:  # a stopped process must run again to die cleanly
            process.send_signal(signal.SIGCONT)
        kill_all(processes)
        for daemon in daemons:
            daemon.process.send_signal(signal.SIGCONT)
            code = daemon.stop()
            if code not in (0, -signal.SIGKILL) or (code != 0 and fault != "kill-daemon"):
                stops.append(f"{daemon.name} exited {code} (log: {daemon.log_path})")
        if bed is not None:
            bed.__exit__(None, None, None)
    return {"fault": fault, "ranks": ranks, "left": stops + _left_behind(before, daemons)}


def _strike(fault: str, processes: list[subprocess.Popen[str]], daemons: list[LocalDaemon],
            bed: Any) -> Callable[[], None]:
    return {
        "kill-rank": lambda: processes[3].send_signal(signal.SIGKILL),
        "stop-rank": lambda: processes[3].send_signal(signal.SIGSTOP),
        "kill-daemon": lambda: daemons[1].process.send_signal(signal.SIGKILL),
        "stop-daemon": lambda: daemons[1].process.send_signal(signal.SIGSTOP),
        "link-down": lambda: bed.run(1, ["ip", "link", "set", "eth0", "down"]),
    }[fault]


def _errors(fault: str, processes: list[subprocess.Popen[str]],
            struck: float) -> list[dict[str, Any]]:
    """Every rank that can still run: its seconds from the fault to its exit, and its error
    (the struck rank itself is only listed)."""
    alive = processes[:3] if fault in ("kill-rank", "stop-rank") else processes
    exited: dict[int, float] = {}
    deadline = struck + 120
    while len(exited) < len(alive) and time.monotonic() < deadline:
        for index, process in enumerate(alive):
            if index not in exited and process.poll() is not None:
                exited[index] = time.monotonic() - struck
        time.sleep(0.05)  # polling the ranks' exits, bounded by the deadline
    results = collect(alive, timeout=10)
    ranks = [{"rank": rank, "seconds": exited.get(rank), "code": result.get("code", ""),
              "error": result.get("error", "(no error: killed at the deadline)")}
             for rank, result in enumerate(results)]
    if fault in ("kill-rank", "stop-rank"):
        ranks.append({"rank": 3, "seconds": None, "code": "", "error": f"({fault}: this rank)"})
    return ranks


def _left_behind(before: set[str], daemons: list[LocalDaemon]) -> list[str]:
    left = []
    running = [d.name for d in daemons if d.process.poll() is None]
    if running:
        left.append(f"daemons still running: {running}")
    segments = commd_segments() - before
    if segments:
        left.append(f"/dev/shm: {sorted(segments)}")
    sockets = [d.socket for d in daemons if os.path.exists(d.socket)]
    if sockets:
        left.append(f"sockets: {sockets}")
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                                check=False).stdout
    if "commdbed" in namespaces:
        left.append("network namespaces remain")
    return left


def table(rows: list[dict[str, Any]]) -> str:
    cells = []
    for row in rows:
        if "skipped" in row:
            cells.append([row["fault"], "-", "-", f"skipped: {row['skipped']}"])
            continue
        for rank in row["ranks"]:
            seconds = "-" if rank["seconds"] is None else f"{rank['seconds']:.1f}"
            error = rank["error"].replace("|", "/")[:150]
            cells.append([row["fault"], rank["rank"], seconds, error])
    lines = [markdown_table(["fault", "rank", "seconds to error", "error"], cells, "llr"), ""]
    for row in rows:
        if "left" in row:
            lines.append(f"- {row['fault']}: left behind: {', '.join(row['left']) or 'nothing'}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--faults", default=",".join(FAULTS),
                        help=f"comma-separated, of {', '.join(FAULTS)}")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_results_option(parser, "faults")
    args = parser.parse_args()
    faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    unknown = sorted(set(faults) - set(FAULTS))
    if unknown:
        parser.error(f"unknown faults {unknown}; known: {', '.join(FAULTS)}")
    workdir = Path(tempfile.mkdtemp(prefix="commd-faults-"))
    rows = [run_fault(fault, workdir) for fault in faults]
    write_results("faults", {"faults": faults, "rows": rows}, args.results)
    print(json.dumps(rows, indent=1) if args.json else table(rows))
    failed = [row["fault"] for row in rows if "ranks" in row and any(
        r["seconds"] is not None and "commd: " not in r["error"] for r in row["ranks"])]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
