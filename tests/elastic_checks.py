"""What every result of bench/elastic.py has, whatever ran: for the committed result
(tests/unit/test_elastic_bench.py) and for a real run (tests/system/test_elastic_bench_run.py)."""

from __future__ import annotations

from typing import Any

from bench_scripts import load_bench_script

bench = load_bench_script("elastic.py", "bench_elastic")


def check_result(result: dict[str, Any]) -> None:
    """The fields every result has, whatever ran."""
    provenance = result["provenance"]
    assert provenance["command"].startswith(".venv/bin/python bench/elastic.py")
    assert "commit" in provenance and provenance["machine"]["cpus"] >= 1
    settings = result["settings"]
    assert (settings["nodes"], settings["ranks_per_node"], settings["victim_rank"]) == (3, 1, 2)
    for run in result["runs"]:
        assert "error" not in run, run["error"]
        assert run["system"] in bench.SYSTEMS and run["fault"] in bench.FAULTS_OF[run["system"]]
        for key in ("stall_s", "to_new_step_s", "steps_lost", "median_step_s", "agree"):
            assert run[key] is not None, key
        assert run["steps_done"] == settings["steps"], "a survivor stopped early"
    for system, faults in result["summary"].items():
        for row in faults.values():
            assert row["repeats"] == settings["repeats"] and row["errors"] == 0, (system, row)
            assert row["agree"] is True, system
