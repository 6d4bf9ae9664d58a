"""Top-k compression with error feedback, at node level (after the local ranks are summed).

Pure numpy: the selection, the residual update and the scatter of received pairs. The
collectives that carry the values live in ``exchange.py``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from commd.compression.costs import EXCHANGES, topk_count

__all__ = [
    "RATIO_RANGE",
    "CompressionSpec",
    "accumulate_pairs",
    "parse_compression",
    "select_topk",
    "topk_count",
]

RATIO_RANGE = (0.001, 0.1)  # where `topk:auto` searches
SUPPORTED_DTYPES = ("float32", "float64")

_SPEC = re.compile(r"^topk:(?P<ratio>auto|[0-9.eE+-]+)(?::(?P<exchange>[a-z]+))?$")


@dataclass(frozen=True)
class CompressionSpec:
    ratio: float | None  # None: the daemon chooses (`topk:auto`)
    exchange: str  # "allgather", "allreduce" or "auto"

    def __str__(self) -> str:
        ratio = "auto" if self.ratio is None else f"{self.ratio:g}"
        return f"topk:{ratio}:{self.exchange}"


def parse_compression(text: str) -> CompressionSpec | None:
    """``none`` → None; ``topk:RATIO[:EXCHANGE]``; ValueError naming what is wrong."""
    if text in ("", "none"):
        return None
    match = _SPEC.match(text.strip())
    if not match:
        raise ValueError(
            f"compression {text!r} is not understood; use 'none', 'topk:RATIO', "
            "'topk:RATIO:EXCHANGE' or 'topk:auto' (EXCHANGE: allgather, allreduce, auto)"
        )
    exchange = match["exchange"] or "auto"
    if exchange not in (*EXCHANGES, "auto"):
        raise ValueError(f"compression exchange {exchange!r}: use allgather, allreduce or auto")
    if match["ratio"] == "auto":
        return CompressionSpec(None, exchange)
    try:
        ratio = float(match["ratio"])
    except ValueError:
        raise ValueError(f"compression ratio {match['ratio']!r} is not a number") from None
    if not 0 < ratio <= 1:
        raise ValueError(f"compression ratio must be in (0, 1], got {ratio:g}")
    return CompressionSpec(ratio, exchange)


def select_topk(error: np.ndarray, k: int) -> np.ndarray:
    """int32 indices of the k largest |error|, ascending (ties: the lower index wins)."""
    if k >= error.size:
        return np.arange(error.size, dtype=np.int32)
    magnitude = np.abs(error)
    # argpartition is O(n); a stable tie-break keeps every node's choice deterministic.
    chosen = np.argpartition(-magnitude, k - 1, kind="introselect")[:k]
    threshold = magnitude[chosen].min()
    above = np.flatnonzero(magnitude > threshold)
    ties = np.flatnonzero(magnitude == threshold)[: k - above.size]
    return np.sort(np.concatenate([above, ties])).astype(np.int32)


def accumulate_pairs(target: np.ndarray, indices: np.ndarray, values: np.ndarray) -> None:
    """target = 0, then target[i] += v for every received (i, v) pair (repeats add up)."""
    target[...] = 0
    np.add.at(target, indices.astype(np.intp), values)
