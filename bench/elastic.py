"""A lost node: how long the survivors stop and how many steps are lost, commd against torchrun
restarts and torchft. 3 nodes × 1 rank on 127.0.0.1, a small MLP on synthetic data.

Every rank (bench/elastic_worker.py) numbers its steps and logs each one as it completes. The
victim is rank 2 (a node that does not coordinate), or rank 0 where the fault is the
coordinator's node. In step ``--kill-at`` it stops inside its backward pass, so the survivors
are in that step's all-reduce, waiting for it; then the fault strikes it (a kill mid-step) and
the survivors run on to ``--steps``. Fault kinds (``--faults``):

- ``rank``: SIGKILL the victim's training process;
- ``daemon``: SIGKILL its node's commd daemon, then the rank (the whole node is gone);
- ``stop``: SIGSTOP its node's daemon (a silent node: found by heartbeat after the daemons'
  ``--peer-timeout-s``);
- ``coordinator``: SIGKILL node 0's daemon, the job's coordinator, then rank 0: a survivor
  takes over; the replacement node's daemon starts at the lost one's address and its rank
  with the lost rank's very environment (``COMMD_COORDINATOR`` naming the lost address);
- ``join``: rank 2 is killed as for ``rank``; at ``--rejoin-at`` its replacement joins, and
  the rank handing it the training state stops as the hand-over starts and is killed there
  (the fault measured is this one). The replacement fails alone at once, saying to start it
  again; the bench starts it again, and it joins from a live replica.

Systems (``--systems``), each run alternately with the others, ``--repeats`` times:

- ``commd``: commd's DistributedDataParallel with COMMD_FAULT_TOLERANCE=continue, one plain
  process per node and one ``commd run`` daemon per node (Gloo); every fault kind;
- ``torch``: stock torch DDP (Gloo) under ``torchrun --nnodes=1 --nproc-per-node=3
  --max-restarts=1`` with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, a checkpoint every
  ``--checkpoint-every`` steps: the restart brings the job back from it; ``rank`` only (there
  is no daemon to kill or stop);
- ``torchft``: torchft 0.2.0, 3 replica groups × 1 rank, min_replica_size 2, its Lighthouse
  in this process with ``--torchft-join-timeout-ms`` and ``--torchft-heartbeat-timeout-ms``;
  ``rank``, ``coordinator`` (replica 0: torchft has no coordinator among its replicas, and
  its Lighthouse, apart, is not struck) and ``join`` (the replica sending a healing
  replacement its state stops in ``send_checkpoint`` and is killed there).
  Its stock DDP comm hook fails ``assert fut._fut`` when a kill lands inside
  an all-reduce, so by default the bench uses a copy that returns the local buffer on error
  (the step is then not committed; ``--torchft-hook stock`` runs the stock one). torchft is
  not a dependency of commd; install it into the venv with

      .venv/bin/pip install --no-deps torchft==0.2.0
      .venv/bin/pip install opentelemetry-sdk opentelemetry-exporter-otlp-proto-http

  Without it the bench skips torchft and says why.

Per system and fault (the worst survivor; the median over the repeats):

- stalled s: the largest gap between two consecutive step completions that ends after the
  fault, minus the median step: the time the survivors made no progress at all;
- fault to next new step s: from the fault to the first completed step the survivors had not
  done before (a restart's redone steps are not new);
- steps lost: steps whose work was thrown away (torchft's uncommitted step) or done again
  (torchrun's steps since the last checkpoint);
- detection s and declared lost s (commd): from the fault to the survivors' daemons' first
  membership change (a failed collective, a rank's exit, a silent daemon) and to the log line
  that names the victim's node lost.

With ``--rejoin-at``, a replacement for the victim (commd: on its node's daemon where that
lives, else on a fresh one; torchft: a new replica) is started after the fault and let in once
the survivors have done that many steps; it takes a live peer's parameters and optimizer state
(commd: ``ddp.register_state``; torchft: its healing) and trains on from the job's step.
Reported: the seconds inside its DistributedDataParallel(...) (torchft: from its Manager's
creation to its first committed step), from that call to its first completed step, and the
survivors' pause at the join. Both replacements build their optimizer, whose construction
imports ``torch._dynamo`` (seconds on a small machine): commd's DistributedDataParallel(...)
loads it before it asks to join, so its figure holds it; torchft's optimizer is built before
its Manager, so its figure does not. Whether the replicas (the replacement too) end
bit-identical is checked too.

    .venv/bin/python bench/elastic.py                      # the committed result
    .venv/bin/python bench/elastic.py --systems commd --faults rank --json /tmp/elastic.json
    .venv/bin/python bench/elastic.py --faults rank,coordinator --rejoin-at 0 --json ''

(``--json`` elsewhere: runs that are not the committed result do not replace it.)
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from commd.cli.tables import markdown_table
from commd.testing.daemons import LocalDaemon
from commd.testing.ports import free_port
from commd.testing.processes import FinishTimeout, finish, kill_all, start_json_worker
from commd.testing.provenance import provenance

HERE = Path(__file__).resolve()
WORKER = str(HERE.with_name("elastic_worker.py"))
DEFAULT_JSON = "bench/results/elastic.json"
SYSTEMS = ("commd", "torch", "torchft")
FAULTS = ("rank", "daemon", "stop", "coordinator", "join")
WORLD, VICTIM = 3, 2
# the rank a fault strikes first: the coordinator's node is node 0
VICTIM_OF = {"coordinator": 0}
# what each baseline can meet: it has no daemon to kill or stop
FAULTS_OF = {"commd": FAULTS, "torch": ("rank",), "torchft": ("rank", "coordinator", "join")}


# --- what a run's progress logs say ---------------------------------------------------------------


@dataclass(frozen=True)
class Record:
    """One completed step of one rank."""

    step: int
    at: float  # CLOCK_MONOTONIC, s
    wall: float  # time.time(), s
    committed: bool


def read_records(path: Path) -> list[Record]:
    records = []
    for line in path.read_text().splitlines():
        step, at, wall, committed = line.split()
        records.append(Record(int(step), float(at), float(wall), committed == "1"))
    return records


def measure(records: Sequence[Record], struck: float, until: float = math.inf
            ) -> dict[str, Any]:
    """One survivor's cost of a fault that struck at ``struck`` (monotonic s): the stall, the
    time to its next new step, the steps lost (see the module's help) and the steps it reached
    (its last committed step + 1). The stall is looked for between the fault and the first
    new step, and before ``until``: a replacement's join, which pauses the survivors too, is
    measured apart."""
    if len(records) < 3:
        raise ValueError(f"{len(records)} steps completed: too few to measure a stall")
    gaps = [later.at - earlier.at for earlier, later in itertools.pairwise(records)]
    median = statistics.median(gaps)
    done: set[int] = set()
    # steps a replica skipped by taking a live peer's state (torchft's healing of a late
    # starter) are not lost: the job did them
    lost = 0
    high = max((r.step for r in records if r.committed and r.at < struck), default=-1)
    first_new = None
    for record in records:
        if not record.committed or record.step in done:
            lost += 1
            continue
        done.add(record.step)
        if first_new is None and record.at >= struck and record.step > high:
            first_new = record.at
    # the stall is looked for from the fault to the first new step: a busy machine's later
    # hiccups are not the fault's
    end = until if first_new is None else min(first_new, until)
    after = [gap for gap, later in zip(gaps, records[1:], strict=True)
             if struck <= later.at <= end]
    return {"median_step_s": median,
            "stall_s": max(0.0, max(after) - median) if after else None,
            "to_new_step_s": None if first_new is None else first_new - struck,
            "steps_lost": lost, "steps_done": max(done, default=-1) + 1}


def join_pause(records: Sequence[Record], go: float) -> float | None:
    """A survivor's longest gap between steps from the replacement's go on, less its median
    step: the pause the join cost it (None when it did no step after it)."""
    gaps = [later.at - earlier.at for earlier, later in itertools.pairwise(records)]
    after = [gap for gap, later in zip(gaps, records[1:], strict=True) if later.at >= go]
    return max(0.0, max(after) - statistics.median(gaps)) if after else None


def joined(records: Sequence[Record], final: dict[str, Any]) -> dict[str, Any]:
    """The replacement's own figures: the seconds inside its DistributedDataParallel(...)
    (the live peer's state included), from that call to its first completed step, and the
    step it joined at."""
    started = final["ddp_started"]
    first = next((r.at for r in records if r.at > started and r.committed), None)
    return {"joined_at_step": final["joined_at_step"],
            "join_ddp_s": final["ddp_returned"] - started,
            "join_first_step_s": None if first is None else first - started}


def worst(per_survivor: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The job's cost: the survivor that stopped longest and lost most."""
    def top(key: str) -> Any:
        values = [m[key] for m in per_survivor if m[key] is not None]
        return max(values) if values else None
    return {key: top(key) for key in ("median_step_s", "stall_s", "to_new_step_s",
                                      "steps_lost")} | {
        "steps_done": min(m["steps_done"] for m in per_survivor)}


_LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d[.,]\d+)")


def first_line_wall(logs: Sequence[str], pattern: str, after: float = -math.inf
                    ) -> float | None:
    """The wall time (s) of the earliest daemon log line that matches ``pattern``, of those
    logged at ``after`` or later (log stamps have millisecond resolution)."""
    times = []
    for text in logs:
        for line in text.splitlines():
            match = _LOG_TIME.match(line)
            if match and re.search(pattern, line):
                stamp = datetime.fromisoformat(match.group(1).replace(",", ".")).timestamp()
                if stamp >= after - 0.001:
                    times.append(stamp)
                    break
    return min(times) if times else None


def daemon_lines(victim: int) -> dict[str, str]:
    """What the survivors' daemons log: the first reaction to a fault opens a membership
    epoch (a collective's failure, a rank's exit, a lost link, a silent daemon); the victim's
    node is named lost when the coordinator gives up on it."""
    return {"detection_s": r"WARNING commd\.(coordinator|jobs): ",
            "declared_lost_s": rf"epoch \d+: (.*node \S+ \(ranks \[{victim}\]\)|the "
                               rf"coordinator \S+) lost"}


# --- running one system under one fault -----------------------------------------------------------


@dataclass
class Run:
    """One system, one fault, one repeat: where its files go and when the fault struck."""

    system: str
    fault: str
    args: argparse.Namespace
    workdir: Path
    struck: float = 0.0
    struck_wall: float = 0.0
    go: float = math.inf  # when the replacement was let in (monotonic s)

    @property
    def victim(self) -> int:
        return VICTIM_OF.get(self.fault, VICTIM)

    def spec(self, rank: int, **extra: Any) -> dict[str, Any]:
        return {"rank": rank, "world_size": WORLD, "steps": self.args.steps, "seed": 0,
                "batch": self.args.batch, "lr": 0.01, "threads": self.args.threads,
                "timeout": self.args.timeout, "progress_dir": str(self.workdir),
                "victim": self.victim, "kill_at": self.args.kill_at, **extra}

    def progress(self, rank: int) -> Path:
        return self.workdir / f"rank{rank}.log"

    def await_victim(self, processes: Sequence[subprocess.Popen[Any]]) -> int:
        """Until the victim stops inside step ``--kill-at`` (its file ``struck``); the
        victim's pid."""
        return self.await_mark("struck", processes,
                               f"rank {self.victim} never reached step {self.args.kill_at}")

    def await_mark(self, name: str, processes: Sequence[subprocess.Popen[Any]],
                   never: str) -> int:
        """Until a rank stopped where the bench strikes it says so: the pid in its file
        ``name``, polled with a deadline (``never`` says what did not happen); a process of
        ``processes`` that exits first fails the run."""
        deadline = time.monotonic() + self.args.timeout
        marker = self.workdir / name
        while True:
            with contextlib.suppress(FileNotFoundError, ValueError):
                return int(marker.read_text())
            for process in processes:
                if process.poll() is not None:
                    said = (process.stderr or process.stdout)
                    raise RuntimeError(f"a process exited (code {process.returncode}) before "
                                       f"the fault:\n{said.read()[-3000:] if said else ''}")
            if time.monotonic() > deadline:
                raise RuntimeError(never)
            time.sleep(0.001)  # polling a file, with a deadline

    def strike(self, signal_number: int, pid: int, again: bool = False) -> None:
        """Send the fault's signal; the first one (or ``again``: the one the run measures,
        of a later fault) marks when it struck."""
        if not self.struck or again:
            self.struck, self.struck_wall = time.monotonic(), time.time()
        os.kill(pid, signal_number)

    def outcome(self, survivors: Sequence[int], ends: Sequence[int] = ()) -> dict[str, Any]:
        """The survivors' costs; whether they (and ``ends``, more ranks that trained to the
        end) end with identical parameters."""
        records = {rank: read_records(self.progress(rank)) for rank in survivors}
        # a join before the fault is measured apart; a fault during the join is the run's
        until = self.go if self.go > self.struck else math.inf
        per = [measure(records[rank], self.struck, until) for rank in survivors]
        finals = [json.loads((self.workdir / f"rank{rank}.json").read_text())
                  for rank in (*survivors, *ends)]
        result = {**worst(per), "per_survivor": per,
                  "agree": len({final["digest"] for final in finals}) == 1,
                  "finals": [{k: v for k, v in final.items() if k != "digest"}
                             for final in finals]}
        if self.go < math.inf:
            pauses = [p for p in (join_pause(records[rank], self.go) for rank in survivors)
                      if p is not None]
            result["join_pause_s"] = max(pauses) if pauses else None
        return result

    def await_join(self, processes: Sequence[subprocess.Popen[Any]],
                   gos: Sequence[str]) -> None:
        """Until the replacements waiting for the files ``gos`` have their imports done and
        a survivor has completed ``--rejoin-at`` steps (files polled with a deadline)."""
        deadline = time.monotonic() + self.args.timeout
        ready = [self.workdir / f"{go}.ready" for go in gos]
        log = self.progress(min(rank for rank in range(WORLD) if rank != self.victim))
        while not (all(path.exists() for path in ready)
                   and log.read_bytes().count(b"\n") >= self.args.rejoin_at):
            for process in processes:
                if process.poll() is not None:
                    raise RuntimeError(f"a process exited (code {process.returncode}) before "
                                       f"the replacement joined")
            if time.monotonic() > deadline:
                raise RuntimeError(f"no replacement joined by step {self.args.rejoin_at}")
            time.sleep(0.001)  # polling files, with a deadline


def run_commd(run: Run) -> dict[str, Any]:
    args = run.args
    daemons: list[LocalDaemon] = []
    processes: list[subprocess.Popen[str]] = []
    try:
        for node in range(WORLD):
            daemons.append(commd_daemon(run, f"d{node}"))
        env = {"COMMD_FAULT_TOLERANCE": "continue", "OMP_NUM_THREADS": str(args.threads)}
        job = f"elastic-{os.getpid()}-{run.workdir.name}"
        for rank, daemon in enumerate(daemons):
            spec = run.spec(rank, job=job, coordinator=daemons[0].address,
                            socket=daemon.socket, pause_giving_state=run.fault == "join")
            processes.append(start_json_worker([sys.executable, WORKER, "commd"], spec,
                                               env=env))
        victim = run.victim
        run.await_victim(processes)
        rank_pid, daemon_pid = processes[victim].pid, daemons[victim].process.pid
        if run.fault in ("rank", "join"):
            run.strike(signal.SIGKILL, rank_pid)
        elif run.fault in ("daemon", "coordinator"):
            run.strike(signal.SIGKILL, daemon_pid)
            run.strike(signal.SIGKILL, rank_pid)
        else:
            run.strike(signal.SIGSTOP, daemon_pid)
        survivors = [rank for rank in range(WORLD) if rank != victim]
        # the survivors' nodes' daemons (where only a rank died, its daemon is one of them)
        logs_of = [daemon for node, daemon in enumerate(daemons) if node != victim
                   or run.fault in ("rank", "join")]
        lost = victim
        failed_start: dict[str, Any] = {}
        joiner = None
        if args.rejoin_at:
            again = None
            if run.fault == "join":
                # its second start, as the first, with its imports done before it is let in
                again = start_replacement(run, daemons[victim], daemons[0].address, job, env,
                                          processes, go="go-again")
            joiner = replace(run, daemons, job, env, processes, again)
            if again is not None:
                lost = kill_the_giver(run, processes, joiner)
                survivors.remove(lost)
                failed_start = first_start_failed(run, joiner)
                (run.workdir / "go-again").touch()
                joiner = again
        waited = [processes[rank] for rank in survivors] + ([joiner] if joiner else [])
        finished = finish(waited, args.timeout)
        for done in finished:
            if done.returncode != 0:
                raise RuntimeError(f"pid {done.pid} exited {done.returncode}:\n"
                                   f"{done.stderr[-2000:]}")
        result = run.outcome(survivors, [victim] if args.rejoin_at else [])
        if args.rejoin_at:
            result |= joined(read_records(run.progress(victim)), result["finals"][-1])
            result |= failed_start
        logs = [daemon.log() for daemon in logs_of]
        for key, pattern in daemon_lines(lost).items():
            found = first_line_wall(logs, pattern, after=run.struck_wall)
            result[key] = None if found is None else found - run.struck_wall
        result["timeline"] = timeline(run)
        return result
    finally:
        kill_all(processes)
        for daemon in daemons:
            if daemon.process.poll() is None:
                os.kill(daemon.process.pid, signal.SIGCONT)  # a stopped one must hear TERM
            daemon.stop()


def commd_daemon(run: Run, name: str, port: int = 0) -> LocalDaemon:
    return LocalDaemon(run.workdir, name, "--backend", "gloo", "--peer-timeout-s",
                       str(run.args.peer_timeout_s), port=port)


def kill_the_giver(run: Run, processes: Sequence[subprocess.Popen[str]],
                   joiner: subprocess.Popen[str]) -> int:
    """Until a survivor stops as it starts handing its state to the joiner (its file
    ``donor``); SIGKILL it there, the fault the run measures. Returns its rank."""
    pid = run.await_mark("donor", [joiner],
                         "no rank started handing its state to the replacement")
    [rank] = [rank for rank, process in enumerate(processes[:WORLD]) if process.pid == pid]
    run.strike(signal.SIGKILL, pid, again=True)
    return rank


def first_start_failed(run: Run, joiner: subprocess.Popen[str]) -> dict[str, Any]:
    """The replacement whose state's giver was killed fails alone, saying to start it again:
    the seconds from the kill to its DistributedDataParallel(...)'s error and to its exit."""
    [done] = finish([joiner], run.args.timeout)
    exited_s = time.monotonic() - run.struck
    if done.returncode == 0 or "start it again" not in done.stderr:
        raise RuntimeError(f"the replacement whose state's giver was killed exited "
                           f"{done.returncode}, not saying to start it again:\n"
                           f"{done.stderr[-2000:]}")
    failed = float((run.workdir / f"rank{run.victim}.failed").read_text())
    return {"first_start_failed_s": failed - run.struck, "first_start_exited_s": exited_s}


def start_replacement(run: Run, daemon: LocalDaemon, coordinator: str, job: str,
                      env: dict[str, str], processes: list[subprocess.Popen[str]],
                      go: str = "go") -> subprocess.Popen[str]:
    """The victim's replacement, on ``daemon``, waiting for the file ``go`` to join."""
    spec = run.spec(run.victim, job=job, coordinator=coordinator, socket=daemon.socket,
                    joiner=True, go=go)
    joiner = start_json_worker([sys.executable, WORKER, "commd"], spec, env=env)
    processes.append(joiner)
    return joiner


def timeline(run: Run) -> dict[str, Any]:
    """Every rank's completed steps against the seconds since the fault, and when the
    replacement was let in: the picture of a loss and a rejoin (``--plot``). Per rank, runs
    of consecutive steps: ``{"from_step": N, "seconds": [...]}`` (rank 2: the victim's, then
    its replacement's)."""
    ranks: dict[str, list[dict[str, Any]]] = {}
    for rank in range(WORLD):
        if not run.progress(rank).exists():
            continue
        segments: list[dict[str, Any]] = []
        for record in read_records(run.progress(rank)):
            last = segments[-1] if segments else None
            if last is None or record.step != last["from_step"] + len(last["seconds"]):
                last = {"from_step": record.step, "seconds": []}
                segments.append(last)
            last["seconds"].append(round(record.at - run.struck, 3))
        ranks[str(rank)] = segments
    go = None if run.go == math.inf else round(run.go - run.struck, 3)
    return {"ranks": ranks, "replacement_called_s": go, "victim": run.victim}


def points(segments: Sequence[dict[str, Any]]) -> tuple[list[int], list[float]]:
    """A rank's timeline as (steps, seconds)."""
    steps: list[int] = []
    seconds: list[float] = []
    for segment in segments:
        steps += range(segment["from_step"], segment["from_step"] + len(segment["seconds"]))
        seconds += segment["seconds"]
    return steps, seconds


def plot(path: str, runs: Sequence[dict[str, Any]]) -> None:
    """One panel per commd fault, from its first run that went through: each rank's steps
    against the seconds since the fault, the fault and the replacement's call marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown: dict[str, dict[str, Any]] = {}
    for outcome in runs:
        if outcome["system"] == "commd" and "timeline" in outcome:
            shown.setdefault(outcome["fault"], outcome["timeline"])
    if not shown:
        print(f"  no commd run to draw: {path} not written")
        return
    columns = min(3, len(shown))  # a row of three at most: the page's width
    rows = -(-len(shown) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5 * columns, 4 * rows), squeeze=False)
    for ax in axes.flat[len(shown):]:
        ax.set_visible(False)
    for ax, (fault, line) in zip(axes.flat, shown.items(), strict=False):
        for rank, segments in sorted(line["ranks"].items()):
            steps, seconds = points(segments)
            victim = rank == str(line.get("victim", VICTIM))
            ax.plot(seconds, steps, "." if victim else "-", markersize=2, linewidth=1,
                    label=f"rank {rank}" + (" (lost, then its replacement)" if victim else ""))
        ax.axvline(0, color="red", linestyle="--", linewidth=1, label="the fault")
        if line["replacement_called_s"] is not None:
            ax.axvline(line["replacement_called_s"], color="green", linestyle=":", linewidth=1,
                       label="the replacement calls DistributedDataParallel(...)")
        ax.set_title(FAULT_LABELS.get(fault, fault), fontsize=9)
        ax.set_xlabel("seconds since the fault")
        ax.grid(alpha=0.3)
    for row in axes:
        row[0].set_ylabel("steps completed")
    axes[0][0].legend(fontsize=7, loc="upper left")
    fig.text(0.5, 0.01, "commd, fault_tolerance=\"continue\": 3 nodes × 1 rank on one machine; "
             "a flat stretch is a pause, a line that goes on is a rank that kept training",
             ha="center", fontsize=8)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"  timeline: {path}")


def replace(run: Run, daemons: list[LocalDaemon], job: str, env: dict[str, str],
            processes: list[subprocess.Popen[str]], again: subprocess.Popen[str] | None = None
            ) -> subprocess.Popen[str]:
    """A replacement for the victim, started now so that its imports are done by
    ``--rejoin-at`` and let in then (or when they are done, if later): on its node's daemon
    where that lives, else on a fresh daemon — for the coordinator's node at the lost
    daemon's address, the replacement rank with the lost one's environment. ``again``: its
    second start, already started, whose imports are awaited too."""
    lost = daemons[run.victim]
    if run.fault in ("rank", "join"):
        daemon = lost
    else:
        daemon = commd_daemon(run, "d3", port=lost.port if run.fault == "coordinator" else 0)
        daemons.append(daemon)
    joiner = start_replacement(run, daemon, daemons[0].address, job, env, processes)
    survivors = [processes[rank] for rank in range(WORLD) if rank != run.victim]
    let_in(run, [*survivors, joiner, *([again] if again else [])], again is not None)
    return joiner


def let_in(run: Run, watched: Sequence[subprocess.Popen[str]], again: bool = False) -> None:
    """Once the replacement (and its second start, ``again``) has its imports done and the
    survivors are at ``--rejoin-at``, let it in: the file ``go``. ``watched``: the processes
    whose exit fails the wait."""
    run.await_join(watched, ["go", *(["go-again"] if again else [])])
    run.go = time.monotonic()
    (run.workdir / "go").touch()


def run_torch(run: Run) -> dict[str, Any]:
    args = run.args
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
               f"--nproc-per-node={WORLD}", "--max-restarts=1", WORKER, "torch",
               json.dumps(run.spec(0, checkpoint_every=args.checkpoint_every))]
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
           "OMP_NUM_THREADS": str(args.threads)}
    # its own session: the agent's workers are killed with it whatever happens
    launcher = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        run.strike(signal.SIGKILL, run.await_victim([launcher]))
        [done] = finish([launcher], args.timeout)
        if done.returncode != 0:
            raise RuntimeError(f"torchrun exited {done.returncode}:\n{done.stdout[-3000:]}")
        # after the restart every rank, the replaced one too, trains to the end
        return run.outcome(range(WORLD))
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()


def torchft_missing() -> str | None:
    """Why torchft cannot run here, or None."""
    try:
        import torchft  # noqa: F401
    except ImportError as exc:
        return (f"torchft is not installed ({exc}); the two pip lines in --help install it "
                f"into the venv")
    return None


def run_torchft(run: Run) -> dict[str, Any]:
    from torchft._torchft import LighthouseServer

    args = run.args
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=WORLD - 1,
                                  join_timeout_ms=args.torchft_join_timeout_ms,
                                  heartbeat_timeout_ms=args.torchft_heartbeat_timeout_ms)
    processes: list[subprocess.Popen[str]] = []
    try:
        env = {"OMP_NUM_THREADS": str(args.threads)}

        def start(rank: int, **extra: Any) -> subprocess.Popen[str]:
            spec = run.spec(rank, lighthouse=lighthouse.address(), store_port=free_port(),
                            hook=args.torchft_hook, torchft_timeout=args.torchft_timeout_s,
                            **extra)
            process = start_json_worker([sys.executable, WORKER, "torchft"], spec, env=env)
            processes.append(process)
            return process

        for rank in range(WORLD):
            start(rank, pause_giving_state=run.fault == "join")
        run.await_victim(processes)
        run.strike(signal.SIGKILL, processes[run.victim].pid)
        survivors = [rank for rank in range(WORLD) if rank != run.victim]
        waited = [processes[rank] for rank in survivors]
        if args.rejoin_at:  # a replacement replica that heals from a live one
            joiner = start(run.victim, joiner=True)
            let_in(run, [*waited, joiner])
            if run.fault == "join":
                survivors.remove(kill_the_giver(run, processes, joiner))
            waited = [*(processes[rank] for rank in survivors), joiner]
        finished = finish(waited, args.timeout)
        for done in finished:
            if done.returncode != 0:
                raise RuntimeError(f"pid {done.pid} exited {done.returncode}:\n"
                                   f"{done.stderr[-2000:]}")
        result = run.outcome(survivors, [run.victim] if args.rejoin_at else [])
        if args.rejoin_at:
            result |= joined(read_records(run.progress(run.victim)), result["finals"][-1])
        return result
    finally:
        kill_all(processes)
        lighthouse.shutdown()


RUNNERS = {"commd": run_commd, "torch": run_torch, "torchft": run_torchft}


def run_one(system: str, fault: str, args: argparse.Namespace) -> dict[str, Any]:
    failed = False
    workdir = Path(tempfile.mkdtemp(prefix="commd-elastic-"))
    try:
        run = Run(system, fault, args, workdir)
        try:
            return RUNNERS[system](run)
        except (RuntimeError, FinishTimeout, OSError, ValueError) as exc:
            failed = True
            print_log_tails(workdir)  # where a run fails on a CI machine, its logs are all
            return {"error": str(exc)[-4000:]}
    finally:
        if args.keep_logs or failed:  # a failed run's logs are worth a look
            print(f"  logs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


def print_log_tails(workdir: Path, lines: int = 40) -> None:
    """The last ``lines`` lines of each daemon's and rank's log in ``workdir``: a run that
    failed on a machine nobody can look at afterwards leaves its story in the output."""
    for path in sorted(workdir.glob("*.log")):
        tail = path.read_text(errors="replace").splitlines()[-lines:]
        print(f"--- {path.name} (last {len(tail)} lines) ---")
        for line in tail:
            print(f"  {line[:400]}")


# --- summary, table, command line -----------------------------------------------------------------


def plan(systems: Sequence[str], faults: Sequence[str]) -> list[tuple[str, str]]:
    """The (system, fault) pairs of one repeat, in run order."""
    return [(system, fault) for fault in faults for system in systems
            if fault in FAULTS_OF[system]]


def summarise(runs: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per system and fault: the medians over the repeats that ran (steps lost: the most)."""
    summary: dict[str, dict[str, Any]] = {}
    for (system, fault), group in itertools.groupby(
            sorted(runs, key=lambda r: (r["system"], r["fault"])),
            key=lambda r: (r["system"], r["fault"])):
        runs_of = list(group)
        good = [r for r in runs_of if "error" not in r]

        def median(key: str, good: list[dict[str, Any]] = good) -> float | None:
            values = [r[key] for r in good if r.get(key) is not None]
            return round(statistics.median(values), 3) if values else None

        summary.setdefault(system, {})[fault] = {
            "stall_s": median("stall_s"), "to_new_step_s": median("to_new_step_s"),
            "detection_s": median("detection_s"), "declared_lost_s": median("declared_lost_s"),
            "median_step_s": median("median_step_s"),
            "join_ddp_s": median("join_ddp_s"), "join_first_step_s": median("join_first_step_s"),
            "join_pause_s": median("join_pause_s"),
            "first_start_failed_s": median("first_start_failed_s"),
            "joined_at_step": [r["joined_at_step"] for r in good if "joined_at_step" in r],
            "steps_lost": max((r["steps_lost"] for r in good), default=None),
            "agree": all(r["agree"] for r in good) if good else None,
            "repeats": len(good), "errors": len(runs_of) - len(good)}
    return summary


LABELS = {"commd": "commd (fault_tolerance=continue)",
          "torch": "torch DDP, torchrun --max-restarts=1",
          "torchft": "torchft 0.2.0 + Lighthouse"}
FAULT_LABELS = {"rank": "rank killed", "daemon": "node killed (daemon + rank)",
                "stop": "daemon stopped (SIGSTOP)",
                "coordinator": "the coordinator's node killed (daemon + rank 0)",
                "join": "the rank giving a joiner its state killed"}


def table(summary: dict[str, dict[str, Any]]) -> str:
    def cell(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    rows: list[list[str]] = []
    for fault in FAULTS:
        for system in SYSTEMS:
            row = summary.get(system, {}).get(fault)
            if row is None:
                continue
            if not row["repeats"]:
                rows.append([FAULT_LABELS[fault], LABELS[system], "failed", *["-"] * 5])
                continue
            rows.append([FAULT_LABELS[fault], LABELS[system], cell(row["stall_s"]),
                         cell(row["to_new_step_s"]), str(row["steps_lost"]),
                         cell(row["detection_s"]), cell(row["declared_lost_s"]),
                         "yes" if row["agree"] else "NO"])
    lines = [markdown_table(["fault", "system", "survivors stalled (s)",
                             "fault to next new step (s)", "steps lost", "detection (s)",
                             "declared lost (s)", "replicas identical"], rows)]
    joins = [(fault, system, summary[system][fault]) for fault in FAULTS for system in SYSTEMS
             if summary.get(system, {}).get(fault, {}).get("join_ddp_s") is not None]
    if joins:
        lines += ["", markdown_table(
            ["the replacement after", "system", "its first start failed after (s)",
             "its join (s): DistributedDataParallel(...), torchft from its Manager",
             "to its first step (s)", "survivors paused (s)", "joined at step"],
            [[FAULT_LABELS[fault], LABELS[system], cell(row.get("first_start_failed_s")),
              cell(row["join_ddp_s"]), cell(row["join_first_step_s"]),
              cell(row["join_pause_s"]), ", ".join(map(str, row["joined_at_step"]))]
             for fault, system, row in joins])]
    return "\n".join(lines)


def names(text: str, valid: Sequence[str], option: str) -> list[str]:
    chosen = [name.strip() for name in text.split(",")]
    for name in chosen:
        if name not in valid:
            raise ValueError(f"{option} {name!r}: use {', '.join(valid)}")
    if len(set(chosen)) != len(chosen):
        raise ValueError(f"{option} {text!r} names one twice")
    return chosen


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"comma-separated, from {', '.join(SYSTEMS)} (default all; torchft "
                        f"is skipped, saying why, when it is not installed)")
    p.add_argument("--faults", default=",".join(FAULTS),
                   help=f"comma-separated, from {', '.join(FAULTS)} (default all; the "
                        f"baselines run rank only)")
    p.add_argument("--steps", type=int, default=1500,
                   help="steps of training (default 1500: the survivors must still train when "
                        "the replacement's join completes, and for the join fault when its "
                        "second start's does)")
    p.add_argument("--kill-at", type=int, default=100,
                   help="the step (0-based) inside which the fault strikes its victim "
                        "(default 100)")
    p.add_argument("--repeats", type=int, default=3,
                   help="runs of every system and fault, alternating (default 3)")
    p.add_argument("--batch", type=int, default=32, help="samples per rank and step (default 32)")
    p.add_argument("--checkpoint-every", type=int, default=10,
                   help="torch DDP's checkpoint interval in steps (default 10)")
    p.add_argument("--peer-timeout-s", type=float, default=3.0,
                   help="the commd daemons' --peer-timeout-s: a stopped daemon is lost after "
                        "it (default 3)")
    p.add_argument("--torchft-heartbeat-timeout-ms", type=int, default=5000,
                   help="the torchft Lighthouse's heartbeat timeout (default 5000, torchft's)")
    p.add_argument("--torchft-join-timeout-ms", type=int, default=100,
                   help="how long the Lighthouse waits for a replica that still heartbeats "
                        "but has not asked for the quorum (default 100, torchft's Python "
                        "LighthouseServer's; its torchft_lighthouse command's is 60000: the "
                        "survivors then wait for the heartbeat timeout)")
    p.add_argument("--torchft-timeout-s", type=float, default=60.0,
                   help="the torchft Manager's and Gloo's timeouts (default 60, torchft's): "
                        "what a survivor waits for a peer that stopped answering")
    p.add_argument("--torchft-hook", choices=("tolerant", "stock"), default="tolerant",
                   help="torchft's DDP comm hook: the stock one or the copy that returns the "
                        "local buffer when the all-reduce failed (default tolerant)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--timeout", type=float, default=180.0,
                   help="seconds one run may take before it is killed (default 180)")
    p.add_argument("--rejoin-at", type=int, default=200,
                   help="commd: a replacement rank 2 joins once the survivors have done this "
                        "many steps, taking a live peer's state (default 200; 0: none)")
    p.add_argument("--json", default=DEFAULT_JSON, metavar="PATH",
                   help=f"where the results and provenance go (default {DEFAULT_JSON}); '' for "
                        f"none")
    p.add_argument("--keep-logs", action="store_true", help="keep every run's logs")
    p.add_argument("--plot", default="", metavar="PNG",
                   help="draw a loss and a rejoin: each rank's steps against the time since the "
                        "fault, one panel per commd fault (needs matplotlib)")
    return p


def check(p: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The systems and faults; a usage error (exit 2) naming a bad option."""
    try:
        systems = names(args.systems, SYSTEMS, "--systems")
        faults = names(args.faults, FAULTS, "--faults")
    except ValueError as exc:
        p.error(str(exc))
    if args.steps < 3 or args.steps > 1_000_000:
        p.error("--steps must be between 3 and 1000000")
    if not 1 <= args.kill_at <= args.steps - 2:
        p.error(f"--kill-at must be between 1 and --steps - 2 ({args.steps - 2})")
    if "join" in faults and not args.rejoin_at:
        p.error("--faults join needs a replacement: --rejoin-at must not be 0")
    if args.rejoin_at and not args.kill_at < args.rejoin_at < args.steps:
        p.error(f"--rejoin-at must be 0 or between --kill-at and --steps ({args.kill_at} < "
                f"N < {args.steps})")
    if args.repeats < 1 or args.batch < 1 or args.threads < 1 or args.checkpoint_every < 1:
        p.error("--repeats, --batch, --threads and --checkpoint-every must be at least 1")
    if not 0.1 <= args.peer_timeout_s <= 600:
        p.error("--peer-timeout-s must be between 0.1 and 600")
    if not 100 <= args.torchft_heartbeat_timeout_ms <= 600_000:
        p.error("--torchft-heartbeat-timeout-ms must be between 100 and 600000")
    if not 0 <= args.torchft_join_timeout_ms <= 600_000:
        p.error("--torchft-join-timeout-ms must be between 0 and 600000")
    if not args.timeout > 0:
        p.error("--timeout must be positive")
    if not 1 <= args.torchft_timeout_s < args.timeout:
        p.error("--torchft-timeout-s must be at least 1 and below --timeout")
    return systems, faults


def join_words(outcome: dict[str, Any]) -> str:
    if "join_ddp_s" not in outcome:
        return ""
    first = outcome["join_first_step_s"]
    failed = outcome.get("first_start_failed_s")
    again = ("" if failed is None else
             f"; the replacement's first start failed {failed:.2f} s after the kill and was "
             f"started again")
    return (f"{again}; the replacement joined at step {outcome['joined_at_step']}, "
            f"{outcome['join_ddp_s']:.2f} s in DistributedDataParallel(...), its first step "
            f"{'-' if first is None else f'{first:.2f}'} s after that call")


def save(path: str, result: dict[str, Any]) -> None:
    result["summary"] = summarise(result["runs"])
    # the machine may be shared: its load at the end beside the provenance's at the start
    result["loadavg_end"] = list(os.getloadavg())
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(compact_lists(json.dumps(result, indent=1)) + "\n")


def compact_lists(text: str) -> str:
    """Indented JSON with every list of plain numbers on one line (a timeline's seconds
    would take a line each)."""
    return re.sub(r"\[\s*(-?[\d.eE+-]+(?:,\s*-?[\d.eE+-]+)*)\s*\]",
                  lambda match: "[" + ", ".join(part.strip() for part in
                                                match.group(1).split(",")) + "]", text)


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    systems, faults = check(p, args)
    skipped: dict[str, str] = {}
    # torchft's Lighthouse and managers log every quorum, a few lines a step, at INFO; read at
    # their first use, so before torchft is imported
    os.environ.setdefault("RUST_LOG", "warn")
    if "torchft" in systems and (why := torchft_missing()):
        skipped["torchft"] = why
        systems.remove("torchft")
        print(f"  torchft skipped: {why}", flush=True)
    command = None if argv is None else ["bench/elastic.py", *argv]
    result: dict[str, Any] = {
        "provenance": provenance(command),
        "settings": {"nodes": WORLD, "ranks_per_node": 1, "victim_rank": VICTIM,
                     "steps": args.steps, "kill_at": args.kill_at,
                     "rejoin_at": args.rejoin_at, "repeats": args.repeats,
                     "batch": args.batch, "checkpoint_every": args.checkpoint_every,
                     "peer_timeout_s": args.peer_timeout_s,
                     "torchft_heartbeat_timeout_ms": args.torchft_heartbeat_timeout_ms,
                     "torchft_join_timeout_ms": args.torchft_join_timeout_ms,
                     "torchft_timeout_s": args.torchft_timeout_s,
                     "threads": args.threads,
                     "model": "MLP 256-512-512-10, SGD lr 0.01 momentum 0.9",
                     "systems": systems, "faults": faults,
                     "torchft_comm_hook": args.torchft_hook},
        "skipped": skipped, "runs": []}
    if "torchft" in systems and args.torchft_hook == "tolerant":
        print("  torchft: its DDP comm hook returns the local buffer when the all-reduce "
              "failed (stock 0.2.0 fails `assert fut._fut` there)", flush=True)
    for repeat, (system, fault) in itertools.product(range(args.repeats),
                                                     plan(systems, faults)):
        started = time.monotonic()
        outcome = {"system": system, "fault": fault, "repeat": repeat,
                   **run_one(system, fault, args)}
        result["runs"].append(outcome)
        if "error" in outcome:
            print(f"  #{repeat + 1} {system} {fault}: FAILED\n{outcome['error']}", flush=True)
        else:
            print(f"  #{repeat + 1} {system} {fault}: stalled {outcome['stall_s']:.2f} s, next "
                  f"new step {outcome['to_new_step_s']:.2f} s after the fault, "
                  f"{outcome['steps_lost']} steps lost, replicas identical {outcome['agree']}"
                  f"{join_words(outcome)} ({time.monotonic() - started:.0f} s)", flush=True)
        save(args.json, result)  # after every run, so a later failure keeps the earlier ones
    save(args.json, result)  # also when nothing ran: what was skipped, and why
    if args.plot:
        plot(args.plot, result["runs"])
    print(f"\n{table(result['summary'])}\n\ncommand: {result['provenance']['command']}")
    return 0 if all("error" not in r for r in result["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
