"""PowerSGD in the daemon: end to end through real daemons against an independent numpy model
(tests/compression_reference.py), per node of two ranks and per node of one."""

from __future__ import annotations

import numpy as np
import pytest
from compression_reference import PowerSgdState, powersgd_reference

from commd.testing.ranks import JobSpec, collect, start_ranks, value

# (name, shape): matrices that compress at rank 2 (8×5 does not: (8 + 5)·2·2 ≥ 40) and whose
# test values (commd.testing.ranks.value) are of rank above 2, and vectors
SHAPES = [("w0", (12, 7)), ("b0", (1,)), ("w1", (8, 5)), ("w2", (16, 3, 3)), ("b2", (7,))]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("ranks_per_node", [1, 2])
def test_powersgd_matches_the_numpy_model_through_two_daemons(start_daemon,
                                                               ranks_per_node: int) -> None:
    nodes = [start_daemon(), start_daemon()]
    start = 2
    spec = JobSpec(f"powersgd-{ranks_per_node}", nodes, ranks_per_node,
                   [(name, list(shape)) for name, shape in SHAPES], op="sum", iterations=13,
                   planner="wfbp", compression=f"powersgd:2:start={start}")
    results = collect(start_ranks(spec))
    for result in results:
        assert "error" not in result, result.get("error")
    world = spec.world_size
    state = PowerSgdState()
    sizes = [int(np.prod(shape)) for _, shape in SHAPES]
    for iteration in range(spec.iterations):
        sums = [[sum(value(r, iteration, index, size).astype(np.float32)
                     for r in range(node * ranks_per_node, (node + 1) * ranks_per_node))
                 for index, size in enumerate(sizes)] for node in range(len(nodes))]
        want = powersgd_reference(sums, [shape for _, shape in SHAPES], 2, start, state,
                                  iteration, ranks_per_node / world)
        for result in results:
            for index, expected in enumerate(want):
                got = np.array(result["iterations"][iteration][index], dtype=np.float32)
                np.testing.assert_allclose(
                    got, expected, rtol=2e-4, atol=2e-3 * float(np.abs(expected).max() + 1),
                    err_msg=f"rank {result['rank']} iteration {iteration} layer {index}")
        # every rank holds the same result, bit for bit
        first = results[0]["iterations"][iteration]
        assert all(r["iterations"][iteration] == first for r in results)
    # from the start iteration on the big matrix is approximated, not exact; the job ran
    # past a report round (its nodes' reports carry the low-rank gain)
    last = spec.iterations - 1
    exact = sum(value(r, last, 0, sizes[0]).astype(np.float32) for r in range(world))
    assert not np.allclose(np.array(results[0]["iterations"][last][0]), exact)
    assert not any(results[0]["dense"][start:])


@pytest.mark.timeout(180)
def test_fp16_sends_float16_and_sums_as_torchs_hook_does(start_daemon) -> None:
    """``compression="fp16"``: every group dense in float16 on the wire, divided by the
    job's ranks first; the test's values (small integers, quarters of them) are exact in
    float16, so the result is the dense sum, bit for bit."""
    nodes = [start_daemon(), start_daemon()]
    spec = JobSpec("half-wire", nodes, 2, [(name, list(shape)) for name, shape in SHAPES],
                   op="sum", iterations=4, planner="wfbp", compression="fp16",
                   overrides={r: {"status_at_end": True} for r in range(4)})
    results = collect(start_ranks(spec))
    sizes = [int(np.prod(shape)) for _, shape in SHAPES]
    for result in results:
        assert "error" not in result, result.get("error")
        assert set(result["status"]["exchanges"]) == {"fp16"}
        for iteration in range(spec.iterations):
            for index, size in enumerate(sizes):
                want = sum(value(r, iteration, index, size).astype(np.float32)
                           for r in range(4))
                np.testing.assert_array_equal(
                    np.array(result["iterations"][iteration][index], dtype=np.float32), want)
