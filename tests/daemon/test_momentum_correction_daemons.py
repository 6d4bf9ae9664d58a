"""Momentum correction end to end: two real daemons and four ranks, every rank's result exact
against the numpy model of tests/compression_reference.py (the unit tests are in
tests/unit/test_momentum_correction.py)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from compression_reference import exchange

from commd.compression.topk import topk_count as k_of
from commd.testing.ranks import JobSpec, collect, start_ranks, value

LAYERS = [("w0", 40), ("b0", 1), ("w1", 64), ("b1", 7)]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("method", ["allreduce", "allgather"])
def test_exact_against_numpy_through_two_daemons(start_daemon: Any, method: str) -> None:
    nodes = [start_daemon(), start_daemon()]
    ratio, momentum = 0.1, 0.9
    spec = JobSpec(f"topk-momentum-{method}", nodes, 2, LAYERS, op="sum", iterations=4,
                   planner="wfbp", compression=f"topk:{ratio}:{method}:momentum={momentum}")
    results = collect(start_ranks(spec))
    for result in results:
        assert "error" not in result, result
    residuals = {i: [np.zeros(n, np.float32) for _ in nodes] for i, (_, n) in enumerate(LAYERS)}
    velocities = {i: [np.zeros(n, np.float32) for _ in nodes]
                  for i, (_, n) in enumerate(LAYERS)}
    without = {i: [np.zeros(n, np.float32) for _ in nodes] for i, (_, n) in enumerate(LAYERS)}
    differs = False
    for iteration in range(spec.iterations):
        for index, (_, size) in enumerate(LAYERS):
            sums = [sum(value(r, iteration, index, size).astype(np.float32)
                        for r in (2 * node, 2 * node + 1)) for node in range(len(nodes))]
            k = k_of(size, ratio)
            want = exchange(sums, residuals[index], k, method, iteration, velocities[index],
                            momentum)
            plain = exchange(sums, without[index], k, method, iteration)
            differs = differs or not np.array_equal(want, plain)
            for result in results:
                np.testing.assert_array_equal(
                    np.array(result["iterations"][iteration][index], dtype=np.float32), want,
                    err_msg=f"rank {result['rank']} iteration {iteration} layer {index}",
                )
    assert differs  # the velocity changed what was sent: the test can tell it is missing
