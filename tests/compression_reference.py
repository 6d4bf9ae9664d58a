"""An independent numpy model of commd's top-k exchanges over several nodes (for tests)."""

from __future__ import annotations

from collections.abc import Sequence

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
