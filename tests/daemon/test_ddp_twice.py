"""An encoder called twice per step, and a rank that fails in its own code.

``tests/ddp_twice_worker.py`` is SimCLR-style training: ``z1, z2 = model(x1), model(x2)``,
one backward, BatchNorm, ``broadcast_buffers=True``, 2 ranks, CPU and Gloo. The buffer
broadcast before the second forward writes BatchNorm's running statistics, which the first
forward saved for the backward; torch DDP hides that write from autograd's version counters
(``_unsafe_preserve_version_counter``) and so must commd, or rank 1's backward raises "modified
by an inplace operation" (rank 0, the source, copies nothing and never saw it).

- ``test_twice_matches_torch``: stock torch DDP and commd's wrapper run the script on the same
  seeds, launched with ``mp.spawn`` (one daemon) or torchrun's environment (one daemon: both
  ranks local; two daemons: one rank each); commd's final parameters and buffers equal
  torch's to 1e-5 on every rank, and commd's ranks hold identical parameters.
- ``test_failing_rank_is_heard_fast``: rank 1 raises in its own code before (or after) its
  first backward and exits; rank 0, with a client timeout of 120 s, must get a CommdError
  within 15 s. Before the fix, "before" left rank 0 waiting for job ``<job>.order`` to form
  (rank 1 never joined it) until the timeout.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from commd.testing.daemons import LocalDaemon, gloo_daemons
from commd.testing.ports import free_port
from commd.testing.processes import run_launchers, run_stock_launchers, torchrun_env

SCRIPT = Path(__file__).parents[1] / "ddp_twice_worker.py"
WORLD_SIZE = 2
RUN_TIMEOUT_S = 60.0  # a run takes ~5 s; a hang until the client timeout would take 120 s
HEARD_WITHIN_S = 15.0
COMMD_DDP = "commd_client.torch.DistributedDataParallel"
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                  "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "COMMD_JOB",
                  "COMMD_SOCKET", "COMMD_COORDINATOR", "COMMD_TIMEOUT", "DDP_IMPL")

pytestmark = pytest.mark.timeout(int(2 * RUN_TIMEOUT_S) + 60)


@dataclass
class Run:
    records: list[dict[str, Any] | None]
    problem: str  # "" when every process exited 0 in time
    log: str
    seconds: float


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[LocalDaemon]]:
    """Two real `commd run` daemons on 127.0.0.1, stopped after the last test."""
    with gloo_daemons(tmp_path_factory.mktemp("twice-daemons")) as started:
        yield started


def run_script(launch: str, daemons: int, impl: str, nodes: list[LocalDaemon], out: Path,
               *extra: str) -> Run:
    """One run of the worker script: ``spawn`` (one launcher, one daemon) or ``env`` (one
    process per rank; with two daemons rank r on daemon r)."""
    base = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    base.update(DDP_IMPL=impl, COMMD_TIMEOUT="120", COMMD_COORDINATOR=nodes[0].address)
    port = free_port()
    command = [sys.executable, str(SCRIPT), "--launch", launch, "--out", str(out), *extra]
    if launch == "spawn":
        commands = [[*command, "--world-size", str(WORLD_SIZE), "--master-port", str(port)]]
        envs = [{**base, "COMMD_SOCKET": nodes[0].socket}]
    else:
        commands, envs = [], []
        for rank in range(WORLD_SIZE):
            node, local_rank, local_world = (rank, 0, 1) if daemons == 2 else (0, rank, 2)
            commands.append(command)
            envs.append(torchrun_env(base, rank=rank, world_size=WORLD_SIZE,
                                     local_rank=local_rank, local_world_size=local_world,
                                     master_port=port, socket=nodes[node].socket))
    log_path = out / "run.log"
    log_path.write_bytes(b"")
    started = time.monotonic()
    launch_all = run_launchers if impl == "commd" else run_stock_launchers
    problem = launch_all(commands, envs, [log_path] * len(commands), RUN_TIMEOUT_S)
    seconds = time.monotonic() - started
    records = [torch.load(path) if (path := out / f"rank{rank}.pt").exists() else None
               for rank in range(WORLD_SIZE)]
    return Run(records, problem, log_path.read_text(errors="replace")[-4000:], seconds)


LAUNCHES = [("spawn", 1), ("env", 1), ("env", 2)]


@pytest.mark.parametrize(("launch", "daemons"), LAUNCHES,
                         ids=[f"{launch}-{n}daemon" for launch, n in LAUNCHES])
def test_twice_matches_torch(launch: str, daemons: int, nodes: list[LocalDaemon],
                             tmp_path: Path) -> None:
    runs = {}
    for impl in ("torch", "commd"):
        out = tmp_path / impl
        out.mkdir()
        runs[impl] = run = run_script(launch, daemons, impl, nodes, out)
        assert not run.problem, f"{impl}: {run.problem}\n{run.log}"
    for rank in range(WORLD_SIZE):
        want, got = runs["torch"].records[rank], runs["commd"].records[rank]
        assert want is not None and got is not None
        assert "error" not in got, f"rank {rank}: {got['error']}"
        assert got["ddp_class"] == COMMD_DDP
        assert set(got["params"]) == set(want["params"])
        for key, value in want["params"].items():
            torch.testing.assert_close(got["params"][key], value, rtol=0, atol=1e-5,
                                       msg=lambda m, k=key, r=rank: f"rank {r} {k}: {m}")
    first, second = (record["params"] for record in runs["commd"].records if record)
    for key in ("body.weight", "body.bias", "norm.weight", "norm.bias", "head.weight"):
        assert torch.equal(first[key], second[key]), key


FAILURES = [("env", 1, "before"), ("env", 1, "after"), ("env", 2, "before"),
            ("env", 2, "after"), ("spawn", 1, "before")]


@pytest.mark.parametrize(("launch", "daemons", "when"), FAILURES,
                         ids=[f"{launch}-{n}daemon-{when}" for launch, n, when in FAILURES])
def test_failing_rank_is_heard_fast(launch: str, daemons: int, when: str,
                                    nodes: list[LocalDaemon], tmp_path: Path) -> None:
    run = run_script(launch, daemons, "commd", nodes, tmp_path,
                     "--fail-rank", "1", "--fail-at", when)
    assert "hung" not in run.problem, f"the run waited for the timeout:\n{run.log}"
    failed = run.records[1]
    assert failed is not None and "InjectedFailure" in failed["error"], run.log
    survivor = run.records[0]
    if launch == "spawn":
        # mp.spawn ends the other ranks itself once one fails: nobody is left to wait.
        assert run.seconds < RUN_TIMEOUT_S / 2, run.log
        if survivor is None:
            return
    assert survivor is not None, f"rank 0 left no record:\n{run.log}"
    assert survivor.get("commd_error"), f"rank 0: {survivor.get('error')}\n{run.log}"
    assert survivor["elapsed_s"] < HEARD_WITHIN_S, survivor
    if daemons == 1:  # the daemon saw rank 1 go; across daemons Gloo's closed link says it
        assert "rank 1" in survivor["error"], survivor["error"]
