"""Node-local arithmetic on host buffers: summing local ranks, scaling, copying back.

numpy has no bfloat16, so bfloat16 buffers (raw uint16 words) are widened to float32,
summed there, and rounded back to nearest-even — the same result torch gives.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def _bf16_to_f32(words: np.ndarray) -> np.ndarray:
    return (words.astype(np.uint32) << 16).view(np.float32)


def _f32_to_bf16(values: np.ndarray, out: np.ndarray) -> None:
    bits = values.view(np.uint32)
    rounded = bits + (np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1)))
    np.right_shift(rounded, 16, out=rounded)
    out[...] = rounded.astype(np.uint16)


def sum_into(target: np.ndarray, sources: Sequence[np.ndarray], dtype: str) -> None:
    """target += every source, elementwise."""
    if dtype == "bfloat16":
        total = _bf16_to_f32(target)
        for source in sources:
            total += _bf16_to_f32(source)
        _f32_to_bf16(total, target)
        return
    for source in sources:
        np.add(target, source, out=target)


def scale(buffer: np.ndarray, factor: float, dtype: str) -> None:
    """buffer *= factor (used for avg: the engines sum, the daemon divides)."""
    if dtype == "bfloat16":
        values = _bf16_to_f32(buffer)
        values *= np.float32(factor)
        _f32_to_bf16(values, buffer)
        return
    if dtype == "float16":  # float16(1/3) is off by 2e-4: scale in float32, round once
        buffer[...] = buffer.astype(np.float32) * np.float32(factor)
        return
    np.multiply(buffer, buffer.dtype.type(factor), out=buffer)


def copy_to(targets: Sequence[np.ndarray], source: np.ndarray) -> None:
    for target in targets:
        np.copyto(target, source)
