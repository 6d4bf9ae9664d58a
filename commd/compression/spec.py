"""What a job asks for in ``compression=``: ``none``, ``topk:RATIO[:EXCHANGE][:momentum=M]``
or ``topk:auto``, parsed into a CompressionSpec (ValueError naming what is wrong)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from commd.compression.costs import EXCHANGES

__all__ = ["MAX_SPEC_CHARS", "CompressionSpec", "parse_compression"]

_SPEC = re.compile(r"^topk:(?P<ratio>auto|[0-9.eE+-]+)(?::(?P<exchange>[a-z]+))?"
                   r"(?::momentum=(?P<momentum>[0-9.eE+-]+))?$")
MAX_SPEC_CHARS = 64  # longer than any valid spec: refused before the pattern runs


@dataclass(frozen=True)
class CompressionSpec:
    ratio: float | None  # None: the daemon chooses (`topk:auto`)
    exchange: str  # "allgather", "allreduce" or "auto"
    # Momentum correction (DGC, without factor masking): the node keeps the velocity
    # u = m·u + S and sparsifies R + u, so the optimizer must run without momentum. 0: off.
    momentum: float = 0.0

    def __str__(self) -> str:
        ratio = "auto" if self.ratio is None else f"{self.ratio:g}"
        momentum = f":momentum={self.momentum:g}" if self.momentum else ""
        return f"topk:{ratio}:{self.exchange}{momentum}"


def parse_compression(text: str) -> CompressionSpec | None:
    """``none`` → None; ``topk:RATIO[:EXCHANGE][:momentum=M]``; ValueError naming what is
    wrong."""
    if text in ("", "none"):
        return None
    match = _SPEC.match(text.strip()) if len(text) <= MAX_SPEC_CHARS else None
    if not match:
        raise ValueError(
            f"compression {text[:MAX_SPEC_CHARS]!r} is not understood; use 'none', "
            "'topk:RATIO', 'topk:RATIO:EXCHANGE' or 'topk:auto', optionally followed by "
            "':momentum=M' (EXCHANGE: allgather, allreduce, auto; M in [0, 1))"
        )
    exchange = match["exchange"] or "auto"
    if exchange not in (*EXCHANGES, "auto"):
        raise ValueError(f"compression exchange {exchange!r}: use allgather, allreduce or auto")
    momentum = 0.0
    if match["momentum"] is not None:
        momentum = _number("momentum", match["momentum"])
        if not 0 <= momentum < 1:
            raise ValueError(f"compression momentum must be in [0, 1), got {momentum:g}")
    if match["ratio"] == "auto":
        return CompressionSpec(None, exchange, momentum)
    ratio = _number("ratio", match["ratio"])
    if not 0 < ratio <= 1:
        raise ValueError(f"compression ratio must be in (0, 1], got {ratio:g}")
    return CompressionSpec(ratio, exchange, momentum)


def _number(name: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"compression {name} {text!r} is not a number") from None
    if not math.isfinite(value):
        raise ValueError(f"compression {name} must be finite, got {text!r}")
    return value
