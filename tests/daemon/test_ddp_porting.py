"""Porting a real DDP training script to commd takes one changed import, and nothing changes.

The scripts under ``tests/ddp_scripts/`` are written the way real ones are: the PyTorch DDP
tutorial (ToyModel, demo_basic, demo_checkpoint), the uneven-inputs Join tutorial, the
ddp-tutorial-series multinode Trainer (DistributedSampler, snapshots of ``model.module``),
pytorch/examples' DCGAN loop (two wrapped models) and nanoGPT's train.py (tied weights,
AdamW, gradient accumulation with ``require_backward_grad_sync``, clipping). Each picks its
DDP class with one line::

    if os.environ.get("DDP_IMPL") == "commd":
        from commd_client.torch import DistributedDataParallel as DDP
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP

and nothing else in it knows which one it got. Every rank builds its models from its own
seed (so the initial broadcast from rank 0 matters) and trains on its own data.

How it runs: ``tests/ddp_scripts/run_scenarios.py`` runs all eight scenarios one after
another in one process per rank, world size 3, CPU and Gloo, and writes each rank's results
to ``rank<N>.pt``. It is started four times, once per (launch style, implementation):

- ``spawn``: the tutorial's ``torch.multiprocessing.spawn``, MASTER_ADDR/MASTER_PORT set in
  each child, no RANK/WORLD_SIZE/LOCAL_RANK; one commd daemon (one node).
- ``env``: torchrun's environment, one process per rank started here; two daemons: ranks 0
  and 1 on the first (LOCAL_WORLD_SIZE 2), rank 2 on the second.

Both implementations get the same environment (COMMD_SOCKET, COMMD_COORDINATOR,
COMMD_TIMEOUT=60) except DDP_IMPL. For every scenario the tests check, per launch style:
stock torch DDP ran without error and its ranks agree (the scripts are right); the commd run
raised nothing and imported commd's class; on every rank its final parameters and buffers
(and logged values) equal torch's to 1e-6; its ranks' parameters are identical. Two more
tests: the commd run's jobs formed on the daemons (no silent fallback to torch's reducer),
and no scenario script mentions commd outside its import switch.

Run one scenario by hand (any launch, either implementation)::

    DDP_IMPL=torch .venv/bin/python tests/ddp_scripts/run_scenarios.py --launch spawn \
        --out /tmp/porting --scenarios basic,join

A stuck run is killed after RUN_TIMEOUT_S (its ranks wrote their results after every
scenario, so the scenarios before the stuck one are still judged). Two daemons serve the
file; the four runs take about 50 s on two cores.
"""

from __future__ import annotations

import ast
import os
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from commd.testing.daemons import LocalDaemon, gloo_daemons
from commd.testing.ports import free_port
from commd.testing.processes import run_launchers, run_stock_launchers, torchrun_env

SCRIPTS = Path(__file__).parents[1] / "ddp_scripts"
RUNNER = SCRIPTS / "run_scenarios.py"
WORLD_SIZE = 3
RUN_TIMEOUT_S = 90.0  # one run of all scenarios on every rank: about 10 s when it works
TORCH_DDP = "torch.nn.parallel.distributed.DistributedDataParallel"
COMMD_DDP = "commd_client.torch.DistributedDataParallel"
# What the runs set themselves (launcher, daemons, implementation): none may leak in from the
# test's own environment (the spawn launch must see no RANK, for one).
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                  "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "COMMD_JOB",
                  "COMMD_SOCKET", "COMMD_COORDINATOR", "DDP_IMPL")

# The first test of each launch style starts its two runs (and the first, the daemons).
pytestmark = pytest.mark.timeout(int(2 * RUN_TIMEOUT_S) + 60)


@dataclass
class Run:
    """What one (launch style, implementation) run left: each rank's record, or None."""

    launch: str
    impl: str
    master_port: int
    records: list[dict[str, Any] | None] = field(repr=False)
    logs: list[Path]
    problem: str  # "" when every process exited 0 in time

    def describe(self, rank: int) -> str:
        log = self.logs[min(rank, len(self.logs) - 1)]
        tail = log.read_text(errors="replace")[-3000:] if log.exists() else "(no log)"
        return (f"{self.launch}/{self.impl} run: {self.problem or 'exited 0'}\n"
                f"--- {log.name} (tail) ---\n{tail}")


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[LocalDaemon]]:
    """Two real `commd run` daemons on 127.0.0.1, stopped after the last test."""
    with gloo_daemons(tmp_path_factory.mktemp("porting-daemons")) as started:
        yield started


@pytest.fixture(scope="module", params=["spawn", "env"])
def runs(request: pytest.FixtureRequest, nodes: list[LocalDaemon],
         tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    """The launch style's two runs, stock torch DDP first: {"torch": Run, "commd": Run}."""
    launch = str(request.param)
    return {impl: run_scenarios(launch, impl, nodes, tmp_path_factory.mktemp(f"{launch}-{impl}"))
            for impl in ("torch", "commd")}


def run_scenarios(launch: str, impl: str, nodes: list[LocalDaemon], out: Path) -> Run:
    base = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    base.update(DDP_IMPL=impl, COMMD_TIMEOUT="60", COMMD_COORDINATOR=nodes[0].address)
    port = free_port()
    command = [sys.executable, str(RUNNER), "--launch", launch, "--out", str(out)]
    if launch == "spawn":  # one node: the launcher's children inherit its environment
        commands = [[*command, "--world-size", str(WORLD_SIZE), "--master-port", str(port)]]
        envs = [{**base, "COMMD_SOCKET": nodes[0].socket}]
    else:  # torchrun's environment; ranks 0 and 1 on node 0, rank 2 on node 1
        commands, envs = [], []
        for rank in range(WORLD_SIZE):
            node, local_rank, local_world = (0, rank, 2) if rank < 2 else (1, 0, 1)
            commands.append(command)
            envs.append(torchrun_env(base, rank=rank, world_size=WORLD_SIZE,
                                     local_rank=local_rank, local_world_size=local_world,
                                     master_port=port, socket=nodes[node].socket))
    logs = [out / f"process{index}.log" for index in range(len(commands))]
    launch_all = run_launchers if impl == "commd" else run_stock_launchers
    problem = launch_all(commands, envs, logs, RUN_TIMEOUT_S)
    records: list[dict[str, Any] | None] = []
    for rank in range(WORLD_SIZE):
        path = out / f"rank{rank}.pt"
        records.append(torch.load(path) if path.exists() else None)
    return Run(launch, impl, port, records, logs, problem)


def completed(run: Run, name: str) -> list[dict[str, Any]]:
    """Every rank's result for scenario ``name``; fails the test if one is missing or raised."""
    outcomes = []
    for rank, record in enumerate(run.records):
        if record is None or name not in record["scenarios"]:
            reached = [] if record is None else list(record["scenarios"])
            pytest.fail(f"{run.launch}/{run.impl}: rank {rank} never finished {name!r} "
                        f"(finished: {reached})\n{run.describe(rank)}")
        outcome = record["scenarios"][name]
        if "error" in outcome:
            pytest.fail(f"{run.launch}/{run.impl}: {name!r} raised on rank {rank}: "
                        f"{outcome['error']}\n{outcome['traceback']}")
        outcomes.append(outcome)
    return outcomes


def assert_ranks_agree(run: Run, outcomes: list[dict[str, Any]], *,
                       with_buffers: bool = False) -> None:
    """Every rank holds the same parameters (and buffers, if asked), bit for bit."""
    first = outcomes[0]
    keys = [k for k in first["params"] if with_buffers or k not in first["buffers"]]
    assert keys
    for rank, outcome in enumerate(outcomes[1:], start=1):
        for key in keys:
            assert torch.equal(outcome["params"][key], first["params"][key]), \
                f"{run.launch}/{run.impl}: {key} differs between rank 0 and rank {rank}"


def assert_equal_to_torch(got: torch.Tensor, want: torch.Tensor, where: str) -> None:
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=lambda m: f"{where}: {m}")


def check_port(runs: dict[str, Run], name: str, *, with_buffers: bool = False
               ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The checks every scenario shares; returns (torch's, commd's) per-rank outcomes."""
    reference = completed(runs["torch"], name)  # the script itself works with torch DDP
    assert {o["ddp_class"] for o in reference} == {TORCH_DDP}
    assert_ranks_agree(runs["torch"], reference, with_buffers=with_buffers)
    ported = completed(runs["commd"], name)
    assert {o["ddp_class"] for o in ported} == {COMMD_DDP}, "the commd run imported torch's"
    for rank, (want, got) in enumerate(zip(reference, ported, strict=True)):
        assert got["params"].keys() == want["params"].keys(), f"rank {rank}"
        for key, value in want["params"].items():
            assert_equal_to_torch(got["params"][key], value, f"rank {rank}: {key}")
        assert got["values"].keys() == want["values"].keys(), f"rank {rank}"
        for key, value in want["values"].items():
            assert_equal_to_torch(got["values"][key], value, f"rank {rank}: {key}")
    assert_ranks_agree(runs["commd"], ported, with_buffers=with_buffers)
    return reference, ported


def test_basic(runs: dict[str, Run]) -> None:
    """The tutorial's demo_basic: ToyModel, SGD, MSELoss."""
    check_port(runs, "basic")


def test_gan(runs: dict[str, Run]) -> None:
    """DDP(generator) and DDP(discriminator) at once, D step then G step, two Adams."""
    check_port(runs, "gan")


def test_keywords(runs: dict[str, Run]) -> None:
    """torch 2.13's whole constructor signature: positional ``DDP(model, None)``, every
    keyword (a process group of all ranks among them) and the newer buffer keywords."""
    reference, ported = check_port(runs, "keywords")
    for rank, (want, got) in enumerate(zip(reference, ported, strict=True)):
        for wrapper in ("positional", "keywords", "newer"):
            assert want["info"][wrapper]["isinstance"], wrapper
            assert got["info"][wrapper]["isinstance"], \
                f"rank {rank}: {wrapper}: not an instance of torch's DistributedDataParallel"
            assert got["info"][wrapper] == want["info"][wrapper], f"rank {rank}: {wrapper}"


def test_join(runs: dict[str, Run]) -> None:
    """Uneven inputs (3, 5 and 4 batches) inside ``model.join()``, with a BatchNorm: after
    the context every rank holds the last joiner's parameters and buffers."""
    reference, ported = check_port(runs, "join", with_buffers=True)
    assert [o["info"]["num_inputs"] for o in reference] == [3, 5, 4]
    assert [o["info"]["num_inputs"] for o in ported] == [3, 5, 4]


def test_checkpoint(runs: dict[str, Run]) -> None:
    """The tutorial's demo_checkpoint (rank 0 saves ``ddp_model.state_dict()``, everyone
    loads it) and the multinode Trainer's snapshot of ``model.module`` and resume."""
    reference, ported = check_port(runs, "checkpoint")
    for want, got in zip(reference, ported, strict=True):
        assert got["ddp_classes"] == [COMMD_DDP, COMMD_DDP]
        assert got["info"] == want["info"]  # "module."-prefixed keys; resumed at epoch 2


def test_accumulation(runs: dict[str, Run]) -> None:
    """nanoGPT: tied weights, AdamW, 4 micro-steps with require_backward_grad_sync, clipping."""
    reference, ported = check_port(runs, "accumulation")
    assert all(o["info"]["weights_still_tied"] for o in reference + ported)


def test_allreduce_beside(runs: dict[str, Run]) -> None:
    """The script's own all_reduce (between forward and backward, and after the step) and
    barrier on the default group, beside the wrapper's traffic."""
    _, ported = check_port(runs, "allreduce_beside")
    assert ported[0]["values"]["global_samples"].tolist() == [40.0, 44.0, 40.0, 44.0]


def test_rewrap(runs: dict[str, Run]) -> None:
    """Wrap, train, close (if the wrapper can), wrap the same module again, train on."""
    check_port(runs, "rewrap")


def test_the_commd_runs_went_through_the_daemons(runs: dict[str, Run],
                                                 nodes: list[LocalDaemon]) -> None:
    """Not a fallback to torch's own reducer: the commd run's jobs (their ids start with
    MASTER_ADDR-MASTER_PORT) formed on the daemons, over every rank and node; the torch
    run's did not."""
    def formed(port: int) -> set[tuple[int, int]]:
        line = re.compile(rf"job \S*-{port}\b\S* formed: (\d+) nodes, (\d+) ranks")
        return {(int(m[1]), int(m[2])) for m in line.finditer(nodes[0].log())}

    nodes_used = 1 if runs["commd"].launch == "spawn" else 2
    assert formed(runs["commd"].master_port) == {(nodes_used, WORLD_SIZE)}
    assert formed(runs["torch"].master_port) == set()


def test_each_script_names_commd_only_in_its_import() -> None:
    """The port is the import: in every scenario script, ``commd`` appears only in the one
    ``if os.environ.get("DDP_IMPL") == "commd":`` import switch."""
    scripts = [p for p in SCRIPTS.glob("*.py") if p.name not in ("run_scenarios.py",
                                                                  "porting_kit.py")]
    assert len(scripts) == 5
    for script in scripts:
        tree = ast.parse(script.read_text())
        switches = [node for node in tree.body if isinstance(node, ast.If)
                    and "DDP_IMPL" in ast.unparse(node.test)]
        assert len(switches) == 1, script.name
        switch = switches[0]
        assert ast.unparse(switch.test) == "os.environ.get('DDP_IMPL') == 'commd'"
        assert [ast.unparse(n) for n in switch.body] == [
            "from commd_client.torch import DistributedDataParallel as DDP"]
        assert [ast.unparse(n) for n in switch.orelse] == [
            "from torch.nn.parallel import DistributedDataParallel as DDP"]
        rest = [ast.unparse(node) for node in tree.body if node is not switch]
        assert not [line for line in rest if "commd" in line.lower()], script.name
