"""What a job asks for in ``compression=``, parsed into a spec (ValueError naming what is
wrong):

* ``none``: dense all-reduce of every group;
* ``topk:RATIO[:EXCHANGE][:momentum=M]`` or ``topk:auto[...]``: top-k sparsification
  (``CompressionSpec``);
* ``powersgd:RANK[:start=N][:min_rate=X][:feedback=0|1][:warm=0|1][:epsilon=E][:seed=S]``:
  low-rank compression (``LowRankSpec``, torch's ``PowerSGDState`` settings by other names);
* ``fp16``: dense, float16 on the wire (``HalfSpec``);
* ``auto``: the daemons choose, measuring the running job (``AutoSpec``,
  ``commd.coordinator.auto_choice``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from commd.compression.costs import EXCHANGES

__all__ = [
    "AUTO_RANK",
    "HALF",
    "MAX_SPEC_CHARS",
    "AutoSpec",
    "CompressionSpec",
    "HalfSpec",
    "LowRankSpec",
    "Spec",
    "parse_compression",
]

_SPEC = re.compile(r"^topk:(?P<ratio>auto|[0-9.eE+-]+)(?::(?P<exchange>[a-z]+))?"
                   r"(?::momentum=(?P<momentum>[0-9.eE+-]+))?$")
_LOW_RANK = re.compile(r"^powersgd:(?P<rank>[0-9]+)(?P<options>(?::[a-z_]+=[0-9.eE+-]+)*)$")
MAX_SPEC_CHARS = 128  # longer than any valid spec: refused before a pattern runs
MAX_RANK = 64  # a larger rank sends about as much as the dense gradients of most layers
MAX_START = 10**9


@dataclass(frozen=True)
class CompressionSpec:
    """``topk:RATIO[:EXCHANGE][:momentum=M]`` or ``topk:auto[...]``: top-k sparsification keeping
    ``ratio`` of each compressed group's elements (None: the coordinator picks it), exchanged by
    allgather or allreduce (``auto``: the coordinator's trials choose). ``str`` gives the whole
    spec."""

    ratio: float | None  # None: the daemon chooses (`topk:auto`)
    exchange: str  # "allgather", "allreduce" or "auto"
    # Momentum correction (DGC, without factor masking): the node keeps the velocity
    # u = m·u + S and sparsifies R + u, so the optimizer must run without momentum. 0: off.
    momentum: float = 0.0

    def __str__(self) -> str:
        ratio = "auto" if self.ratio is None else f"{self.ratio:g}"
        momentum = f":momentum={self.momentum:g}" if self.momentum else ""
        return f"topk:{ratio}:{self.exchange}{momentum}"


@dataclass(frozen=True)
class LowRankSpec:
    """PowerSGD (Vogels et al., NeurIPS 2019) as torch's ``PowerSGDState`` configures it; the
    defaults are torch's except ``start`` (torch: 1000), which the DDP wrapper sets from a
    registered hook's state."""

    rank: int  # matrix_approximation_rank
    start: int = 10  # start_powerSGD_iter: iterations before it run dense
    min_rate: float = 2.0  # min_compression_rate: a layer compressed only where it saves more
    feedback: bool = True  # use_error_feedback
    warm: bool = True  # warm_start: Q carried from one iteration to the next
    epsilon: float = 0.0  # orthogonalization_epsilon
    seed: int = 0  # random_seed: the first Q (the same on every node)

    def __str__(self) -> str:
        return (f"powersgd:{self.rank}:start={self.start}:min_rate={self.min_rate:g}"
                f":feedback={int(self.feedback)}:warm={int(self.warm)}"
                f":epsilon={self.epsilon:g}:seed={self.seed}")


HALF = "fp16"  # a plan's exchange for a group in float16 on the wire


@dataclass(frozen=True)
class HalfSpec:
    """``fp16``: every group dense, in float16 on the wire, with torch's
    ``fp16_compress_hook``'s arithmetic (divided by the job's ranks before the sum)."""

    def __str__(self) -> str:
        return "fp16"


AUTO_RANK = 4  # the low-rank candidate's rank under `auto` (PowerSGD's usual choice)


@dataclass(frozen=True)
class AutoSpec:
    """``auto``: dense, or PowerSGD at ``AUTO_RANK`` where the measured network pays for it
    (the coordinator's ``AutoChoice`` decides; every node can run either)."""

    def __str__(self) -> str:
        return "auto"

    @property
    def low_rank(self) -> LowRankSpec:
        """The low-rank exchange ``auto`` may run: from whenever the coordinator says."""
        return LowRankSpec(AUTO_RANK, start=0)


Spec = CompressionSpec | LowRankSpec | HalfSpec | AutoSpec


def parse_compression(text: str) -> Spec | None:
    """``none`` → None; a top-k or a low-rank spec; ValueError naming what is wrong."""
    if text in ("", "none"):
        return None
    if len(text) > MAX_SPEC_CHARS:
        raise ValueError(f"compression {text[:40]!r}… is not understood: it is over "
                         f"{MAX_SPEC_CHARS} characters; use 'none', 'topk:…' or 'powersgd:…'")
    if text.strip() == "auto":
        return AutoSpec()
    if text.strip() == "fp16":
        return HalfSpec()
    if text.startswith("powersgd"):
        return _low_rank(text)
    match = _SPEC.match(text.strip())
    if not match:
        raise ValueError(
            f"compression {text!r} is not understood; use 'none', 'auto', 'fp16', "
            "'topk:RATIO', 'topk:RATIO:EXCHANGE' or 'topk:auto', optionally followed by "
            "':momentum=M' (EXCHANGE: allgather, allreduce, auto; M in [0, 1)), "
            "or 'powersgd:RANK' (see docs/compression.md)"
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


def _low_rank(text: str) -> LowRankSpec:
    match = _LOW_RANK.match(text)
    if not match:
        raise ValueError(
            f"compression {text!r} is not understood; use 'powersgd:RANK' optionally followed "
            "by ':start=N', ':min_rate=X', ':feedback=0|1', ':warm=0|1', ':epsilon=E', "
            "':seed=S' (e.g. 'powersgd:4:start=10')"
        )
    rank = int(match["rank"])
    if not 1 <= rank <= MAX_RANK:
        raise ValueError(f"powersgd rank must be in 1..{MAX_RANK}, got {rank}")
    options: dict[str, str] = {}
    for item in match["options"].split(":")[1:]:
        key, _, value = item.partition("=")
        if key in options:
            raise ValueError(f"powersgd option {key!r} is given twice")
        options[key] = value
    unknown = sorted(set(options) - {"start", "min_rate", "feedback", "warm", "epsilon", "seed"})
    if unknown:
        raise ValueError(f"powersgd option {unknown[0]!r} is not known; use start, min_rate, "
                         "feedback, warm, epsilon, seed")
    spec = LowRankSpec(
        rank,
        start=_integer("start", options.get("start", "10"), 0, MAX_START),
        min_rate=_number("min_rate", options.get("min_rate", "2")),
        feedback=_flag("feedback", options.get("feedback", "1")),
        warm=_flag("warm", options.get("warm", "1")),
        epsilon=_number("epsilon", options.get("epsilon", "0")),
        seed=_integer("seed", options.get("seed", "0"), 0, 2**32 - 1),
    )
    if spec.min_rate < 1:
        raise ValueError(f"powersgd min_rate must be ≥ 1, got {spec.min_rate:g}")
    if not 0 <= spec.epsilon < 1:
        raise ValueError(f"powersgd epsilon must be in [0, 1), got {spec.epsilon:g}")
    if (spec.feedback or spec.warm) and spec.start < 2:
        # torch's rule: PowerSGD can only start after DDP's first two iterations
        raise ValueError("powersgd start must be ≥ 2 with error feedback or warm start "
                         f"(torch's rule), got {spec.start}")
    return spec


def _integer(name: str, text: str, lowest: int, highest: int) -> int:
    if not text.isdigit():
        raise ValueError(f"powersgd {name} {text!r} is not a whole number")
    value = int(text)
    if not lowest <= value <= highest:
        raise ValueError(f"powersgd {name} must be in {lowest}..{highest}, got {value}")
    return value


def _flag(name: str, text: str) -> bool:
    if text not in ("0", "1"):
        raise ValueError(f"powersgd {name} must be 0 or 1, got {text!r}")
    return text == "1"


def _number(name: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"compression {name} {text!r} is not a number") from None
    if not math.isfinite(value):
        raise ValueError(f"compression {name} must be finite, got {text!r}")
    return value
