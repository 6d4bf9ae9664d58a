"""Checks of what a rank sends before the job takes it: its hello and its registration.

Each check raises ``JobError`` naming the bad field and what would be right; nothing changes.
Whether the ranks of a job agree with each other is ``agreement``'s business.
"""

from __future__ import annotations

import re

from commd.compression.topk import SUPPORTED_DTYPES as COMPRESSIBLE_DTYPES
from commd.compression.topk import parse_compression
from commd.job import buffers
from commd.job.state import JobContext, JobError
from commd_protocol import DTYPES, OPS, PROTOCOL_VERSION, ErrorCode, Hello, Register
from commd_protocol.address import split_host_port

_JOB_ID = re.compile(r"^[A-Za-z0-9_.:@/+-]{1,128}$")


def check_hello(hello: Hello) -> None:
    if hello.protocol != PROTOCOL_VERSION:
        raise JobError(
            f"protocol version {hello.protocol} is not supported (this daemon speaks "
            f"{PROTOCOL_VERSION}); install matching commd and commd_client versions",
            ErrorCode.VERSION,
        )
    if not _JOB_ID.match(hello.job):
        raise JobError(f"invalid job id {hello.job!r}: use 1-128 of A-Z a-z 0-9 _.:@/+-")
    if not 0 <= hello.rank < hello.world_size:
        raise JobError(f"rank {hello.rank} is outside world size {hello.world_size}")
    if not 0 <= hello.local_rank < hello.local_world_size <= hello.world_size:
        raise JobError(
            f"local rank {hello.local_rank} / local world size {hello.local_world_size} "
            f"do not fit world size {hello.world_size}"
        )
    try:
        split_host_port(hello.coordinator)
    except ValueError:
        raise JobError(f"coordinator must be HOST:PORT, got {hello.coordinator!r}") from None


def check_register(message: Register, context: JobContext, *, several_nodes: bool) -> None:
    """Refuse a registration that cannot be served (its planner is filled in already);
    ``several_nodes``: the job spans nodes, so an engine must take its buffers."""
    problem = buffers.check_fields(message)
    if problem:
        raise JobError(problem)
    if several_nodes:
        try:
            context.engine_for(message.device)
        except ValueError as exc:
            raise JobError(str(exc)) from None
    if message.dtype not in DTYPES:
        raise JobError(f"unsupported dtype {message.dtype!r}; use one of {', '.join(DTYPES)}")
    if message.op not in OPS:
        raise JobError(f"unsupported op {message.op!r}; use one of {', '.join(OPS)}")
    if not message.layers:
        raise JobError("register needs at least one layer")
    for index, layer in enumerate(message.layers):
        if layer.size <= 0:
            raise JobError(f"layer {index} ({layer.name!r}) has size {layer.size}; must be > 0")
    try:
        spec = parse_compression(message.compression)
    except ValueError as exc:
        raise JobError(str(exc)) from None
    if spec is not None and message.dtype not in COMPRESSIBLE_DTYPES:
        raise JobError(
            f"top-k compression needs float32 or float64 gradients, not {message.dtype}"
        )
    try:
        context.validate_planner(message.planner)
    except ValueError as exc:
        raise JobError(str(exc)) from None
