"""Planners that ignore timing: per layer, all at once, and size-threshold buckets.

All take ``(sizes_bytes, backward_s, cost)`` so that they are interchangeable with the
timing-aware planners, and return groups in communication order (highest layers first).
"""

from __future__ import annotations

from collections.abc import Sequence

from commd.plan.cost import LinearCost
from commd.plan.timeline import Groups, check_layers

__all__ = [
    "DDP_BUCKET_CAP_BYTES",
    "DDP_FIRST_BUCKET_BYTES",
    "HOROVOD_FUSION_THRESHOLD_BYTES",
    "ddp",
    "fixed",
    "horovod",
    "syncea",
    "wfbp",
]

# PyTorch DDP: torch.distributed._DEFAULT_FIRST_BUCKET_BYTES = 1024 * 1024, and
# bucket_cap_mb=25 is turned into bytes as 25 * 1024 * 1024 (binary MiB, not 25e6).
DDP_FIRST_BUCKET_BYTES = 1024 * 1024
DDP_BUCKET_CAP_BYTES = 25 * 1024 * 1024
# Horovod: HOROVOD_FUSION_THRESHOLD defaults to 128 * 1024 * 1024 bytes.
HOROVOD_FUSION_THRESHOLD_BYTES = 128 * 1024 * 1024


def wfbp(sizes_bytes: Sequence[int], backward_s: Sequence[float], cost: LinearCost) -> Groups:
    """Wait-free backpropagation: every layer is all-reduced alone as soon as it is ready."""
    check_layers(sizes_bytes, backward_s)
    return [[layer] for layer in range(len(sizes_bytes) - 1, -1, -1)]


def syncea(sizes_bytes: Sequence[int], backward_s: Sequence[float], cost: LinearCost) -> Groups:
    """SyncEASGD: one all-reduce of everything after backward has finished."""
    check_layers(sizes_bytes, backward_s)
    return [list(range(len(sizes_bytes)))] if len(sizes_bytes) else []


def fixed(
    sizes_bytes: Sequence[int],
    backward_s: Sequence[float],
    cost: LinearCost,
    *,
    threshold_bytes: int,
) -> Groups:
    """Fill groups with adjacent layers, in backward order, up to ``threshold_bytes``.

    A group never exceeds the threshold unless it is a single layer larger than it, which then
    travels alone (Horovod's fusion rule, with layers fused in backward order).
    """
    check_layers(sizes_bytes, backward_s)
    if threshold_bytes <= 0:
        raise ValueError(f"threshold_bytes must be > 0, got {threshold_bytes!r}")
    groups: Groups = []
    top = len(sizes_bytes) - 1  # highest layer of the group being filled
    filled = 0
    for layer in range(len(sizes_bytes) - 1, -1, -1):
        if layer < top and filled + sizes_bytes[layer] > threshold_bytes:
            groups.append(list(range(layer + 1, top + 1)))
            top, filled = layer, 0
        filled += sizes_bytes[layer]
    if sizes_bytes:
        groups.append(list(range(0, top + 1)))
    return groups


def ddp(
    sizes_bytes: Sequence[int],
    backward_s: Sequence[float],
    cost: LinearCost,
    *,
    first_bucket_bytes: int = DDP_FIRST_BUCKET_BYTES,
    bucket_cap_bytes: int = DDP_BUCKET_CAP_BYTES,
) -> Groups:
    """PyTorch DistributedDataParallel's buckets (``compute_bucket_assignment_by_size``).

    Layers are taken in backward order; a bucket is closed as soon as it holds at least its
    limit, so unlike ``fixed`` a bucket may overshoot by its last layer. The first bucket's
    limit is 1 MiB (so that communication starts early), every later one 25 MiB. DDP also
    splits buckets by dtype and device, which a profile does not describe.
    """
    check_layers(sizes_bytes, backward_s)
    if first_bucket_bytes <= 0 or bucket_cap_bytes <= 0:
        raise ValueError("DDP bucket limits must be > 0 bytes")
    groups: Groups = []
    limit = first_bucket_bytes
    top = len(sizes_bytes) - 1
    filled = 0
    for layer in range(len(sizes_bytes) - 1, -1, -1):
        filled += sizes_bytes[layer]
        if filled >= limit:
            groups.append(list(range(layer, top + 1)))
            top, filled, limit = layer - 1, 0, bucket_cap_bytes
    if top >= 0:
        groups.append(list(range(0, top + 1)))
    return groups


def horovod(sizes_bytes: Sequence[int], backward_s: Sequence[float], cost: LinearCost) -> Groups:
    """Horovod's tensor fusion with its default 128 MiB threshold (cycle timing not modelled)."""
    return fixed(sizes_bytes, backward_s, cost, threshold_bytes=HOROVOD_FUSION_THRESHOLD_BYTES)
