"""Checks of what peer daemons send the coordinator, as strict as a client's messages: a join
or a report that does not fit is refused before it touches any job's state."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from commd.compression.topk import parse_compression
from commd.plan import get_planner
from commd_protocol import PROTOCOL_VERSION, ErrorCode, PeerHeartbeat, PeerJoin, PeerProfile
from commd_protocol.checks import (
    finite,
    job_id_problem,
    layers_problem,
    layout_problem,
    ranks_problem,
    tolerance_problem,
)
from commd_protocol.dtypes import itemsize
from commd_protocol.limits import MAX_LOCAL_RANKS, count_problem, ranks_bound_problem
from commd_protocol.peer import ALLGATHER, ALLREDUCE

MAX_HOST_CHARS = 255  # a DNS name
MAX_CPU_S_PER_ELEMENT = 1e-3  # a millisecond per element is no CPU, it is a lie
MAX_GROUP_OVERHEAD_S = 60.0  # nor is a minute of overhead per group
# A node reports a row per ratio its round ran (one, two across a plan change) and per smaller
# explored ratio it worked out (three): far fewer than this.
MAX_GAIN_ROWS = 32
# Comm rows carry [iteration, group, bytes] as floats; the planner turns them into ints and
# numpy int64: magnitudes up to 1e18 stay below 2**63.
MAX_COMM_KEY = 1e18
MAX_COMM_SECONDS = 1e6  # a collective timed at over 11 days is no measurement


# What coordinators send (to the daemons of their jobs, on links those daemons opened): on a
# coordinator's own peer port they mean nothing, so they are refused from their tag alone,
# before the body is decoded (a plan's million one-layer groups would cost the loop that).
NOT_FOR_A_COORDINATOR = frozenset({"peer_setup", "peer_plan", "peer_status", "peer_reform",
                                   "peer_resume", "peer_redirect"})



@dataclass(frozen=True)
class JoinLimits:
    """What one forming job may make the coordinator hold: the daemon's own --max-layers and
    --max-job-bytes, the same limits a local registration meets (``check_limits``)."""

    max_layers: int = 65536
    max_job_bytes: int = 1 << 40


def join_problem(join: PeerJoin, limits: JoinLimits = JoinLimits()) -> tuple[str, ErrorCode]:
    """('', …) when a join is well-formed and within ``limits``, else what is wrong with it
    and the code to refuse it with (LIMIT for a join over a limit)."""
    if join.protocol != PROTOCOL_VERSION:
        return (f"protocol version {join.protocol} is not supported (this daemon speaks "
                f"{PROTOCOL_VERSION}); run the same commd version on every node"), ErrorCode.INVALID
    # Sizes first: a join over the limits is refused before any per-layer or per-rank work.
    if len(join.layers) > limits.max_layers:
        return (f"{len(join.layers)} layers is over this coordinator's limit of "
                f"{limits.max_layers} (max_layers)"), ErrorCode.LIMIT
    if len(join.ranks) > MAX_LOCAL_RANKS:
        return (f"{len(join.ranks)} ranks on one node; a daemon serves at most "
                f"{MAX_LOCAL_RANKS}"), ErrorCode.INVALID
    problem = (job_id_problem(join.job) or ranks_bound_problem("world_size", join.world_size)
               or ranks_problem(join.ranks, join.world_size)
               or layout_problem(join.dtype, join.op, join.device) or layers_problem(join.layers)
               or tolerance_problem(join.fault_tolerance, join.min_world_size, join.world_size,
                                    join.device))
    if problem:
        return problem, ErrorCode.INVALID
    nbytes = sum(layer.size for layer in join.layers) * itemsize(join.dtype)
    if nbytes > limits.max_job_bytes:
        return (f"the layers need {nbytes} bytes, over this coordinator's limit of "
                f"{limits.max_job_bytes} bytes per job (max_job_bytes)"), ErrorCode.LIMIT
    return _join_text_problem(join), ErrorCode.INVALID


def _join_text_problem(join: PeerJoin) -> str:
    if not join.host or len(join.host) > MAX_HOST_CHARS:
        return f"engine address {join.host[:40]!r} must be 1-{MAX_HOST_CHARS} characters"
    try:
        parse_compression(join.compression)
        get_planner(join.planner)
    except ValueError as exc:
        return str(exc)
    return ""


def profile_problem(profile: PeerProfile, layers: int) -> str:
    """'' when a report round fits a job of ``layers`` layers, else what is wrong with it."""
    problem = (count_problem("round", profile.round)
               or count_problem("iteration", profile.iteration, -1)
               or count_problem("plan", profile.plan))
    if problem:
        return problem
    if profile.ready_offsets_s and (len(profile.ready_offsets_s) != layers
                                    or not _all_finite(profile.ready_offsets_s)):
        return f"ready_offsets_s must be {layers} finite offsets >= 0"
    if len(profile.gains) > MAX_GAIN_ROWS:
        return f"gains has {len(profile.gains)} rows, at most {MAX_GAIN_ROWS}"
    for row in profile.gains:
        if len(row) != 2 or not finite(row) or not 0 < row[0] <= 1:
            return f"gains row {row[:4]} must be [ratio in (0, 1], gain >= 0]"
    cpu = profile.cpu_s_per_element
    if cpu and (len(cpu) != 3 or not finite(cpu) or max(cpu[:2]) > MAX_CPU_S_PER_ELEMENT
                or cpu[2] > MAX_GROUP_OVERHEAD_S):
        return ("cpu_s_per_element must be [] or [selection s/element, update s/element, "
                "overhead s/group], each >= 0")
    if not finite((profile.measured_comm_s, profile.iteration_s, profile.step_s)):
        return "measured_comm_s, iteration_s and step_s must be finite and >= 0"
    return ""


def heartbeat_problem(beat: PeerHeartbeat, join: PeerJoin) -> str:
    """'' when a heartbeat fits the node's join (its ranks, its layers), else what is wrong:
    the stall inspector reads every beat once a second, so a beat may name each of the
    node's ranks at most once."""
    problem = count_problem("iteration", beat.iteration)
    if problem:
        return problem
    if not finite((beat.waiting_s, beat.wire_s)):
        return "waiting_s and wire_s must be finite and >= 0"
    if len(beat.missing) > len(join.ranks):
        return f"missing has {len(beat.missing)} rows for the node's {len(join.ranks)} ranks"
    ranks, seen = set(join.ranks), set()
    for row in beat.missing:
        if len(row) != 2 or row[0] not in ranks or row[0] in seen \
                or not 0 <= row[1] < len(join.layers):
            return (f"missing row {row[:4]} must be [one of the node's ranks, once; a layer "
                    f"0..{len(join.layers) - 1}]")
        seen.add(row[0])
    return ""


def comm_problem(profile: PeerProfile) -> str:
    """'' when a report's comm rows are well-formed, else the first bad one. Apart from
    ``profile_problem``: a 4 MiB report holds ~90,000 rows, so the coordinator checks them
    with the round's planning, off its event loop."""
    bad = _first_bad_comm_row(profile.comm)
    if bad is None:
        return ""
    row = profile.comm[bad]
    if len(row) == 5 and finite(row[:4], minimum=-MAX_COMM_KEY):
        return f"comm row {row[:6]} has an unknown kind {row[4]!r}"
    return f"comm row {row[:6]} must be [iteration, group, bytes, seconds(, kind)]"


def _all_finite(values: list[float]) -> bool:
    """``finite(values)`` in one numpy pass: a report carries one offset per layer."""
    array = np.asarray(values, dtype=np.float64)
    return bool(np.isfinite(array).all() and (array >= 0).all())


COMM_CHUNK = 2048  # rows per numpy pass: the thread checking them yields between passes


def _first_bad_comm_row(rows: list[list[float]]) -> int | None:
    """``_bad_comm_row`` over ``rows`` in chunks of COMM_CHUNK, so that the planner thread
    checking a 4 MiB report hands the interpreter back to the loop between chunks."""
    for first in range(0, len(rows), COMM_CHUNK):
        bad = _bad_comm_row(rows[first:first + COMM_CHUNK])
        if bad is not None:
            return first + bad
    return None


def _bad_comm_row(rows: list[list[float]]) -> int | None:
    """The index of the first comm row that is not [iteration, group, bytes, seconds(, kind)]
    (keys within ±MAX_COMM_KEY, bytes and seconds finite and >= 0, kind a known one); None
    when all are fine. Checked in numpy, with no Python work per element."""
    if not rows:
        return None
    lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    wrong = np.flatnonzero((lengths != 4) & (lengths != 5))
    if wrong.size:
        return int(wrong[0])
    table = np.full((len(rows), 5), float(ALLREDUCE))
    for width in (4, 5):  # one array per row length: no Python work per row
        where = np.flatnonzero(lengths == width)
        if where.size:
            flat = itertools.chain.from_iterable(rows[i] for i in where.tolist())
            table[where, :width] = np.fromiter(flat, dtype=np.float64,
                                               count=where.size * width).reshape(-1, width)
    with np.errstate(invalid="ignore"):
        ok = (np.isfinite(table).all(axis=1) & (table[:, :2] >= -MAX_COMM_KEY).all(axis=1)
              & (table[:, 2:4] >= 0).all(axis=1) & (table[:, :3] <= MAX_COMM_KEY).all(axis=1)
              & (table[:, 3] <= MAX_COMM_SECONDS)
              & np.isin(table[:, 4], (ALLREDUCE, ALLGATHER)))
    bad = np.flatnonzero(~ok)
    return int(bad[0]) if bad.size else None
