"""The flat gradient buffer's layout: layers in backward order, so groups are contiguous."""

from __future__ import annotations

from collections.abc import Sequence


def backward_offsets(sizes: Sequence[int]) -> list[int]:
    """Element offset of each layer (forward index) when the last layer comes first."""
    offsets = [0] * len(sizes)
    position = 0
    for index in reversed(range(len(sizes))):
        offsets[index] = position
        position += sizes[index]
    return offsets


def group_span(
    group: Sequence[int], sizes: Sequence[int], offsets: Sequence[int]
) -> tuple[int, int]:
    """(start, stop) element range of a group of adjacent layers in the flat buffer."""
    lowest, highest = min(group), max(group)
    return offsets[highest], offsets[lowest] + sizes[lowest]
