"""Bench results as data: every file under bench/results/ says where its numbers came from,
and docs/benchmarks.md is what bench/report.py renders from them (never parsed back). Writing
results (which asks git for the commit) and the report's command line: tests/daemon's
test_bench_results.py."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
from bench_scripts import load_bench_script

from commd.cli.tables import markdown_table
from commd.testing.results import read_results

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
COMMIT = re.compile(r"[0-9a-f]{7,40}(\+dirty)?")

report = load_bench_script("report.py", "bench_report")


def test_docs_benchmarks_md_is_what_the_report_renders() -> None:
    assert report.render() == (ROOT / "docs" / "benchmarks.md").read_text()
    assert report.main(["--check"]) == 0  # tests/daemon runs the command itself


def assert_provenance(data: dict[str, Any]) -> None:
    assert data["command"].startswith(".venv/bin/python bench/"), data["command"]
    assert COMMIT.fullmatch(data["commit"]), data["commit"]
    assert data["machine"]["cpus"] >= 1 and data["machine"]["python"]


@pytest.mark.parametrize("path", sorted(RESULTS.glob("*.json")), ids=lambda path: path.name)
def test_every_results_file_says_what_made_it(path: Path) -> None:
    data = read_results(path)
    if path.name == "hardening-overhead.json":  # runs of two trees, each with its own command
        for run in data["runs"]:
            assert run["command"].startswith(".venv/bin/python bench/overhead.py")
            assert run["machine"]["cpus"] >= 1
        return
    assert_provenance(data)


def test_the_results_the_report_tabulates_have_their_fields() -> None:
    replay = read_results(RESULTS / "replay.json")
    assert {row["planner"] for row in replay["rows"]} == {"wfbp", "syncea", "fixed-25MB",
                                                           "mgwfbp", "optimal"}
    for row in replay["rows"]:
        assert row["measured_s"] > 0 and row["predicted_s"] > 0 and row["groups"] >= 1
    overhead = read_results(RESULTS / "overhead.json")
    pooled = overhead["summary"]["pooled_rank0"]
    for mode in overhead["ready"]:
        assert pooled[mode]["ratio"] > 0 and pooled[mode]["median_ms"] > 0
    quality = read_results(RESULTS / "planner-quality.json")
    for row in quality["results"]:  # the model's optimum is never beaten
        assert min(p["ratio_to_optimal"] for p in row["planners"].values()) >= 1 - 1e-9


def test_every_section_of_the_page_has_its_results_file() -> None:
    """A section whose file is missing renders as "No results yet": the committed page has
    none, so every bench the page shows has run and its numbers are data."""
    lines = report.TEMPLATE.read_text().splitlines()
    markers = [match.group(1) for line in lines if (match := report.MARKER.match(line))]
    sections = [name for name in markers if name not in report.WITHOUT_RESULTS]
    assert "ddp-compare" in sections and "topk-offline" in sections
    assert [name for name in sections if not (RESULTS / f"{name}.json").exists()] == []
    assert "No results yet" not in (ROOT / "docs" / "benchmarks.md").read_text()


def test_the_offline_top_k_results_hold_what_the_docs_say() -> None:
    """design/compression.md's reading of them: momentum correction beats error feedback at
    every ratio, and both get closer to dense as the ratio grows."""
    data = read_results(RESULTS / "topk-offline.json")
    loss = {(row["variant"], row["ratio"]): row["final_loss"] for row in data["rows"]}
    ratios = sorted({ratio for _, ratio in loss})
    assert all(loss["mc", ratio] < loss["ef", ratio] for ratio in ratios)
    assert loss["ef", ratios[0]] > loss["ef", ratios[-1]] > data["dense_final_loss"]
    assert loss["mc", ratios[-1]] > data["dense_final_loss"]


def test_a_changed_number_changes_the_page(tmp_path: Path) -> None:
    results = tmp_path / "results"
    shutil.copytree(RESULTS, results)
    data = json.loads((results / "replay.json").read_text())
    data["rows"][0]["measured_s"] = 12.3456
    (results / "replay.json").write_text(json.dumps(data))
    page = report.render(results=results)
    assert page != (ROOT / "docs" / "benchmarks.md").read_text()
    assert "12345.6" in page


def test_a_missing_results_file_is_said_not_skipped(tmp_path: Path) -> None:
    template = tmp_path / "page.md"
    template.write_text("# t\n\n{{replay}}\n")
    page = report.render(template=template, results=tmp_path)
    assert "No results yet" in page and "replay.json" in page


def test_markdown_table_pads_aligns_and_refuses_a_short_row() -> None:
    assert markdown_table(["name", "ms"], [["a", 1.5], ["long", 12]], "lr").splitlines() == [
        "| name |  ms |", "|------|----:|", "| a    | 1.5 |", "| long |  12 |"]
    with pytest.raises(ValueError, match="1 cells under 2 headers"):
        markdown_table(["name", "ms"], [["a"]])
