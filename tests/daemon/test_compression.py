"""Top-k compression: the pieces, and exact end-to-end results against a numpy model."""

from __future__ import annotations

import numpy as np
import pytest
from compression_reference import exchange, topk

from commd.compression.topk import CompressionSpec, parse_compression, select_topk
from commd.compression.topk import topk_count as k_of
from commd.testing.processes import finish
from commd.testing.ranks import JobSpec, collect, start_ranks, value


@pytest.mark.parametrize(
    ("text", "spec"),
    [("none", None), ("topk:0.01", CompressionSpec(0.01, "auto")),
     ("topk:0.1:allgather", CompressionSpec(0.1, "allgather")),
     ("topk:auto", CompressionSpec(None, "auto")),
     ("topk:auto:allreduce", CompressionSpec(None, "allreduce"))],
)
def test_parse(text: str, spec: CompressionSpec | None) -> None:
    assert parse_compression(text) == spec


@pytest.mark.parametrize("bad", ["topk", "topk:0", "topk:2", "topk:x", "topk:0.1:ring", "zip"])
def test_parse_rejects(bad: str) -> None:
    with pytest.raises(ValueError, match="compression"):
        parse_compression(bad)


def test_select_topk_matches_the_reference_and_handles_edges() -> None:
    rng = np.random.default_rng(1)
    for _ in range(200):
        data = rng.integers(-5, 5, size=int(rng.integers(1, 50))).astype(np.float32)
        k = int(rng.integers(1, data.size + 1))
        np.testing.assert_array_equal(select_topk(data, k), topk(data, k))
    assert select_topk(np.array([3.0], dtype=np.float32), 1).tolist() == [0]
    assert select_topk(np.zeros(4, dtype=np.float32), 2).tolist() == [0, 1]
    assert select_topk(np.arange(3, dtype=np.float32), 7).tolist() == [0, 1, 2]
    assert k_of(5, 0.001) == 1 and k_of(1000, 0.01) == 10


LAYERS = [("w0", 40), ("b0", 1), ("w1", 64), ("b1", 7)]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("method", ["allreduce", "allgather"])
def test_exact_against_numpy_through_two_daemons(start_daemon, method: str) -> None:
    nodes = [start_daemon(), start_daemon()]
    ratio = 0.1
    spec = JobSpec(f"topk-{method}", nodes, 2, LAYERS, op="sum", iterations=4, planner="wfbp",
                   compression=f"topk:{ratio}:{method}")
    results = collect(start_ranks(spec))
    for result in results:
        assert "error" not in result, result
        assert not any(result["dense"]), result["dense"]  # every iteration ran top-k
    # The model: per layer (one group each), nodes sum their two ranks, then exchange.
    residuals = {i: [np.zeros(n, np.float32) for _ in nodes] for i, (_, n) in enumerate(LAYERS)}
    for iteration in range(spec.iterations):
        for index, (_, size) in enumerate(LAYERS):
            sums = [sum(value(r, iteration, index, size).astype(np.float32)
                        for r in (2 * node, 2 * node + 1)) for node in range(len(nodes))]
            want = exchange(sums, residuals[index], k_of(size, ratio), method, iteration)
            for result in results:
                np.testing.assert_array_equal(
                    np.array(result["iterations"][iteration][index], dtype=np.float32), want,
                    err_msg=f"rank {result['rank']} iteration {iteration} layer {index}",
                )


@pytest.mark.timeout(180)
def test_topk_auto_changes_ratio_at_the_same_iteration_everywhere(start_daemon) -> None:
    nodes = [start_daemon(), start_daemon()]
    layers = [("w", 4096), ("b", 64)]
    spec = JobSpec("topk-auto", nodes, 1, layers, op="avg", iterations=25, planner="syncea",
                   compression="topk:auto",
                   overrides={r: {"skip_results": True} for r in range(2)})
    results = collect(start_ranks(spec))
    for result in results:
        assert "error" not in result, result
    plans = [result["plans"] for result in results]
    assert plans[0] == plans[1]
    # Exploration: 0.1 from iteration 0, the pick from 12 (the nodes worked out the gains of
    # 0.01 and 0.001 from their selections), then what its trials run — the same everywhere.
    assert plans[0][0] < plans[0][12] <= plans[0][22], plans[0]
    assert len(set(plans[0][:12])) == 1 and len(set(plans[0][12:22])) == 1


@pytest.mark.timeout(180)
def test_ddp_with_compression_keeps_ranks_identical(start_daemon) -> None:
    import os
    import subprocess
    import sys
    from pathlib import Path

    nodes = [start_daemon(), start_daemon()]
    script = Path(__file__).resolve().parents[2] / "examples" / "train.py"
    processes = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0",
               "LOCAL_WORLD_SIZE": "1", "COMMD_SOCKET": nodes[rank].socket,
               "COMMD_COORDINATOR": nodes[0].address, "COMMD_JOB": "ddp-topk",
               "COMMD_COMPRESSION": "topk:0.05", "OMP_NUM_THREADS": "1"}
        processes.append(subprocess.Popen([sys.executable, str(script), "--steps", "4"],
                                          env=env, stdout=subprocess.PIPE, text=True))
    outputs = []
    for done in finish(processes, 150):  # a hang fails the test; every rank is killed
        assert done.returncode == 0, done.stdout
        outputs.append(done.stdout)
    sums = [line.rsplit("checksum", 1)[1].strip() for out in outputs
            for line in out.splitlines() if "done:" in line]
    assert len(sums) == 2 and sums[0] == sums[1], outputs


@pytest.mark.timeout(180)
def test_auto_measures_the_exchanges_and_runs_the_fastest(start_daemon) -> None:
    # 150 iterations (15 report rounds): the trials end in the first five; on a loaded
    # machine a noisy round may start one re-measuring (a few rounds more), which must have
    # ended too when the status is read (CI once read 'measuring' after 60).
    nodes = [start_daemon(), start_daemon()]
    spec = JobSpec("topk-measured", nodes, 1, [("w", 200_000), ("b", 1000)], op="avg",
                   iterations=150, planner="syncea", compression="topk:0.01",
                   overrides={0: {"skip_results": True, "status_at_end": True},
                              1: {"skip_results": True}})
    results = collect(start_ranks(spec))
    for result in results:
        assert "error" not in result, result
    assert results[0]["plans"] == results[1]["plans"], (results[0]["plans"], results[1]["plans"])
    # Whether an iteration ran dense and carried nothing top-k had held back (the DDP
    # wrapper's momentum correction reads it) is the same on every rank. Within a plan
    # version it never goes back: a compressed one is never dense; a dense one after top-k
    # is not until the backlog has gone out a share per iteration, and then is.
    assert results[0]["dense"] == results[1]["dense"]
    pairs = list(zip(results[0]["plans"], results[0]["dense"], strict=True))
    for version in {v for v, _ in pairs}:
        flags = [d for v, d in pairs if v == version]
        assert flags == sorted(flags), (version, flags)
    job = results[0]["status"]
    # a failure shows the plan reasons (why trials were re-opened), not the status alone
    reasons = [line for line in nodes[0].log().splitlines() if " plan v" in line]
    assert job["selection"] == "measured", (job, reasons[-8:])
    measured = {c["name"]: c["measured_s"] for c in job["candidates"]
                if c["measured_s"] is not None}
    assert len(measured) >= 2, job["candidates"]  # the model's best and at least one more
    running = job["exchanges"][0]
    name = "dense" if running == "dense" else f"{running}@0.01"
    assert measured[name] <= min(measured.values()) * 1.05, (name, measured)
    assert len(set(results[0]["plans"])) >= 2  # it did switch between candidates


def test_the_model_depends_on_the_leader() -> None:
    """Guards the exact tests above: with these data, rotating the leader changes results."""
    sums = [sum(value(r, 0, 0, 40).astype(np.float32) for r in (2 * n, 2 * n + 1))
            for n in range(2)]
    led_by_0 = exchange(sums, [np.zeros(40, np.float32)] * 2, 4, "allreduce", iteration=0)
    led_by_1 = exchange(sums, [np.zeros(40, np.float32)] * 2, 4, "allreduce", iteration=1)
    assert not np.array_equal(led_by_0, led_by_1)
