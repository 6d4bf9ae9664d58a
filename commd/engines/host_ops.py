"""Node-local arithmetic on host buffers: summing local ranks, scaling, copying back.

Every addition of a sum is rounded to the buffer's dtype, as a collective's own additions are
(Gloo's and NCCL's float16 and bfloat16 sums round each pairwise add): the local ranks' sum is
then exactly what the same additions give inside torch.distributed. numpy's float16 add does
this itself (computed in float32, rounded to nearest-even). numpy has no bfloat16, so bfloat16
buffers (raw uint16 words) are widened to float32, added there and rounded back to
nearest-even after each addition: torch's ``c10::BFloat16`` arithmetic, bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def _bf16_to_f32(words: np.ndarray) -> np.ndarray:
    return (words.astype(np.uint32) << 16).view(np.float32)


def _round_to_bf16(values: np.ndarray) -> None:
    """float32 ``values`` rounded in place to the nearest bfloat16 (ties to even), kept in
    float32."""
    bits = values.view(np.uint32)
    bits += np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))
    bits &= np.uint32(0xFFFF0000)


def _f32_to_bf16(values: np.ndarray, out: np.ndarray) -> None:
    bits = values.view(np.uint32)
    rounded = bits + (np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1)))
    np.right_shift(rounded, 16, out=rounded)
    out[...] = rounded.astype(np.uint16)


def sum_into(target: np.ndarray, sources: Sequence[np.ndarray], dtype: str) -> None:
    """target += every source, elementwise, in order; each addition rounded to ``dtype``."""
    if dtype == "bfloat16":
        if not sources:
            return
        total = _bf16_to_f32(target)
        for position, source in enumerate(sources):
            if position:
                _round_to_bf16(total)  # the running sum is a bfloat16, as in torch and Gloo
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
