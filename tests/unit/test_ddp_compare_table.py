"""bench/ddp_compare.py's compression table: the step against torch DDP and PowerSGD, and the
streams whose final loss stays within the issue's 5 % of dense's on the same stream."""

from __future__ import annotations

from bench_scripts import load_bench_script

bench = load_bench_script("ddp_compare.py", "bench_ddp_compare")
Outcome, Variant = bench.Outcome, bench.Variant


def outcome(ms: list[float], finals: list[float], held: float = 1.0) -> object:
    """Streams whose loss curves end at ``finals`` (the last LOSS_TAIL steps at that loss)."""
    curves = [[2.0] * 5 + [final] * bench.LOSS_TAIL for final in finals]
    return Outcome(means_ms=ms, curves=curves, held_out=[held] * len(finals),
                   ran=["allgather@0.04"] * len(finals))


def cells(table: tuple[list[str], list[list[str]]]) -> dict[str, list[str]]:
    """The rows of ``variant_rows`` by variant."""
    return {row[0]: row[1:] for row in table[1]}


def test_the_step_against_torch_ddp_and_powersgd_and_the_streams_within_five_percent() -> None:
    table = bench.variant_rows({
        Variant("torch"): outcome([100.0, 100.0], [1.0, 1.0]),
        Variant("torch", "powersgd"): outcome([50.0, 50.0], [1.03, 1.03]),
        Variant("commd", "none"): outcome([100.0, 100.0], [1.0, 2.0]),
        # stream 0: +4 % (within), stream 1: +6 % (not)
        Variant("commd", "topk:auto"): outcome([40.0, 40.0], [1.04, 2.12]),
    })
    header = " | ".join(table[0])
    assert "× PowerSGD" in header and "streams ≤ +5%" in header
    row = cells(table)["commd topk:auto"]
    assert row[:3] == ["40.0 (40–40)", "0.40", "0.80"]
    assert row[5] == "1 of 2"
    assert cells(table)["commd none"][5] == "2 of 2"


def test_without_powersgd_or_with_other_streams_those_cells_are_dashes() -> None:
    table = bench.variant_rows({
        Variant("commd", "none"): outcome([100.0, 100.0], [1.0, 1.0]),
        Variant("commd", "topk:0.04"): outcome([40.0], [1.0]),  # one stream of two
        Variant("commd", "topk:auto"): Outcome(),  # failed: no step measured
    })
    rows = cells(table)
    assert rows["commd topk:0.04"][2] == "-" and rows["commd topk:0.04"][5] == "-"
    assert rows["commd topk:auto"][0] == "failed"
    assert len({len(row) for row in rows.values()}) == 1  # every row has every column


def test_the_results_file_reads_back_as_the_same_table() -> None:
    links = {"1gbit": {
        Variant("torch"): outcome([100.0, 90.0], [1.0, 1.1]),
        Variant("torch", "powersgd"): outcome([50.0, 55.0], [1.03, 1.2]),
        Variant("commd", "topk:auto:momentum=0.9"): outcome([40.0, 41.0], [1.04, 1.1]),
    }}
    back = bench.links_from_json(bench.links_json(links))
    assert list(back["1gbit"]) == list(links["1gbit"])
    assert bench.variant_rows(back["1gbit"]) == bench.variant_rows(links["1gbit"])
