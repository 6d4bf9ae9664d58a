"""Launch every rank of a torch run and read back the record each left (``rank{N}.pt``): the
one check that the launch worked and every rank reported without an error."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from commd.testing.processes import run_launchers, run_stock_launchers


def launch_for_records(label: str, commands: Sequence[Sequence[str]],
                       envs: Sequence[Mapping[str, str]], log: Path, timeout_s: float,
                       out: Path, ranks: int, stock: bool) -> list[dict[str, Any]]:
    """Run ``commands`` (their output in ``log``; a ``stock`` torch baseline gets torch's
    teardown retry) and return ranks 0..``ranks``-1's records from ``out``; an assertion
    naming ``label`` and the log's tail when anything failed."""
    log.write_bytes(b"")
    launch_all = run_stock_launchers if stock else run_launchers
    problem = launch_all(commands, envs, [log] * len(commands), timeout_s)
    tail = log.read_text(errors="replace")[-6000:]
    assert not problem, f"{label}: {problem}\n{tail}"
    records = []
    for rank in range(ranks):
        path = out / f"rank{rank}.pt"
        assert path.exists(), f"{label}: rank {rank} left no record\n{tail}"
        record: dict[str, Any] = torch.load(path)
        assert "error" not in record, f"{label}: rank {rank}: {record['error']}\n{tail}"
        records.append(record)
    return records
