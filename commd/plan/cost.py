"""Cost models for one all-reduce: ``time(M bytes) = alpha + beta * M``.

Everything here is a pure function of its arguments; the presets are read-only constants.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, overload

import numpy as np
import numpy.typing as npt

__all__ = [
    "MGWFBP_SIM",
    "NETWORK_PRESETS",
    "LinearCost",
    "NetworkPreset",
    "mgwfbp_sim_cost",
    "network_cost",
    "ring_allreduce_cost",
]


@dataclass(frozen=True)
class LinearCost:
    """An all-reduce of ``M`` bytes takes ``alpha_s + beta_s_per_byte * M`` seconds.

    Both terms must be finite and non-negative: the optimal planner relies on costs that grow
    with the message (a fitted model with a slightly negative intercept should be clamped).
    """

    alpha_s: float
    beta_s_per_byte: float

    def __post_init__(self) -> None:
        for field, value in (("alpha_s", self.alpha_s), ("beta_s_per_byte", self.beta_s_per_byte)):
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise ValueError(f"{field} must be a number, got {value!r}")
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{field} must be finite and >= 0, got {value!r}")
            # Store plain floats so that cost(int) is always a float, never an int or np scalar.
            object.__setattr__(self, field, float(value))

    @overload
    def __call__(self, nbytes: int | float) -> float: ...

    @overload
    def __call__(self, nbytes: npt.NDArray[Any]) -> npt.NDArray[np.float64]: ...

    def __call__(self, nbytes: int | float | npt.NDArray[Any]) -> float | npt.NDArray[np.float64]:
        return self.alpha_s + self.beta_s_per_byte * nbytes


def ring_allreduce_cost(nodes: int, latency_s: float, bandwidth_bytes_per_s: float) -> LinearCost:
    """Ring all-reduce over ``nodes`` peers: 2(N-1) steps, each moving M/N bytes.

    a = 2(N-1)·latency, b = 2(N-1)/N / bandwidth (Thakur et al.; Table I of Tyagi & Swany).
    One node communicates nothing, so N = 1 costs zero.
    """
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise ValueError(f"nodes must be an integer >= 1, got {nodes!r}")
    if not math.isfinite(latency_s) or latency_s < 0:
        raise ValueError(f"latency must be finite and >= 0 seconds, got {latency_s!r}")
    if not math.isfinite(bandwidth_bytes_per_s) or bandwidth_bytes_per_s <= 0:
        raise ValueError(f"bandwidth must be finite and > 0 bytes/s, got {bandwidth_bytes_per_s!r}")
    if nodes == 1:
        return LinearCost(0.0, 0.0)
    steps = 2 * (nodes - 1)
    return LinearCost(steps * latency_s, steps / nodes / bandwidth_bytes_per_s)


def mgwfbp_sim_cost(nodes: int) -> LinearCost:
    """The cost model of the MG-WFBP authors' simulator (K80 cluster, 10GbE).

    a = 2·n·45.25 µs and b = 2(n-1)/n · 1.2/(9 GiB/s) + (n-1)/n · 160/64e9 s/byte
    (the authors' simulator; Shi, Chu, Li, MG-WFBP, INFOCOM 2019, and docs/planner.md). One
    node costs zero, as for the ring.
    """
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise ValueError(f"nodes must be an integer >= 1, got {nodes!r}")
    if nodes == 1:
        return LinearCost(0.0, 0.0)
    n = nodes
    alpha = 2 * n * 45.25e-6
    beta = 2 * (n - 1) / n * 1.2 / (9 * 2**30) + (n - 1) / n * 160 / 64e9
    return LinearCost(alpha, beta)


@dataclass(frozen=True)
class NetworkPreset:
    """Per-hop figures of one network, turned into a ring all-reduce cost by ``network_cost``."""

    name: str
    latency_s: float
    bandwidth_bytes_per_s: float
    description: str


# Nominal line rates; latencies are typical one-way small-message latencies of a TCP stack
# (kernel + NIC + one switch) on that link class. They are starting points for what-if
# questions: measured alpha/beta (commd status, or --alpha/--beta) always beat them.
NETWORK_PRESETS: MappingProxyType[str, NetworkPreset] = MappingProxyType(
    {
        p.name: p
        for p in (
            NetworkPreset("1gbe", 50e-6, 1e9 / 8, "1 Gbit/s Ethernet, TCP: 50 µs, 125 MB/s"),
            NetworkPreset("10gbe", 25e-6, 10e9 / 8, "10 Gbit/s Ethernet, TCP: 25 µs, 1.25 GB/s"),
            NetworkPreset("25gbe", 15e-6, 25e9 / 8, "25 Gbit/s Ethernet, TCP: 15 µs, 3.125 GB/s"),
            NetworkPreset("100gbe", 5e-6, 100e9 / 8, "100 Gbit/s Ethernet/RoCE: 5 µs, 12.5 GB/s"),
        )
    }
)

# Name under which network_cost() offers the MG-WFBP simulator's model.
MGWFBP_SIM = "mgwfbp-sim"


def network_cost(name: str, nodes: int) -> LinearCost:
    """Cost of one all-reduce across ``nodes`` nodes on a named network.

    ``name`` is a key of NETWORK_PRESETS (ring all-reduce) or ``"mgwfbp-sim"``.
    """
    if name == MGWFBP_SIM:
        return mgwfbp_sim_cost(nodes)
    preset = NETWORK_PRESETS.get(name)
    if preset is None:
        valid = ", ".join([*NETWORK_PRESETS, MGWFBP_SIM])
        raise ValueError(f"unknown network {name!r}; valid networks: {valid}")
    return ring_allreduce_cost(nodes, preset.latency_s, preset.bandwidth_bytes_per_s)
