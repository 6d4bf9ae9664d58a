"""Top-k exchange cost models (Tyagi & Swany, Table I) and `commd costs`."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from commd.cli.costs import JSON_KEYS
from commd.cli.main import build_parser
from commd.cli.main import main as cli_main
from commd.compression.costs import (
    EXCHANGES,
    allgather_s,
    broadcast_s,
    exchange_costs,
    ring_allreduce_s,
    topk_count,
    tree_allreduce_s,
)

RESNET18 = 11_689_512  # torchvision resnet18 parameters
GBPS10 = 8 / 10e9  # 10 Gbps as seconds per byte: 0.8 ns/B
TABLE_VI = ["--nodes", "8", "--latency", "1ms", "--bandwidth", "10Gbps"]


def main(argv: list[str]) -> int:
    """``commd costs ARGV`` in this process."""
    return cli_main(["costs", *argv])


def costs(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# ----------------------------------------------------------------------------- formulas


def test_collectives_match_hand_computed_values() -> None:
    # N = 8 (log2 N = 3), alpha = 1 ms, beta = 1 ns/B, M = 1 MB: M·beta = 1 ms.
    args = (8, 1e-3, 1e-9, 1e6)
    assert ring_allreduce_s(*args) == pytest.approx(14e-3 + 1.75e-3)  # 2·7 α + 2·7/8 Mβ
    assert tree_allreduce_s(*args) == pytest.approx(6e-3 + 6e-3)  # 2·3 α + 2·3 Mβ
    assert broadcast_s(*args) == pytest.approx(3e-3 + 3e-3)  # 3 α + 3 Mβ
    assert allgather_s(*args) == pytest.approx(3e-3 + 7e-3)  # 3 α + 7 Mβ
    # N = 2: one step each way; a ring sends half the bytes twice.
    assert ring_allreduce_s(2, 1e-3, 1e-9, 1e6) == pytest.approx(2e-3 + 1e-3)
    assert tree_allreduce_s(2, 1e-3, 1e-9, 1e6) == pytest.approx(2e-3 + 2e-3)
    # Log base 2, not an integer tree height: N = 6 gives log2 6.
    assert broadcast_s(6, 1.0, 0.0, 0) == pytest.approx(2.584962500721156)


def test_one_node_communicates_nothing() -> None:
    for model in (ring_allreduce_s, tree_allreduce_s, broadcast_s, allgather_s):
        assert model(1, 1e-3, 1e-9, 1e6) == 0.0
    result = exchange_costs(1, 1e-3, 1e-9, 1000, 0.1)
    assert result.allgather_s == result.allreduce_s == result.dense_allreduce_s == 0.0
    assert result.choice == "allgather"  # ties go to allgather


@pytest.mark.parametrize(
    ("nodes", "alpha", "beta", "nbytes"),
    [(0, 1e-3, 1e-9, 1.0), (8, -1e-3, 1e-9, 1.0), (8, 1e-3, float("nan"), 1.0), (8, 0, 0, -1)],
)
def test_collectives_reject_bad_inputs(
    nodes: int, alpha: float, beta: float, nbytes: float
) -> None:
    with pytest.raises(ValueError):
        ring_allreduce_s(nodes, alpha, beta, nbytes)


def test_topk_count() -> None:
    assert topk_count(RESNET18, 0.1) == 1_168_951
    assert topk_count(RESNET18, 1.0) == RESNET18
    assert topk_count(100, 0.001) == 1  # at least one value
    for elements, ratio in [(0, 0.1), (100, 0.0), (100, 1.5), (100, -0.1)]:
        with pytest.raises(ValueError):
            topk_count(elements, ratio)


def test_exchange_costs_are_built_from_the_collectives() -> None:
    nodes, alpha, beta, elements, ratio = 16, 50e-6, 0.1e-9, 1_000_000, 0.01
    result = exchange_costs(nodes, alpha, beta, elements, ratio)
    k = 10_000
    assert (result.k, result.message_bytes) == (k, 4 * k)
    args = (nodes, alpha, beta)
    assert result.allgather_s == pytest.approx(allgather_s(*args, 8 * k))  # values + indices
    leader = broadcast_s(*args, 4 * k)  # the leader's int32 indices
    assert result.allreduce_ring_s == pytest.approx(leader + ring_allreduce_s(*args, 4 * k))
    assert result.allreduce_tree_s == pytest.approx(leader + tree_allreduce_s(*args, 4 * k))
    assert result.dense_allreduce_s == pytest.approx(ring_allreduce_s(*args, 4 * elements))
    assert result.choice in EXCHANGES
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.choice = "allreduce"  # type: ignore[misc]


# ----------------------------------------------------------------------------- the paper


def test_reproduces_table_vi_resnet18() -> None:
    """ResNet-18, ratio 0.1, 8 nodes, 1 ms, 10 Gbps: the paper reports 54 / 35 / 43 ms."""
    result = exchange_costs(8, 1e-3, GBPS10, RESNET18, 0.1)
    assert result.allgather_s == pytest.approx(54e-3, abs=2e-3)
    assert result.allreduce_ring_s == pytest.approx(35e-3, abs=2e-3)
    assert result.allreduce_tree_s == pytest.approx(43e-3, abs=2e-3)
    # By hand (M·β = 4·1,168,951 B · 0.8 ns/B = 3.7406 ms; broadcast = 3 + 3·3.7406 ms):
    mb = 4 * 1_168_951 * 0.8e-9
    assert result.allgather_s == pytest.approx(3e-3 + 7 * 2 * mb)  # 55.37 ms
    assert result.allreduce_ring_s == pytest.approx(14e-3 + 1.75 * mb + 3e-3 + 3 * mb)  # 34.77
    assert result.allreduce_tree_s == pytest.approx(6e-3 + 6 * mb + 3e-3 + 3 * mb)  # 42.67
    assert (result.choice, result.allreduce_algorithm) == ("allreduce", "ring")


def test_choice_flips_with_latency_and_bandwidth() -> None:
    # High latency, high bandwidth: allgather pays log N latencies, allreduce 2(N-1) + log N.
    slow_links = exchange_costs(8, 10e-3, 8 / 100e9, RESNET18, 0.01)
    assert slow_links.choice == "allgather"
    assert slow_links.allgather_s < slow_links.allreduce_s
    # Low latency, low bandwidth: allgather moves (N-1)·2M bytes, ring allreduce far fewer.
    thin_pipes = exchange_costs(8, 1e-6, 8 / 1e9, RESNET18, 0.1)
    assert thin_pipes.choice == "allreduce"
    assert thin_pipes.allreduce_algorithm == "ring"
    assert thin_pipes.allreduce_ring_s < thin_pipes.allgather_s
    # In between, tree allreduce wins: 1.2·α < M·β < 1.88·α for N = 8 (here M·β = 1.5 ms).
    between = exchange_costs(8, 1e-3, 1e-9, 3_750_000, 0.1)
    assert (between.choice, between.allreduce_algorithm) == ("allreduce", "tree")
    assert between.choice_s == between.allreduce_tree_s < between.allgather_s


def test_ratio_flips_the_choice_on_the_papers_network() -> None:
    small = exchange_costs(8, 1e-3, GBPS10, RESNET18, 0.01)
    large = exchange_costs(8, 1e-3, GBPS10, RESNET18, 0.1)
    assert (small.choice, large.choice) == ("allgather", "allreduce")


def test_dense_is_the_reference_never_the_choice() -> None:
    # Ratio 1 with two nodes: dense is cheaper than either compressed exchange.
    result = exchange_costs(2, 1e-3, 1e-9, 1_000_000, 1.0)
    assert result.dense_allreduce_s < min(result.allgather_s, result.allreduce_s)
    assert result.choice in EXCHANGES


# ----------------------------------------------------------------------------- command line


def test_cli_json_has_the_issue_keys(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = costs(
        capsys, *TABLE_VI, "--elements", str(RESNET18), "--ratio", "0.1", "--json"
    )
    assert (code, err) == (0, "")
    report = json.loads(out)
    assert tuple(report) == JSON_KEYS
    assert set(report) == {
        "allgather_s",
        "allreduce_ring_s",
        "allreduce_tree_s",
        "dense_allreduce_s",
        "choice",
    }
    expected = exchange_costs(8, 1e-3, GBPS10, RESNET18, 0.1)
    assert report["allgather_s"] == pytest.approx(expected.allgather_s, rel=1e-12)
    assert report["allreduce_ring_s"] == pytest.approx(35e-3, abs=2e-3)
    assert report["allreduce_tree_s"] == pytest.approx(43e-3, abs=2e-3)
    assert report["choice"] == "allreduce"


def test_cli_sweeps_print_a_list(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = costs(
        capsys,
        "--nodes", "4,8",
        "--latency", "1ms",
        "--bandwidth", "1Gbps,10Gbps",
        "--elements", str(RESNET18),
        "--ratio", "0.001,0.01,0.1",
        "--json",
    )  # fmt: skip
    assert code == 0
    reports: list[dict[str, Any]] = json.loads(out)
    assert len(reports) == 2 * 2 * 3
    assert {(r["nodes"], r["ratio"]) for r in reports} == {
        (n, r) for n in (4, 8) for r in (0.001, 0.01, 0.1)
    }
    for r in reports:
        assert set(JSON_KEYS) <= set(r)
        expected = exchange_costs(
            r["nodes"], r["alpha_s"], r["beta_s_per_byte"], RESNET18, r["ratio"]
        )
        assert r["allgather_s"] == expected.allgather_s
        assert r["allreduce_algorithm"] == expected.allreduce_algorithm


def test_cli_table(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = costs(capsys, *TABLE_VI, "--elements", str(RESNET18), "--ratio", "0.01,0.1")
    assert code == 0
    rows = out.splitlines()
    assert "11,689,512" in rows[0]
    assert rows[-1].split()[-2:] == ["allreduce", "(ring)"]
    assert "55.4 ms" in rows[-1] and "34.8 ms" in rows[-1] and "42.7 ms" in rows[-1]
    assert rows[-2].split()[-1] == "allgather"


@pytest.mark.parametrize(
    "argv",
    [
        [],  # nothing given
        [*TABLE_VI, "--ratio", "0.1"],  # no --elements
        [*TABLE_VI, "--elements", "lots", "--ratio", "0.1"],
        [*TABLE_VI, "--elements", "0", "--ratio", "0.1"],
        [*TABLE_VI, "--elements", "100", "--ratio", "1.5"],
        [*TABLE_VI, "--elements", "100", "--ratio", "0"],
        [*TABLE_VI, "--elements", "100", "--ratio", "tenth"],
        [*TABLE_VI, "--elements", "100", "--ratio", ","],
        ["--nodes", "0", "--latency", "1ms", "--bandwidth", "10Gbps", "--elements", "9",
         "--ratio", "0.1"],
        ["--nodes", "8", "--latency", "1 fortnight", "--bandwidth", "10Gbps", "--elements", "9",
         "--ratio", "0.1"],
        ["--nodes", "8", "--latency", "1ms", "--bandwidth", "0Gbps", "--elements", "9",
         "--ratio", "0.1"],
    ],
)  # fmt: skip
def test_cli_bad_input_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    code, out, err = costs(capsys, *argv)
    assert (code, out) == (2, "")
    assert err.startswith("commd: ") and err.count("\n") == 1, err


def test_cli_usage_error_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main([*TABLE_VI, "--elements", "100", "--ratio", "0.1", "--colour"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("commd: ") and err.count("\n") == 1, err


def test_registered_in_the_commd_command(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["costs", *TABLE_VI, "--elements", "1000", "--ratio", "0.1", "--json"]
    assert cli_main(argv) == 0
    assert json.loads(capsys.readouterr().out)["choice"] in EXCHANGES
    help_text = build_parser().format_help()
    assert "costs" in help_text
