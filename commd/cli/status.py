"""`commd status`: ask the node's daemon what it is doing, as a table or JSON."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import msgspec
import zmq

from commd_protocol import (
    DEFAULT_SOCKET,
    ProtocolViolation,
    StatusReply,
    StatusRequest,
    encode,
)
from commd_protocol.codec import daemon_codec
from commd_protocol.reach import unreachable
from commd_protocol.status import (
    CoordinatedJob,
    DaemonStatus,
    EndedJob,
    JobStatus,
    read_status,
)


class NoDaemon(Exception):
    """No daemon answered ``commd status`` on the socket (not reachable, silent, or an unreadable
    or unexpected reply); the message says which, in one line."""
    pass


def query(socket_path: str, timeout_s: float = 3.0) -> dict[str, Any]:
    """The daemon's status object; NoDaemon with a one-line reason when none answers."""
    problem = unreachable(socket_path)  # permission denied is not "no daemon answered"
    if problem:
        raise NoDaemon(problem)
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"ipc://{socket_path}")
        sock.send(encode(StatusRequest()))
        if not sock.poll(int(timeout_s * 1000)):
            raise NoDaemon(f"commd: no daemon answered on {socket_path} within {timeout_s:g}s")
        try:
            reply = daemon_codec.decode(sock.recv())
        except ProtocolViolation as exc:
            raise NoDaemon(f"commd: unreadable reply from {socket_path}: {exc}") from None
        if not isinstance(reply, StatusReply):
            raise NoDaemon(f"commd: unexpected reply {type(reply).__name__} from {socket_path}")
        return reply.status
    finally:
        sock.close(linger=0)


NEAR_CAP = 0.8  # a share this full is shown: the next refusals are that user's
# Membership changes shown per job, newest last: the epoch says how many there were, and
# `--json` carries every one the daemon keeps.
CHANGES_SHOWN = 5


def near_caps(status: DaemonStatus) -> list[str]:
    """One line per share the daemon, or one user, holds NEAR_CAP of (docs/security.md's caps):
    who is about to be refused, before anyone is."""
    lines = []
    for share in status.shares:
        if share.held >= NEAR_CAP * share.per_daemon:
            lines.append(f"near a cap: the daemon holds {share.held} of {share.per_daemon} "
                         f"{share.kind}")
        for uid, held in share.by_uid.items():
            if uid != "0" and held >= NEAR_CAP * share.per_user:
                lines.append(f"near a cap: uid {uid} holds {held} of {share.per_user} "
                             f"{share.kind} (per user)")
    return lines


def render(status: DaemonStatus, now: float | None = None) -> str:
    """The text view; ``now`` (unix seconds, default: the clock) dates the ended jobs."""
    lines = [
        f"commd {status.version}  backend {status.backend}  pid {status.pid}  "
        f"up {status.uptime_s:.0f}s",
        f"clients {status.socket}  peers {status.listen}",
    ]
    if status.compression_loops:
        lines.append(f"compression loops {status.compression_loops}")
    if status.peer_handshakes_refused:
        reasons = ", ".join(f"{reason} {number}" for reason, number
                            in status.peer_handshakes_refused_by.items() if number)
        lines.append(f"peer handshakes refused {status.peer_handshakes_refused}"
                     + (f" ({reasons})" if reasons else ""))
    lines.extend(near_caps(status))
    local = {job.job for job in status.jobs}
    for coordinated in status.coordinating:
        lines.extend(_coordinated(coordinated, shown_locally=coordinated.job in local))
    lines.extend(_running(status.jobs) if status.jobs else ["no jobs"])
    if status.ended:
        lines.append("ended (newest first):")
        for ended in status.ended:
            lines.extend(_ended(ended, time.time() if now is None else now))
    return "\n".join(lines)


def _running(jobs: list[JobStatus]) -> list[str]:
    """The table of the jobs in the daemon's table, then each one's details."""
    lines = []
    header = ("JOB", "STATE", "RANKS", "NODE", "ITER", "PLANNER", "GROUPS", "ITER_MS")
    rows = [header]
    for job in jobs:
        node = f"{job.node_index}/{job.nodes}" if job.nodes is not None else "-"
        rows.append((
            job.job,
            job.state.value,
            ",".join(str(r) for r in job.local_ranks) + f" of {job.world_size}",
            node,
            str(job.iteration),
            job.planner or "-",
            str(len(job.groups)),
            f"{1000 * job.iteration_s.mean:.1f}" if job.iteration_s else "-",
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        lines.append("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))
    for job in jobs:
        lines.extend(_details(job))
    return lines


def _ended(ended: EndedJob, now: float) -> list[str]:
    """One ended job, compactly: how and when it ended, its iterations and step time, its last
    plan and why, and its compression (exchanges, how chosen, candidates)."""
    job, name = ended.status, ended.status.job
    clock = time.strftime("%H:%M:%S", time.localtime(ended.ended_at))
    step = (f", step {1000 * job.iteration_s.mean:.1f} ms (last "
            f"{1000 * job.iteration_s.last:.1f})" if job.iteration_s else "")
    node = f", node {job.node_index}/{job.nodes}" if job.nodes is not None else ""
    how, _, why = ended.outcome.partition(": ")  # "failed: <message>": the message below
    lines = [f"{name}: {how} {clock} ({_ago(now - ended.ended_at)}): {job.iteration} "
             f"iteration(s){step}, ranks {_ranks(job.local_ranks)} of {job.world_size}{node}"]
    if why:
        lines.append(f"{name}: {why}")
    if job.plan_version is not None:
        lines.append(f"{name}: plan v{job.plan_version} {job.planner or '-'}, "
                     f"{len(job.groups)} group(s)"
                     + (f" ({job.plan_reason})" if job.plan_reason else ""))
    return lines + _compression(job)


def _ago(seconds: float) -> str:
    """'12s ago', '5m ago', '3h ago', '2d ago'."""
    seconds = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size:.0f}{unit} ago"
    return f"{seconds:.0f}s ago"


def _details(job: JobStatus) -> list[str]:
    """The network model, the prediction against the measurement, compression, errors."""
    lines = []
    name = job.job
    if job.alpha_s is not None:
        lines.append(
            f"{name}: network a={job.alpha_s * 1e6:.0f} µs b={(job.beta_s_per_byte or 0) * 1e9:.3f}"
            f" ns/B; exposed comm predicted {(job.predicted_comm_s or 0) * 1e3:.2f} ms, measured "
            f"{job.measured_comm_s * 1e3:.2f} ms; plan v{job.plan_version} "
            f"({job.plan_reason})"
        )
    if job.plan_search not in (None, "off"):
        lines.append(
            f"{name}: plan search {job.plan_search}: per-group overhead "
            f"{(job.plan_overhead_s or 0.0) * 1e6:.0f} µs added to a"
        )
    lines.extend(_compression(job))
    if job.fault_tolerance != "fail":
        lines.extend(_membership(job))
    if job.stall:
        lines.append(f"{name}: STALL ({job.stall_s:.0f}s): {job.stall}")
    if job.error:
        lines.append(f"{name}: {job.error}")
    return lines


def _compression(job: JobStatus) -> list[str]:
    """A compressed job's exchanges and gain, how its exchange was chosen, the candidates and
    (compression="auto") the choice made and why (none for a dense job)."""
    lines: list[str] = []
    name = job.job
    if job.compression not in (None, "none"):
        kinds = job.exchanges
        counts = ", ".join(f"{kinds.count(k)} {k}" for k in sorted(set(kinds)))
        lines.append(
            f"{name}: compression {job.compression}: ratio {job.ratio or 0:.4g}, "
            f"groups by exchange: {counts or '-'}, gain {job.gain:.3f}"
            + (f", exchange {job.selection}" if job.selection else "")
        )
        if job.candidates:
            lines.append(f"{name}: candidates (ms per iteration): " + ", ".join(
                f"{c.name} predicted {c.predicted_s * 1e3:.1f}"
                + (f" measured {c.measured_s * 1e3:.1f}" if c.measured_s is not None else "")
                for c in job.candidates))
    if job.choice:  # compression="auto": what runs and why, with the numbers
        lines.append(f"{name}: choice {job.choice}")
    return lines


def _membership(job: JobStatus) -> list[str]:
    """A fault-tolerant job's mode, epoch, members and last changes."""
    ranks = (f"ranks {_ranks(job.members)} ({len(job.members)} of {job.world_size})"
             if job.members else f"every rank ({job.world_size})")
    lines = [f"{job.job}: fault tolerance {job.fault_tolerance}: epoch {job.epoch}, {ranks}"]
    return lines + _history(job.job, job.membership_changes)


def _coordinated(job: CoordinatedJob, shown_locally: bool) -> list[str]:
    """A job this daemon coordinates: its nodes and epoch; its changes too when no rank of it
    runs here (its node-0 rank was lost), as then no job row of this daemon tells them."""
    state = "formed" if job.formed else "forming"
    epoch = f", epoch {job.epoch}" if job.epoch or job.membership_changes else ""
    lines = [f"coordinating {job.job}: {state}, {job.nodes} node(s) of a world of "
             f"{job.world_size} rank(s){epoch}"]
    if not shown_locally:
        lines.extend(_history(f"coordinating {job.job}", job.membership_changes))
    return lines


def _history(prefix: str, changes: list[str]) -> list[str]:
    """The last CHANGES_SHOWN changes ("epoch N: what changed"), and how many came before."""
    shown = changes[-CHANGES_SHOWN:]
    lines = []
    if len(changes) > len(shown):
        lines.append(f"{prefix}: ... {len(changes) - len(shown)} earlier change(s) "
                     "(--json lists them)")
    return lines + [f"{prefix}: {change}" for change in shown]


def _ranks(ranks: list[int]) -> str:
    """'0,1,3' (at most 32 ranks written out, then how many more)."""
    written = ",".join(str(rank) for rank in ranks[:32])
    return written + (f",... (+{len(ranks) - 32})" if len(ranks) > 32 else "")


def register_command(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "status",
        help="show the node daemon's jobs, plans and timings, and its last ended jobs",
        description="Ask the commd daemon on this node what it is doing: its jobs, then the\n"
                    "last 8 jobs that ended here (newest first), each with how it ended\n"
                    "(finished, failed: why), its iterations, last plan and compression.",
        epilog="examples:\n  commd status\n  commd status --json | jq '.jobs[].iteration'\n"
               "  commd status --json | jq '.ended[] | [.status.job, .outcome]'",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--socket",
        default=os.environ.get("COMMD_SOCKET", DEFAULT_SOCKET),
        help="the daemon's ipc socket (default: $COMMD_SOCKET or %(default)s)",
    )
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object (running jobs under 'jobs', ended ones "
                             "under 'ended')")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for a reply")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        status = query(args.socket, args.timeout)
    except NoDaemon as exc:
        print(str(exc), file=sys.stderr)
        return 1
    if args.json:  # the daemon's map as it sent it: a newer daemon's keys included
        print(json.dumps(status, indent=2))
        return 0
    try:
        typed = read_status(status)
    except msgspec.ValidationError as exc:
        print(f"commd: unreadable status from {args.socket}: {exc}", file=sys.stderr)
        return 1
    print(render(typed))
    return 0
