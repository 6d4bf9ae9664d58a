"""`commd trace`: record N iterations of a running job on the daemons of this machine and write
a Chrome/Perfetto trace: per node, when each layer became ready, each group's local sum, wire
and write-back, top-k selections, plan changes and membership changes. ``--plot`` draws one
iteration as a Gantt chart (docs/trace.md).

Each daemon records its node's next N whole iterations and answers when they are done (or
when ``--timeout`` passed, with what it has); this command waits for every one of them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any

import zmq

from commd.cli._pyplot import pyplot
from commd_protocol import (
    DEFAULT_SOCKET,
    Error,
    ProtocolViolation,
    TraceEvent,
    TraceReply,
    TraceRequest,
    encode,
)
from commd_protocol.codec import daemon_codec
from commd_protocol.reach import unreachable

# Rows of each node, top to bottom (a newer daemon's other rows follow).
ROWS = ("iteration", "plan", "membership", "ready", "local sum", "compression", "wire",
        "write back")
GRACE_S = 2.0  # the daemons answer at --timeout; this is how much longer the command waits
PERFETTO = "https://ui.perfetto.dev"


class TraceFailed(Exception):
    """One line for the user, "commd: ..."."""


# ----------------------------------------------------------------------------- daemons


def request_traces(sockets: list[str], job: str, iterations: int,
                   timeout_s: float) -> list[TraceReply]:
    """Ask every daemon at once for the job's next ``iterations``; their replies, in order."""
    for path in sockets:
        problem = unreachable(path)
        if problem:
            raise TraceFailed(problem)
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    dealers = [context.socket(zmq.DEALER) for _ in sockets]
    try:
        poller = zmq.Poller()
        for dealer, path in zip(dealers, sockets, strict=True):
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(f"ipc://{path}")
            dealer.send(encode(TraceRequest(job=job, iterations=iterations,
                                            timeout_s=timeout_s)))
            poller.register(dealer, zmq.POLLIN)
        return _await_replies(poller, dealers, sockets, timeout_s + GRACE_S)
    finally:
        for dealer in dealers:
            dealer.close(linger=0)


def _await_replies(poller: zmq.Poller, dealers: list[zmq.Socket[bytes]], sockets: list[str],
                   wait_s: float) -> list[TraceReply]:
    replies: dict[int, TraceReply] = {}
    deadline = time.monotonic() + wait_s
    while len(replies) < len(dealers):
        left = deadline - time.monotonic()
        ready = dict(poller.poll(max(0, int(left * 1000)))) if left > 0 else {}
        if not ready:
            missing = ", ".join(p for i, p in enumerate(sockets) if i not in replies)
            raise TraceFailed(f"commd: no trace from {missing} within {wait_s:g}s")
        for index, dealer in enumerate(dealers):
            if dealer in ready:
                replies[index] = _reply(dealer.recv(), sockets[index])
                poller.unregister(dealer)
    return [replies[i] for i in range(len(dealers))]


def _reply(frame: bytes, path: str) -> TraceReply:
    try:
        reply = daemon_codec.decode(frame)
    except ProtocolViolation as exc:
        raise TraceFailed(f"commd: unreadable reply from {path}: {exc}") from None
    if isinstance(reply, Error):
        raise TraceFailed(f"commd: {path}: {reply.message.removeprefix('commd: ')}")
    if not isinstance(reply, TraceReply):
        raise TraceFailed(f"commd: unexpected reply {type(reply).__name__} from {path}")
    if not reply.iterations:
        raise TraceFailed(f"commd: {path} recorded no iteration of job {reply.job!r}")
    return reply


# ----------------------------------------------------------------------------- the trace file


def chrome_trace(replies: list[TraceReply], sockets: list[str]) -> dict[str, Any]:
    """The Chrome trace-event JSON object: one process per daemon, one thread per row, times
    in microseconds after the earliest event (every daemon of a machine shares one clock)."""
    starts = [e.start_s for reply in replies for e in reply.events]
    origin = min(starts) if starts else 0.0
    events: list[dict[str, Any]] = []
    for pid, (reply, path) in enumerate(zip(replies, sockets, strict=True), start=1):
        placed = _lanes(reply.events)
        order = {row: i for i, row in enumerate(ROWS)}
        rows = sorted({lane for _, lane in placed},
                      key=lambda r: (order.get(r[0], len(ROWS)), r[0], r[1]))
        tids = {row: tid for tid, row in enumerate(rows, start=1)}
        events.append(_meta("process_name", pid, 0, name=f"node {reply.node_index}"))
        events.append(_meta("process_sort_index", pid, 0, sort_index=reply.node_index))
        events.append(_meta("process_labels", pid, 0, labels=path))
        for (row, lane), tid in tids.items():
            name = row if lane == 0 else f"{row} ({lane + 1})"
            events.append(_meta("thread_name", pid, tid, name=name))
            events.append(_meta("thread_sort_index", pid, tid, sort_index=tid))
        events.extend(_event(e, pid, tids[lane], origin) for e, lane in placed)
    events.sort(key=lambda e: (e["ph"] != "M", e.get("ts", 0.0)))
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "job": replies[0].job if replies else "",
            "clock": "CLOCK_MONOTONIC",
            "origin_s": origin,
            "nodes": [{"socket": path, "node_index": r.node_index, "nodes": r.nodes,
                       "iterations": r.iterations, "truncated": r.truncated}
                      for r, path in zip(replies, sockets, strict=True)],
        },
    }


def _lanes(events: list[TraceEvent]) -> list[tuple[TraceEvent, tuple[str, int]]]:
    """Each event with its (row, lane): trace viewers need the spans of one thread to nest,
    so a span that overlaps an earlier one of its row (two write-backs on worker threads)
    goes to the row's next lane, shown as "write back (2)"."""
    ends: dict[str, list[float]] = {}
    placed = []
    for event in sorted(events, key=lambda e: e.start_s):
        lane = 0
        if event.duration_s is not None:
            lanes = ends.setdefault(event.row, [])
            lane = next((i for i, end in enumerate(lanes) if end <= event.start_s), len(lanes))
            lanes[lane:lane + 1] = [event.start_s + event.duration_s]
        placed.append((event, (event.row, lane)))
    return placed


def _meta(kind: str, pid: int, tid: int, **args: Any) -> dict[str, Any]:
    return {"name": kind, "ph": "M", "pid": pid, "tid": tid, "args": args}


def _event(event: TraceEvent, pid: int, tid: int, origin: float) -> dict[str, Any]:
    out: dict[str, Any] = {
        "name": event.name, "cat": event.row, "pid": pid, "tid": tid,
        "ts": _us(event.start_s - origin),
        "args": {**event.args, "iteration": event.iteration},
    }
    if event.duration_s is None:
        out.update(ph="i", s="t")
    else:  # the end rounded like every start: a span that ends as the next begins still does
        out.update(ph="X", dur=round(_us(event.start_s + event.duration_s - origin) - out["ts"],
                                     3))
    return out


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


# ----------------------------------------------------------------------------- the picture


def _pyplot() -> Any:
    try:
        return pyplot()
    except ValueError as exc:
        raise TraceFailed(f"commd: {exc}") from None


def plotted_iteration(replies: list[TraceReply]) -> int:
    """The last iteration every node recorded (else node 0's last)."""
    common = set.intersection(*(set(r.iterations) for r in replies))
    return max(common) if common else replies[0].iterations[-1]


def plot(plt: Any, replies: list[TraceReply], path: str, iteration: int) -> None:
    """A Gantt chart of ``iteration``: per node, the layers' ready marks (ticks coloured by
    their group) above each group's local sum, wire and write-back (bars, same colours)."""
    chosen = [[e for e in r.events if e.iteration == iteration] for r in replies]
    spans = [e for events in chosen for e in events if e.row == "iteration"]
    origin = min((e.start_s for e in spans), default=0.0)
    end = max((e.start_s + (e.duration_s or 0.0) for e in spans), default=origin + 1e-3)
    width_ms = max((end - origin) * 1e3, 1e-3)
    figure, axes = plt.subplots(len(replies), 1, sharex=True, squeeze=False,
                                figsize=(10, 0.8 + 2.0 * len(replies)))
    colour = plt.get_cmap("tab10")
    for ax, reply, events in zip(axes[:, 0], replies, chosen, strict=True):
        _plot_node(ax, events, origin, width_ms, colour)
        ax.set_title(f"node {reply.node_index}", loc="left", fontsize=10)
        ax.set_xlim(-0.02 * width_ms, 1.02 * width_ms)
        ax.grid(True, axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("ms after the iteration's first ready layer")
    figure.suptitle(f"job {replies[0].job}, iteration {iteration}: layers ready (ticks) "
                    "vs groups summed, on the wire, written back", fontsize=10)
    figure.tight_layout()
    try:
        figure.savefig(path, dpi=120)
    except OSError as exc:
        raise TraceFailed(f"commd: cannot write plot {path}: {exc.strerror or exc}") from None
    finally:
        plt.close(figure)


def _plot_node(ax: Any, events: list[TraceEvent], origin: float, width_ms: float,
               colour: Any) -> None:
    rows = [r for r in ("ready", "local sum", "compression", "wire", "write back")
            if any(e.row == r for e in events)]
    level = {row: len(rows) - i for i, row in enumerate(rows)}
    labelled = -math.inf  # where the last layer's number was written
    for event in sorted(events, key=lambda e: e.start_s):
        y = level.get(event.row)
        group = int(event.args.get("group", 0))
        at = (event.start_s - origin) * 1e3
        if y is None:
            continue
        if event.duration_s is None:  # a layer became ready: a tick, numbered if room
            ax.plot([at, at], [y - 0.35, y + 0.35], color=colour(group % 10), linewidth=2)
            number = str(event.args.get("layer", ""))
            if at - labelled > width_ms * 0.007 * len(number):
                ax.text(at, y + 0.4, number, ha="center", va="bottom", fontsize=6)
                labelled = at
            continue
        length = max(event.duration_s * 1e3, width_ms * 0.003)  # a µs span stays visible
        ax.broken_barh([(at, length)], (y - 0.35, 0.7), color=colour(group % 10), alpha=0.85)
        layers = str(event.args.get("layers", ""))
        label = f"g{group} (layer{'s' if '-' in layers else ''} {layers})"
        if length > width_ms * 0.012 * len(label):
            ax.text(at + length / 2, y, label, ha="center", va="center", fontsize=7)
        elif length > width_ms * 0.04:
            ax.text(at + length / 2, y, f"g{group}", ha="center", va="center", fontsize=7)
    ax.set_yticks([level[r] for r in rows], labels=rows, fontsize=8)
    ax.set_ylim(0.3, len(rows) + 0.9)


# ----------------------------------------------------------------------------- command line

_EPILOG = """\
Each daemon records its node's next N whole iterations of the job (an iteration under way is
skipped) and answers when they are recorded; one trace of a job at a time, at most 1000
iterations and 16000 events per node. Rows per node: iteration, plan (changes), membership
(a fault-tolerant job's new epochs), ready (one mark per layer, from the ranks' stamps), local
sum, compression (top-k groups), wire, write back. Open the file in https://ui.perfetto.dev or chrome://tracing.

examples:
  commd trace --job demo -o trace.json
  commd trace --socket /tmp/node0.sock --socket /tmp/node1.sock --job demo -n 3 \\
      -o trace.json --plot trace.png
"""


def register_command(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "trace",
        help="record a running job's next iterations as a Perfetto/Chrome trace",
        description="Record the next N iterations of a job on this machine's daemons and "
        "write a Chrome trace (JSON): when layers became ready, when groups were summed, on "
        "the wire and written back.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--socket", action="append", metavar="PATH",
        help="a daemon's ipc socket; repeat it for several daemons of this machine (default: "
        f"$COMMD_SOCKET or {DEFAULT_SOCKET})")
    parser.add_argument("--job", required=True, help="the job id (`commd status` lists them)")
    parser.add_argument("-n", "--iterations", type=int, default=5,
                        help="whole iterations to record (default: %(default)s)")
    parser.add_argument("-o", "--output", metavar="FILE.json", default="trace.json",
                        help="where to write the trace (default: %(default)s)")
    parser.add_argument("--plot", metavar="FILE.png",
                        help="also draw one iteration as a Gantt chart (needs matplotlib)")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="seconds the daemons may take to record, at most 600 "
                        "(default: %(default)s)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    sockets = args.socket or [os.environ.get("COMMD_SOCKET", DEFAULT_SOCKET)]
    if len(set(sockets)) != len(sockets):
        print("commd: a --socket is given twice (see --help)", file=sys.stderr)
        return 2
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        print(f"commd: --timeout must be a number of seconds over 0, got {args.timeout:g} "
              "(see --help)", file=sys.stderr)
        return 2
    drawn = None
    try:
        plt = _pyplot() if args.plot else None  # fail before recording anything
        replies = request_traces(sockets, args.job, args.iterations, args.timeout)
        _write(args.output, chrome_trace(replies, sockets))
        if plt is not None:
            drawn = plotted_iteration(replies)
            plot(plt, replies, args.plot, drawn)
    except TraceFailed as exc:
        print(str(exc), file=sys.stderr)
        return 1
    for reply, path in zip(replies, sockets, strict=True):
        if reply.truncated:
            print(f"commd: note: node {reply.node_index} ({path}) recorded "
                  f"{reply.truncated}", file=sys.stderr)
    nodes = "; ".join(f"node {r.node_index}: iterations {r.iterations[0]}-{r.iterations[-1]}"
                      for r in replies)
    events = sum(len(r.events) for r in replies)
    print(f"traced job {args.job!r} ({nodes}): {events} events in {args.output}; open it in "
          f"{PERFETTO}")
    if drawn is not None:
        print(f"iteration {drawn} drawn in {args.plot}")
    return 0


def _write(path: str, trace: dict[str, Any]) -> None:
    try:
        with open(path, "w") as out:
            json.dump(trace, out)
    except OSError as exc:
        raise TraceFailed(f"commd: cannot write {path}: {exc.strerror or exc}") from None
