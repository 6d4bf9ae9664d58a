"""Jobs of real ranks against real daemons: a job's spec, its ranks started as processes
(``commd.testing.rank_worker``), their JSON results collected and checked against the values
every rank must see.

Each rank writes small integers (``value``): exact in every dtype, also after summing a few
ranks, so a result is checked element by element (``expected``, ``assert_exact``)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from commd.testing.processes import finish, start_json_worker

WORKER = [sys.executable, "-m", "commd.testing.rank_worker"]


class Node(Protocol):
    """What a job needs of a daemon: where ranks connect, and the coordinator's address."""

    @property
    def socket(self) -> str: ...

    @property
    def address(self) -> str: ...


def value(rank: int, iteration: int, layer: int, size: int) -> np.ndarray:
    """What ``rank`` writes into ``layer`` at ``iteration``. The pattern differs by rank, so
    that nodes disagree on which elements are largest (top-k)."""
    return (rank + 1) * (iteration + 1) + layer + (np.arange(size) * (rank + 1) % 5)


def numel(size: int | list[int]) -> int:
    """A layer's elements, given as a size or (JSON) as its shape."""
    return int(np.prod(size)) if isinstance(size, list) else size


@dataclass
class JobSpec:
    """One job of rank worker processes: its nodes (the first coordinates), ranks per node, layers
    and what every rank registers and runs; ``overrides`` changes a rank's worker spec."""

    job: str
    nodes: Sequence[Node]  # the first coordinates
    ranks_per_node: int
    layers: list[tuple[str, int | list[int]]]  # (name, size) or (name, shape)
    dtype: str = "float32"
    op: str = "sum"
    iterations: int = 3
    planner: str = "wfbp"
    compression: str = "none"
    timeout: float = 60.0
    overrides: dict[int, dict[str, Any]] = field(default_factory=dict)  # per rank

    @property
    def world_size(self) -> int:
        return len(self.nodes) * self.ranks_per_node


def start_ranks(spec: JobSpec) -> list[subprocess.Popen[str]]:
    """Every rank of ``spec`` as a rank worker process; each prints JSON lines."""
    processes = []
    for rank in range(spec.world_size):
        node = spec.nodes[rank // spec.ranks_per_node]
        worker_spec = {
            "job": spec.job, "rank": rank, "world_size": spec.world_size,
            "local_rank": rank % spec.ranks_per_node, "local_world_size": spec.ranks_per_node,
            "coordinator": spec.nodes[0].address, "socket": node.socket,
            "timeout": spec.timeout, "layers": spec.layers, "dtype": spec.dtype, "op": spec.op,
            "iterations": spec.iterations, "planner": spec.planner,
            "compression": spec.compression,
            **spec.overrides.get(rank, {}),
        }
        processes.append(start_json_worker(WORKER, worker_spec))
    return processes


def await_registered(processes: list[subprocess.Popen[str]]) -> None:
    """Block until every rank printed that its job formed (skip_results ranks)."""
    for process in processes:
        assert process.stdout is not None
        assert json.loads(process.stdout.readline())["registered"]


def daemon_status(socket: str) -> dict[str, Any]:
    """``commd status --json`` of the daemon at ``socket``."""
    completed = subprocess.run(
        [sys.executable, "-m", "commd.cli", "status", "--socket", socket, "--json"],
        capture_output=True, text=True, timeout=30, check=True)
    status: dict[str, Any] = json.loads(completed.stdout)
    return status


def collect(processes: list[subprocess.Popen[str]], timeout: float = 90.0) -> list[dict[str, Any]]:
    """The final JSON line of every rank, with its returncode and stderr, all within
    ``timeout``; kills stragglers so nothing outlives the caller."""
    results = []
    for done in finish(processes, timeout):
        final = done.last_json()
        final["returncode"] = done.returncode
        final["stderr"] = done.stderr
        results.append(final)
    return results


def expected(spec: JobSpec, iteration: int) -> list[np.ndarray]:
    """The reduced value every rank must see, computed in float64."""
    reduced = []
    for layer, (_, size) in enumerate(spec.layers):
        total = np.zeros(numel(size), np.float64)
        for rank in range(spec.world_size):
            total += value(rank, iteration, layer, numel(size))
        reduced.append(total / spec.world_size if spec.op == "avg" else total)
    return reduced


def assert_exact(spec: JobSpec, results: list[dict[str, Any]]) -> None:
    """Every rank of ``spec`` ran every iteration without an error and saw exactly the
    reduced values ``expected`` computes, element by element (dense throughout, without
    compression)."""
    for result in results:
        assert "error" not in result, result
        assert result["returncode"] == 0, result["stderr"]
        assert len(result["iterations"]) == spec.iterations, result
        if spec.compression == "none":
            assert result["dense"] == [True] * spec.iterations, result["dense"]
        for iteration, layers in enumerate(result["iterations"]):
            for got, want in zip(layers, expected(spec, iteration), strict=True):
                np.testing.assert_array_equal(np.array(got), want)
