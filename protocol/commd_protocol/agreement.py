"""Whether two registrations of one job agree: the first difference, in words.

Every rank of a job must register the same layers (names, sizes and matrix rows), dtype,
op, planner, compression, device and profiling. The daemons check it twice: a node for its
local ranks (``Register``), the coordinator across nodes (``PeerJoin``).
"""

from __future__ import annotations

from .messages import Layer, Register
from .peer import PeerJoin


def describe_difference(a: Register | PeerJoin, b: Register | PeerJoin) -> str:
    """'' when two registrations agree, else the first difference in words."""
    if a.dtype != b.dtype:
        return f"dtype {a.dtype} vs {b.dtype}"
    if a.op != b.op:
        return f"op {a.op} vs {b.op}"
    if a.planner != b.planner:
        return f"planner {a.planner!r} vs {b.planner!r}"
    if a.compression != b.compression:
        return f"compression {a.compression!r} vs {b.compression!r}"
    if a.device != b.device:
        return f"buffers on {a.device} vs {b.device}"
    if a.profile != b.profile:
        return f"profile {a.profile} vs {b.profile}"
    if a.fault_tolerance != b.fault_tolerance:
        return f"fault_tolerance {a.fault_tolerance!r} vs {b.fault_tolerance!r}"
    if a.min_world_size != b.min_world_size:
        return f"min_world_size {a.min_world_size} vs {b.min_world_size}"
    for index, (left, right) in enumerate(zip(a.layers, b.layers, strict=False)):
        if left != right:
            if (left.name, left.size) == (right.name, right.size):
                return (
                    f"first differing layer is {index}: {left.name!r} ({left.size} elements) "
                    f"has {_rows(left)} vs {_rows(right)}; every rank must give it the same "
                    "shape"
                )
            return (
                f"first differing layer is {index}: {left.name!r} ({left.size} elements) vs "
                f"{right.name!r} ({right.size} elements)"
            )
    if len(a.layers) != len(b.layers):
        return f"{len(a.layers)} layers vs {len(b.layers)} layers"
    return ""


def _rows(layer: Layer) -> str:
    """A layer's matrix view in words: "rows 10 (10 x 13)", or "rows 0 (a vector)"."""
    if not layer.rows:
        return "rows 0 (a vector)"
    return f"rows {layer.rows} ({layer.rows} x {layer.size // layer.rows})"
