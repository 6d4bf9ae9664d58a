"""A benchmark's results as data: one JSON file under bench/results/, with where they came from.

Every bench script writes through ``write_results``, so that docs/benchmarks.md (rendered by
bench/report.py) and the tests read numbers, never prose: a new run replaces a file, it does
not append a paragraph."""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from commd.testing.provenance import provenance

REPOSITORY = Path(__file__).resolve().parents[2]
RESULTS = REPOSITORY / "bench" / "results"
PROVENANCE_KEYS = ("command", "commit", "machine")


def results_path(name: str) -> Path:
    """bench/results/``name``.json."""
    return RESULTS / f"{name}.json"


def add_results_option(parser: argparse.ArgumentParser, name: str, *also: str) -> None:
    """``--results PATH``: where ``write_results`` puts the run's results (default
    bench/results/``name``.json, '' for nowhere: a run that is not to replace them). ``also``
    names the other results files a bench writes in other modes, for the help."""
    default = ", ".join(f"bench/results/{n}.json" for n in (name, *also))
    parser.add_argument(
        "--results", metavar="PATH", default=None,
        help=f"where the results go, with the command, commit and machine (default {default}; "
             f"'' writes none)")


def write_results(name: str, payload: Mapping[str, Any], path: str | Path | None = None,
                  argv: list[str] | None = None) -> Path | None:
    """``payload`` with ``command``, ``commit`` and ``machine`` (``provenance(argv)``) added,
    written as JSON to ``path`` (None: bench/results/``name``.json; "": nowhere, returns None).
    The payload's own keys may not hide those three."""
    clash = set(PROVENANCE_KEYS) & set(payload)
    if clash:
        raise ValueError(f"results of {name} may not set {sorted(clash)}: provenance does")
    if path == "":
        return None
    target = results_path(name) if path is None else Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps({**provenance(argv), **payload}, indent=1) + "\n")
    return target


def read_results(path: Path) -> dict[str, Any]:
    """A results file, with its provenance at the top level whichever way it was stored
    (flat, as ``write_results`` does, or under "provenance", as the older benches do)."""
    data: dict[str, Any] = json.loads(path.read_text())
    nested = data.get("provenance")
    if isinstance(nested, dict):
        data = {**{key: nested.get(key) for key in PROVENANCE_KEYS}, **data}
    return data
