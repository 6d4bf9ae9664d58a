"""What it costs to exchange top-k compressed gradients, and which exchange is cheaper.

Pure functions only (no I/O, globals or ranks), shared by the daemon and ``commd costs``.

Collective cost models: Table I of Tyagi & Swany, "Flexible Communication for Optimal
Distributed Learning over Unpredictable Networks" (IEEE BigData 2023), with ``log`` = log2,
``N`` nodes, ``alpha`` the latency of one message in seconds, ``beta`` seconds per byte and
``M`` the bytes each node contributes:

    ring allreduce   2(N-1)·alpha + 2(N-1)/N·M·beta
    tree allreduce   2·log N·alpha + 2·log N·M·beta
    broadcast        log N·alpha + log N·M·beta
    allgather        log N·alpha + (N-1)·M·beta

Top-k of a tensor of ``elements`` float32 values at ratio ``r`` keeps
``k = max(1, int(r·elements))`` values; ``M = 4k`` bytes is the size of those values (and
equally of their int32 indices). The exchanges:

    dense            ring allreduce of all 4·elements bytes (the reference, no compression)
    allgather        every node contributes its k values and k indices: allgather of 2M bytes
    allreduce        AR-compatible top-k (STAR: the leader rotates): broadcast the leader's
                     k indices (M bytes), then allreduce the k values there (M bytes), by ring
                     or tree, whichever is cheaper

Counting the indices in the allgather is what reproduces the paper's Table VI. For ResNet-18
(11,689,512 parameters), r = 0.1, N = 8, alpha = 1 ms, 10 Gbps (beta = 0.8 ns/B):
k = 1,168,951, M = 4,675,804 B, M·beta = 3.741 ms, so

    allgather  = 3·1 ms + 7·(2·3.741 ms)             = 3 + 52.37          = 55.4 ms  (paper: 54)
    AR (ring)  = 14·1 ms + 1.75·3.741 ms + broadcast = 14 + 6.55 + 14.22  = 34.8 ms  (paper: 35)
    AR (tree)  = 6·1 ms + 6·3.741 ms + broadcast     = 6 + 22.44 + 14.22  = 42.7 ms  (paper: 43)
    broadcast  = 3·1 ms + 3·3.741 ms                 = 3 + 11.22          = 14.2 ms

An allgather of the values alone (M bytes) would give 29.2 ms, far from the paper's 54.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "EXCHANGES",
    "INDEX_BYTES",
    "VALUE_BYTES",
    "ExchangeCosts",
    "allgather_s",
    "broadcast_s",
    "exchange_costs",
    "ring_allreduce_s",
    "topk_count",
    "tree_allreduce_s",
]

VALUE_BYTES = 4  # float32 gradient values
INDEX_BYTES = 4  # int32 indices (not int64: half the bytes, enough for 2**31 elements)
EXCHANGES = ("allgather", "allreduce")  # the names a user passes as EXCHANGE

Exchange = Literal["allgather", "allreduce"]
AllreduceAlgorithm = Literal["ring", "tree"]


def _check(nodes: int, alpha_s: float, beta_s_per_byte: float, nbytes: float) -> None:
    if nodes < 1:
        raise ValueError(f"nodes must be at least 1, not {nodes}")
    for name, value in (("alpha", alpha_s), ("beta", beta_s_per_byte), ("bytes", nbytes)):
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be finite and >= 0, not {value}")


def ring_allreduce_s(nodes: int, alpha_s: float, beta_s_per_byte: float, nbytes: float) -> float:
    """Ring allreduce of ``nbytes`` per node: ``2(N-1)·alpha + 2(N-1)/N·M·beta``."""
    _check(nodes, alpha_s, beta_s_per_byte, nbytes)
    steps = 2 * (nodes - 1)
    return steps * alpha_s + steps / nodes * nbytes * beta_s_per_byte


def tree_allreduce_s(nodes: int, alpha_s: float, beta_s_per_byte: float, nbytes: float) -> float:
    """Tree allreduce (reduce then broadcast): ``2·log2 N·alpha + 2·log2 N·M·beta``."""
    _check(nodes, alpha_s, beta_s_per_byte, nbytes)
    steps = 2 * math.log2(nodes)
    return steps * alpha_s + steps * nbytes * beta_s_per_byte


def broadcast_s(nodes: int, alpha_s: float, beta_s_per_byte: float, nbytes: float) -> float:
    """Binomial-tree broadcast of ``nbytes``: ``log2 N·alpha + log2 N·M·beta``."""
    _check(nodes, alpha_s, beta_s_per_byte, nbytes)
    steps = math.log2(nodes)
    return steps * alpha_s + steps * nbytes * beta_s_per_byte


def allgather_s(nodes: int, alpha_s: float, beta_s_per_byte: float, nbytes: float) -> float:
    """Allgather where each node contributes ``nbytes``: ``log2 N·alpha + (N-1)·M·beta``."""
    _check(nodes, alpha_s, beta_s_per_byte, nbytes)
    return math.log2(nodes) * alpha_s + (nodes - 1) * nbytes * beta_s_per_byte


def topk_count(elements: int, ratio: float) -> int:
    """How many values top-k keeps: ``max(1, int(ratio·elements))``, for 0 < ratio <= 1."""
    if elements < 1:
        raise ValueError(f"elements must be at least 1, not {elements}")
    if not 0 < ratio <= 1:
        raise ValueError(f"ratio must be in (0, 1], not {ratio}")
    return max(1, int(ratio * elements))


@dataclass(frozen=True)
class ExchangeCosts:
    """Seconds to exchange one top-k compressed tensor by each method, and the cheaper one.

    ``choice`` is an EXCHANGE name: "allgather" or "allreduce" (the AR-compatible top-k with
    ``allreduce_algorithm``, the cheaper of ring and tree). Dense is the uncompressed reference
    and never the choice: whether to compress, and how much, trades accuracy for time and is
    decided by the ratio, not by the exchange. Ties go to allgather, then to ring.
    """

    k: int  # values kept per node
    message_bytes: int  # M = 4k: the k float32 values (the k int32 indices are as big)
    allgather_s: float  # allgather of values + indices (2M bytes per node)
    allreduce_ring_s: float  # broadcast of M index bytes + ring allreduce of M value bytes
    allreduce_tree_s: float  # broadcast of M index bytes + tree allreduce of M value bytes
    dense_allreduce_s: float  # ring allreduce of all 4·elements bytes, no compression
    allreduce_algorithm: AllreduceAlgorithm  # the cheaper of ring and tree
    choice: Exchange  # the cheaper of allgather and allreduce

    @property
    def allreduce_s(self) -> float:
        """The AR-compatible exchange with its cheaper allreduce algorithm."""
        return min(self.allreduce_ring_s, self.allreduce_tree_s)

    @property
    def choice_s(self) -> float:
        """Seconds the chosen exchange takes."""
        return self.allgather_s if self.choice == "allgather" else self.allreduce_s


def exchange_costs(
    nodes: int, alpha_s: float, beta_s_per_byte: float, elements: int, ratio: float
) -> ExchangeCosts:
    """Cost of exchanging top-k of ``elements`` float32 values at ``ratio`` among ``nodes``."""
    k = topk_count(elements, ratio)
    values = k * VALUE_BYTES
    indices = k * INDEX_BYTES
    args = (nodes, alpha_s, beta_s_per_byte)
    gather = allgather_s(*args, values + indices)
    leader = broadcast_s(*args, indices)
    ring = leader + ring_allreduce_s(*args, values)
    tree = leader + tree_allreduce_s(*args, values)
    algorithm: AllreduceAlgorithm = "ring" if ring <= tree else "tree"
    choice: Exchange = "allgather" if gather <= min(ring, tree) else "allreduce"
    return ExchangeCosts(
        k=k,
        message_bytes=values,
        allgather_s=gather,
        allreduce_ring_s=ring,
        allreduce_tree_s=tree,
        dense_allreduce_s=ring_allreduce_s(*args, elements * VALUE_BYTES),
        allreduce_algorithm=algorithm,
        choice=choice,
    )
