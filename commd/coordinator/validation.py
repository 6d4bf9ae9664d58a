"""Checks of what peer daemons send the coordinator, as strict as a client's messages: a join
or a report that does not fit is refused before it touches any job's state."""

from __future__ import annotations

from commd.compression.topk import parse_compression
from commd.plan import get_planner
from commd_protocol import PROTOCOL_VERSION, PeerJoin, PeerProfile
from commd_protocol.checks import (
    finite,
    job_id_problem,
    layers_problem,
    layout_problem,
    ranks_problem,
)
from commd_protocol.peer import ALLGATHER, ALLREDUCE

MAX_HOST_CHARS = 255  # a DNS name
MAX_CPU_S_PER_ELEMENT = 1e-3  # a millisecond per element is no CPU, it is a lie
MAX_GROUP_OVERHEAD_S = 60.0  # nor is a minute of overhead per group
# A node reports a row per ratio its round ran (one, two across a plan change) and per smaller
# explored ratio it worked out (three): far fewer than this.
MAX_GAIN_ROWS = 32


def join_problem(join: PeerJoin) -> str:
    """'' when a join is well-formed, else what is wrong with it."""
    if join.protocol != PROTOCOL_VERSION:
        return (f"protocol version {join.protocol} is not supported (this daemon speaks "
                f"{PROTOCOL_VERSION}); run the same commd version on every node")
    problem = (job_id_problem(join.job) or ranks_problem(join.ranks, join.world_size)
               or layout_problem(join.dtype, join.op, join.device) or layers_problem(join.layers))
    if problem:
        return problem
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
    if profile.round < 0:
        return f"round {profile.round} is negative"
    if profile.ready_offsets_s and (len(profile.ready_offsets_s) != layers
                                    or not finite(profile.ready_offsets_s)):
        return f"ready_offsets_s must be {layers} finite offsets >= 0"
    for row in profile.comm:
        if len(row) not in (4, 5) or not finite(row[2:4]) or not finite(row[:2], minimum=-1e18):
            return f"comm row {row[:6]} must be [iteration, group, bytes, seconds(, kind)]"
        if len(row) == 5 and row[4] not in (ALLREDUCE, ALLGATHER):
            return f"comm row {row[:6]} has an unknown kind {row[4]!r}"
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
