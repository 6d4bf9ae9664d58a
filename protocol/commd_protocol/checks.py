"""Checks of values that both sides (and every node) must refuse alike: job ids, layer lists,
dtypes and ops. Each returns '' when the value is fine, else what is wrong, in words."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence

from .address import split_host_port
from .limits import MAX_LAYER_ELEMENTS
from .messages import DEVICES, DTYPES, FAULT_TOLERANCE, OPS, Layer

JOB_ID = re.compile(r"^[A-Za-z0-9_.:@/+-]{1,128}$")
MAX_NAME_CHARS = 1024  # a layer name; PyTorch's longest parameter paths are ~200


def job_id_problem(job: str) -> str:
    if JOB_ID.match(job):
        return ""
    return f"invalid job id {job!r}: use 1-128 of A-Z a-z 0-9 _.:@/+-"


def layers_problem(layers: Sequence[Layer], max_layers: int | None = None) -> str:
    if not layers:
        return "register needs at least one layer"
    if max_layers is not None and len(layers) > max_layers:
        return f"{len(layers)} layers is over this daemon's limit of {max_layers} (max_layers)"
    names: set[str] = set()
    for index, layer in enumerate(layers):
        if not 0 < layer.size <= MAX_LAYER_ELEMENTS:
            return f"layer {index} ({layer.name[:100]!r}) has size {layer.size}; must be " \
                   "> 0 and not over 2**40"
        problem = rows_problem(layer.rows, layer.size)
        if problem:
            return f"layer {index} ({layer.name[:100]!r}) has rows {layer.rows}; {problem}"
        if len(layer.name) > MAX_NAME_CHARS:
            return f"layer {index}'s name is {len(layer.name)} characters; at most " \
                   f"{MAX_NAME_CHARS}"
        if layer.name in names:
            return f"layer {index}'s name {layer.name!r} is used twice; layer names must differ"
        names.add(layer.name)
    return ""


def rows_problem(rows: int, size: int) -> str:
    """'' when ``rows`` can be the rows of a layer of ``size`` elements seen as a matrix
    (0: a vector, or not known), else what is wrong, in words."""
    if not isinstance(rows, int) or isinstance(rows, bool):
        return f"rows must be an int, not {type(rows).__name__}"
    if not 0 <= rows <= size:
        return f"must be between 0 (a vector) and the layer's size {size}"
    if rows and size % rows:
        return f"must divide the layer's size {size} (a matrix of rows x size / rows)"
    return ""


def layout_problem(dtype: str, op: str, device: str) -> str:
    if dtype not in DTYPES:
        return f"unsupported dtype {dtype!r}; use one of {', '.join(DTYPES)}"
    if op not in OPS:
        return f"unsupported op {op!r}; use one of {', '.join(OPS)}"
    if device not in DEVICES:
        return f"unsupported device {device!r}; use one of {', '.join(DEVICES)}"
    return ""


def tolerance_problem(fault_tolerance: str, min_world_size: int, world_size: int,
                      device: str) -> str:
    """'' when a job's fault-tolerance options can be served, else what is wrong."""
    if fault_tolerance not in FAULT_TOLERANCE:
        return (f"unsupported fault_tolerance {fault_tolerance[:40]!r}; use one of "
                f"{', '.join(FAULT_TOLERANCE)}")
    if not 1 <= min_world_size <= max(1, world_size):
        return f"min_world_size {min_world_size} must be between 1 and the world size {world_size}"
    if fault_tolerance == "continue" and device != "cpu":
        return ('fault_tolerance="continue" serves host (CPU) buffers only for now; '
                "GPU jobs fail as with \"fail\"")
    return ""


def ranks_problem(ranks: Sequence[int], world_size: int) -> str:
    if world_size < 1:
        return f"world size {world_size} must be at least 1"
    if not ranks:
        return "at least one rank is needed"
    outside = sorted(r for r in ranks if not 0 <= r < world_size)
    if outside:
        return f"ranks {outside[:10]} are outside world size {world_size}"
    if len(set(ranks)) != len(ranks):
        return f"ranks {sorted(ranks)[:20]} name a rank twice"
    return ""


def finite(values: Iterable[float], *, minimum: float = 0.0) -> bool:
    """Every value is a finite number >= ``minimum``."""
    return all(math.isfinite(v) and v >= minimum for v in values)


MAX_PEER_ADDRESS_CHARS = 300  # "host:port", a DNS name and a port


def address_problem(what: str, address: str) -> str:
    """'' when ``address`` is a daemon's ``HOST:PORT`` (IPv6 in brackets), else what is wrong
    with ``what`` (its length first: a long one is never parsed nor echoed back)."""
    if len(address) > MAX_PEER_ADDRESS_CHARS:
        return f"{what} must be HOST:PORT, got {len(address)} characters"
    try:
        _, port = split_host_port(address)
    except ValueError:
        return f"{what} must be HOST:PORT, got {address!r}"
    return "" if 0 < port < 65536 else f"{what} must be HOST:PORT, got port {port}"


def roster_problem(roster: Sequence[object], nodes: int, world_size: int) -> str:
    """'' when a tolerant job's roster (``RosterEntry`` rows) fits ``nodes`` nodes of a
    ``world_size``-rank job, else what is wrong: a node turns to these addresses when its
    coordinator is lost, so none may be absurd."""
    if len(roster) > nodes:
        return f"a roster of {len(roster)} nodes for {nodes}"
    for entry in roster:
        peer, ranks = getattr(entry, "peer", ""), getattr(entry, "ranks", [])
        if len(peer) > MAX_PEER_ADDRESS_CHARS:
            return f"a roster address of {len(peer)} characters"
        if not ranks or any(not 0 <= rank < world_size for rank in ranks):
            return f"a roster entry with ranks {list(ranks)[:10]} outside 0..{world_size - 1}"
    return ""
