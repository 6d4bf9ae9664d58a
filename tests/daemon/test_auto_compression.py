"""``compression="auto"`` through real daemons: dense and identical to dense on one node; on
two nodes whose step is all communication, low-rank from the same iteration everywhere, and
whatever the measurement then decides, the status says it and the ranks agree."""

from __future__ import annotations

import numpy as np
import pytest

from commd.testing.ranks import JobSpec, collect, start_ranks, value

SHAPES = [("w0", [48, 40]), ("b0", [40]), ("w1", [64, 48]), ("b1", [7])]
ITERATIONS = 45  # report rounds of 10: the first measured at 1, two low-rank ones after


def _run(nodes: list, ranks_per_node: int, compression: str, job: str,
         dtype: str = "float32") -> list[dict]:
    spec = JobSpec(job, nodes, ranks_per_node, SHAPES, dtype=dtype, op="sum",
                   iterations=ITERATIONS,
                   planner="wfbp", compression=compression,
                   overrides={r: {"status_at_end": True}
                              for r in range(len(nodes) * ranks_per_node)})
    results = collect(start_ranks(spec), timeout=150)
    for result in results:
        assert "error" not in result, result.get("error")
    return results


@pytest.mark.timeout(240)
def test_auto_on_one_node_runs_dense_and_gives_densess_result(start_daemon) -> None:
    node = start_daemon()
    auto = _run([node], 2, "auto", "auto-one-node")
    dense = _run([node], 2, "none", "dense-one-node")
    for ours, theirs in zip(auto, dense, strict=True):
        assert ours["iterations"] == theirs["iterations"]  # bit for bit
        assert all(ours["dense"])
        status = ours["status"]
        assert status["compression"] == "auto"
        assert "one node" in status["choice"], status["choice"]
        assert set(status["exchanges"]) == {"dense"}


@pytest.mark.timeout(240)
def test_auto_takes_half_precision_gradients_and_runs_them_dense(start_daemon) -> None:
    nodes = [start_daemon(), start_daemon()]
    auto = _run(nodes, 1, "auto", "auto-half", dtype="bfloat16")
    dense = _run(nodes, 1, "none", "dense-half", dtype="bfloat16")
    for ours, theirs in zip(auto, dense, strict=True):
        assert ours["iterations"] == theirs["iterations"] and all(ours["dense"])
        assert set(ours["status"]["exchanges"]) == {"dense"}


@pytest.mark.timeout(240)
def test_auto_on_two_nodes_of_pure_communication_tries_low_rank_everywhere_at_once(
        start_daemon) -> None:
    nodes = [start_daemon(), start_daemon()]
    results = _run(nodes, 1, "auto", "auto-two-nodes")
    plans = [result["plans"] for result in results]
    assert plans[0] == plans[1]
    ran = [result["dense"] for result in results]
    assert ran[0] == ran[1]
    first_low_rank = ran[0].index(False)  # decided at the first measured round
    assert 10 < first_low_rank <= 13, ran[0]
    for iteration in range(ITERATIONS):
        assert results[0]["iterations"][iteration] == results[1]["iterations"][iteration]
    status = results[0]["status"]
    choice = status["choice"]
    assert "low-rank" in choice and "of the dense step" in choice, choice
    if "back to dense" in choice:
        assert set(status["exchanges"]) == {"dense"}
        # what low-rank held back was sent with the dense groups: every layer's sum over
        # the iterations is every rank's input's, as with dense all along
        for index, (_, shape) in enumerate(SHAPES):
            size = int(np.prod(shape))
            sent = sum(np.array(results[0]["iterations"][t][index]) for t in range(ITERATIONS))
            given = sum(value(r, t, index, size).astype(np.float64)
                        for r in range(2) for t in range(ITERATIONS))
            np.testing.assert_allclose(sent, given, rtol=1e-4)
    else:
        assert "keeps low-rank" in choice and set(status["exchanges"]) == {"lowrank"}
