"""Whether two registrations of one job agree: the first difference, in words.

Every rank of a job must register the same layers, dtype, op, planner, compression, device
and profiling. The daemons check it twice: a node for its local ranks (``Register``), the
coordinator across nodes (``PeerJoin``).
"""

from __future__ import annotations

from .messages import Register
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
            return (
                f"first differing layer is {index}: {left.name!r} ({left.size} elements) vs "
                f"{right.name!r} ({right.size} elements)"
            )
    if len(a.layers) != len(b.layers):
        return f"{len(a.layers)} layers vs {len(b.layers)} layers"
    return ""
