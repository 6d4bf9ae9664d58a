"""An independent numpy model of commd's top-k exchanges over several nodes (for tests)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


def topk(error: np.ndarray, k: int) -> np.ndarray:
    """Largest |error| first; among equal magnitudes the lower index (a stable sort)."""
    return np.sort(np.argsort(-np.abs(error), kind="stable")[:k])


def exchange(node_sums: Sequence[np.ndarray], residuals: list[np.ndarray], k: int,
             method: str, iteration: int, velocities: list[np.ndarray] | None = None,
             momentum: float = 0.0) -> np.ndarray:
    """One group of one iteration: returns the dense result; updates ``residuals`` (and with
    momentum correction ``velocities``: u = m·u + S, then E = R + u)."""
    if velocities is not None:
        for node, total in enumerate(node_sums):
            velocities[node] = velocities[node] * velocities[node].dtype.type(momentum) + total
        node_sums = velocities
    errors = [s + r for s, r in zip(node_sums, residuals, strict=True)]
    result = np.zeros_like(errors[0])
    if method == "allreduce":
        leader = iteration % len(errors)
        chosen = topk(errors[leader], k)
        for node, error in enumerate(errors):
            result[chosen] += error[chosen]
            residuals[node] = error.copy()
            residuals[node][chosen] = 0
    else:
        for node, error in enumerate(errors):
            chosen = topk(error, k)
            sent = error[chosen]
            if error.dtype == np.float32 and len(errors) > 1:  # the compact wire: bfloat16
                sent = bfloat16(sent)
            np.add.at(result, chosen, sent)
            residuals[node] = error.copy()
            residuals[node][chosen] = error[chosen] - sent  # what the rounding left
    return result


def bfloat16(values: np.ndarray) -> np.ndarray:
    """float32 rounded to bfloat16 (to nearest, ties to even) by torch, back in float32."""
    import torch

    return torch.from_numpy(values.copy()).to(torch.bfloat16).to(torch.float32).numpy()


@dataclass
class PowerSgdState:
    """The reference's memory between iterations: each node's error and each layer's Q."""

    errors: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)  # (node, layer)
    qs: dict[int, np.ndarray] = field(default_factory=dict)


def powersgd_reference(node_inputs: Sequence[Sequence[np.ndarray]],
                       shapes: Sequence[tuple[int, ...]], rank: int, start: int,
                       state: PowerSgdState, iteration: int, share: float,
                       min_rate: float = 2.0) -> list[np.ndarray]:
    """One iteration of PowerSGD over the nodes, one group per layer (a planner such as wfbp),
    written as torch's hook reads, per layer: M = S + E; P = Σ M Q; P orthonormalised
    (Gram-Schmidt); Q = Σ Mᵀ P; the sum is P Qᵀ; E = M − share · sum. Uncompressed layers
    (vectors, or where (n + m)·r·min_rate ≥ n·m) are summed exactly, E likewise; before
    ``start`` every layer is summed and E stays zero. The first Q of layer l is
    ``default_rng([0, l, 0]).standard_normal`` orthonormalised. Returns the sums per layer."""
    results = []
    for layer, shape in enumerate(shapes):
        inputs = [node[layer] for node in node_inputs]
        if iteration < start:
            results.append(sum(inputs))
            continue
        ms = [value + state.errors.get((node, layer), 0) for node, value in enumerate(inputs)]
        n = shape[0] if len(shape) >= 2 else 0
        m = inputs[0].size // n if n else 0
        r = min(n, m, rank) if n else 0
        if not n or (n + m) * r * min_rate >= n * m:
            total = sum(ms)
        else:
            if layer not in state.qs:
                first = np.random.default_rng([0, layer, 0]).standard_normal((m, r),
                                                                              dtype=np.float32)
                state.qs[layer] = _gram_schmidt(first)
            q = _gram_schmidt(state.qs[layer])
            p = _gram_schmidt(sum(mm.reshape(n, m) @ q for mm in ms))
            q_sum = sum(mm.reshape(n, m).T @ p for mm in ms)
            state.qs[layer] = q_sum
            total = (p @ q_sum.T).reshape(-1).astype(np.float32)
        for node, mm in enumerate(ms):
            state.errors[(node, layer)] = mm - np.float32(share) * total
        results.append(total)
    return results


def _gram_schmidt(matrix: np.ndarray) -> np.ndarray:
    out = matrix.copy()
    for i in range(out.shape[1]):
        norm = np.linalg.norm(out[:, i])
        out[:, i] = out[:, i] / norm if norm > 0 else 0
        for j in range(i + 1, out.shape[1]):
            out[:, j] -= (out[:, i] @ out[:, j]) * out[:, i]
    return out
