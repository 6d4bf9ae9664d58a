"""fault_tolerance="continue" behind the one-line DDP (issue 36's proof): a rank killed at
step 5 of 12 costs the survivors nothing but its share of the batch.

``tests/ft_ddp_worker.py`` trains a small model with BatchNorm (buffers broadcast before each
forward) under SGD with momentum, fixed seeds, each rank started as torchrun starts one; real
daemons on 127.0.0.1, real Gloo. The victim leaves with ``os._exit`` (no goodbye) inside a
backward hook of the middle layer (the gradients after it already handed over; with the
"wfbp" planner their groups are then on the wire) or between two steps.

- ``test_survivors_finish_identical``: rank 2, then rank 0 (the buffer broadcast's source:
  it moves to rank 1), each way: the survivors run every step without an error, end with
  bit-identical parameters, buffers and optimizer state, and see world size 2 and the
  survivors as members; their parameters differ from the unbroken run's (a run where the
  kill changed nothing would prove nothing).
- ``test_the_default_still_fails``: without the keyword, the same kill gives every survivor
  a CommdError, as today.
- ``test_a_lost_local_rank_leaves_its_node_training``: two daemons with two ranks each; one
  rank of node 1 (its second mid-backward, or its first between steps) dies while its
  neighbour lives: node 1 goes on with the other rank, world size 3, all three identical.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from commd.testing.daemons import LocalDaemon, commd_segments
from commd.testing.processes import FinishTimeout, finish

pytestmark = pytest.mark.timeout(240)

WORKER = str(Path(__file__).parents[1] / "ft_ddp_worker.py")
STEPS = 12
KILL_STEP = 5
VICTIM_EXIT = 17  # ft_ddp_worker's os._exit code
RUN_TIMEOUT_S = 90.0  # a run takes ~10 s on two cores; a hang would last the client timeout
PEER_TIMEOUT_S = 3
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                  "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "COMMD_JOB",
                  "COMMD_SOCKET", "COMMD_COORDINATOR", "COMMD_TIMEOUT",
                  "COMMD_FAULT_TOLERANCE", "COMMD_MIN_WORLD_SIZE", "COMMD_NODE_RANK",
                  "COMMD_NNODES")


def start_daemons(workdir: Path, count: int) -> list[LocalDaemon]:
    started: list[LocalDaemon] = []
    try:
        for index in range(count):
            started.append(LocalDaemon(workdir, f"d{index}", "--backend", "gloo",
                                       "--peer-timeout-s", str(PEER_TIMEOUT_S)))
    except BaseException:
        for daemon in started:
            daemon.stop()
        raise
    return started


@pytest.fixture(scope="module")
def three_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[LocalDaemon]]:
    """Three daemons for every run of this module: a lost rank leaves its daemon serving."""
    before = commd_segments()
    started = start_daemons(tmp_path_factory.mktemp("ft-ddp"), 3)
    try:
        yield started
    finally:
        for daemon in started:
            daemon.stop()
    assert commd_segments() <= before


def train(nodes: list[LocalDaemon], out: Path, *, ranks_per_node: int = 1,
          fault_tolerance: str | None = "continue", planner: str | None = None,
          victim: int | None = None, when: str | None = None) -> list[dict[str, Any]]:
    """One run, rank r on node r // ranks_per_node; each rank's record, with its exit code
    (``returncode``) and output (``log``)."""
    out.mkdir()
    job = f"ftddp-{uuid.uuid4().hex[:8]}"
    world = len(nodes) * ranks_per_node
    base = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    processes = []
    for rank in range(world):
        node = nodes[rank // ranks_per_node]
        env = {**base, "RANK": str(rank), "WORLD_SIZE": str(world),
               "LOCAL_RANK": str(rank % ranks_per_node),
               "LOCAL_WORLD_SIZE": str(ranks_per_node), "COMMD_JOB": job,
               "COMMD_COORDINATOR": nodes[0].address, "COMMD_SOCKET": node.socket,
               "COMMD_TIMEOUT": "60", "OMP_NUM_THREADS": "1"}
        spec: dict[str, Any] = {"out": str(out), "steps": STEPS,
                                "fault_tolerance": fault_tolerance, "planner": planner}
        if rank == victim:
            spec.update(kill_step=KILL_STEP, kill_when=when)
        processes.append(subprocess.Popen([sys.executable, WORKER, json.dumps(spec)], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True))
    try:
        finished = finish(processes, RUN_TIMEOUT_S)
    except FinishTimeout as timeout:
        logs = "\n".join(daemon.log()[-3000:] for daemon in nodes)
        pytest.fail(f"{timeout}\ndaemon logs:\n{logs}")
    records = []
    for rank, done in enumerate(finished):
        path = out / f"rank{rank}.pt"
        record: dict[str, Any] = torch.load(path) if path.exists() else {}
        record.update(returncode=done.returncode, log=done.stdout[-3000:])
        records.append(record)
    return records


def assert_survived(records: list[dict[str, Any]], victim: int, world: int) -> list[int]:
    """The victim died as told; every other of the ``world`` ranks finished every step in a
    job of the survivors alone, all in the same state. The survivors."""
    assert records[victim]["returncode"] == VICTIM_EXIT, records[victim]["log"]
    survivors = [rank for rank in range(world) if rank != victim]
    for rank in survivors:
        record = records[rank]
        assert record["returncode"] == 0, f"rank {rank}: {record.get('error')}\n{record['log']}"
        assert record["steps"] == STEPS
        assert record["world_size"] == world - 1
        assert record["members"] == survivors
    assert_identical(records, survivors)
    return survivors


def assert_identical(records: list[dict[str, Any]], survivors: list[int]) -> None:
    """The survivors' parameters, buffers and optimizer state agree bit for bit."""
    first = records[survivors[0]]
    for rank in survivors[1:]:
        other = records[rank]
        assert first["state"].keys() == other["state"].keys()
        for key, value in first["state"].items():
            assert torch.equal(value, other["state"][key]), f"rank {rank} {key} differs"
        mine, theirs = first["optimizer"]["state"], other["optimizer"]["state"]
        assert mine.keys() == theirs.keys() and mine, (mine.keys(), theirs.keys())
        for index, state in mine.items():
            for name, value in state.items():
                assert torch.equal(value, theirs[index][name]), \
                    f"rank {rank} optimizer state {index}.{name} differs"


@pytest.fixture(scope="module")
def unbroken(three_nodes: list[LocalDaemon],
             tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Rank 0's record of a run where nobody dies."""
    records = train(three_nodes, tmp_path_factory.mktemp("unbroken") / "run")
    for rank, record in enumerate(records):
        assert record["returncode"] == 0, f"rank {rank}: {record.get('error')}\n{record['log']}"
    assert_identical(records, [0, 1, 2])
    return records[0]


# (victim, when, planner): mid-backward with the daemon's plan and with a group per layer
CASES = [(2, "backward", None), (2, "backward", "wfbp"), (2, "between", None),
         (0, "backward", "wfbp"), (0, "between", None)]


def case_id(victim: int, when: str, planner: str | None) -> str:
    return f"rank{victim}-{when}" + (f"-{planner}" if planner else "")


@pytest.mark.parametrize(("victim", "when", "planner"), CASES,
                         ids=[case_id(*case) for case in CASES])
def test_survivors_finish_identical(three_nodes: list[LocalDaemon], unbroken: dict[str, Any],
                                    tmp_path: Path, victim: int, when: str,
                                    planner: str | None) -> None:
    records = train(three_nodes, tmp_path / "run", planner=planner, victim=victim, when=when)
    survivors = assert_survived(records, victim, world=3)
    for rank in survivors:
        world_sizes = records[rank]["world_sizes"]
        assert world_sizes[:KILL_STEP - 1] == [3] * (KILL_STEP - 1)
        assert world_sizes[KILL_STEP + 1:] == [2] * (STEPS - KILL_STEP - 1)
    state = records[survivors[0]]["state"]
    assert any(not torch.equal(value, unbroken["state"][key])
               for key, value in state.items() if value.is_floating_point()), \
        "the survivors ended where the unbroken run did: the kill changed nothing"


def test_the_default_still_fails(three_nodes: list[LocalDaemon], tmp_path: Path) -> None:
    records = train(three_nodes, tmp_path / "run", fault_tolerance=None, victim=2,
                    when="backward")
    assert records[2]["returncode"] == VICTIM_EXIT
    for rank in (0, 1):
        record = records[rank]
        assert record["returncode"] == 1, record["log"]
        assert record["commd_error"], record["error"]
        assert record["steps"] == KILL_STEP, record


LOCAL_CASES = [(3, "backward", "wfbp"), (2, "between", None)]


@pytest.mark.parametrize(("victim", "when", "planner"), LOCAL_CASES,
                         ids=[case_id(*case) for case in LOCAL_CASES])
def test_a_lost_local_rank_leaves_its_node_training(tmp_path: Path, victim: int, when: str,
                                                    planner: str | None) -> None:
    """Node 1 holds ranks 2 and 3; one of them dies while the other lives: the other three
    finish with world size 3 and identical state."""
    nodes = start_daemons(tmp_path, 2)
    try:
        records = train(nodes, tmp_path / "run", ranks_per_node=2, planner=planner,
                        victim=victim, when=when)
    finally:
        for daemon in nodes:
            daemon.stop()
    survivors = assert_survived(records, victim, world=4)
    for rank in survivors:
        assert records[rank]["world_sizes"][-1] == 3
