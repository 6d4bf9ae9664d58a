"""A replacement rank rejoins a running ``fault_tolerance="continue"`` DDP job with the state
of a live peer: parameters, buffers and every registered state, and the step to go on from.
Three real daemons, one rank each, real Gloo."""

from __future__ import annotations

import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from commd.testing.daemons import LocalDaemon, daemon_set
from commd.testing.processes import finish, start_json_worker
from commd.testing.ranks import daemon_status

pytestmark = pytest.mark.timeout(180)

WORKER = str(Path(__file__).parents[1] / "rejoin_ddp_worker.py")


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[list[LocalDaemon]]:
    with daemon_set(tmp_path, 3, "--peer-timeout-s", "3") as started:
        yield started


def launch(nodes: list[LocalDaemon], job: str, rank: int, spec: dict[str, Any],
           per_node: int = 1) -> Any:
    return launch_on(nodes[rank // per_node].socket, nodes[0].address, job, rank,
                     len(nodes) * per_node, spec, per_node)


def launch_on(socket: str, coordinator: str, job: str, rank: int, world: int,
              spec: dict[str, Any], per_node: int = 1) -> Any:
    """One rank, with the environment torchrun and the docs give it."""
    env = {"RANK": str(rank), "WORLD_SIZE": str(world),
           "LOCAL_RANK": str(rank % per_node), "LOCAL_WORLD_SIZE": str(per_node),
           "COMMD_JOB": job, "COMMD_COORDINATOR": coordinator,
           "COMMD_SOCKET": socket, "COMMD_TIMEOUT": "60"}
    return start_json_worker([sys.executable, WORKER], spec, env=env)


def last_json(done: Any) -> dict[str, Any]:
    try:
        return done.last_json()
    except (ValueError, IndexError):
        return {"stderr": done.stderr, "returncode": done.returncode}


@pytest.mark.parametrize(("node_count", "per_node", "victim"), [
    pytest.param(3, 1, 2, id="3x1"),
    # on a node whose other rank lives: the state comes from rank 0, on that node or the other
    pytest.param(2, 2, 1, id="2x2-source-on-its-node"),
    pytest.param(2, 2, 3, id="2x2-source-on-the-other-node"),
])
def test_a_replacement_takes_a_live_peers_state(nodes: list[LocalDaemon], node_count: int,
                                                per_node: int, victim: int) -> None:
    """A rank dies inside step 3's backward; the survivors go on alone, then hold before
    step 6 until a replacement is in. It starts at the job's step with the peer's
    parameters, buffers, optimizer momentum and counter; at the end all are equal."""
    job = f"rejoin-{uuid.uuid4().hex[:8]}"
    steps, die_at, hold_at = 10, 3, 6
    world = node_count * per_node
    spec = {"steps": steps, "hold_at": hold_at, "joiner_rank": victim}
    used = nodes[:node_count]
    first = [launch(used, job, rank, {**spec, **({"die_at": die_at} if rank == victim else {})},
                    per_node) for rank in range(world)]
    assert first[victim].wait(timeout=90) == 17
    replacement = launch(used, job, victim, spec, per_node)
    survivors = [rank for rank in range(world) if rank != victim]
    outcome = [last_json(done) for done in finish(
        [*(first[rank] for rank in survivors), replacement], 150.0)]
    for result in outcome:
        assert "params" in result, result
    joined = outcome[-1]
    assert joined["joined_at"] == hold_at
    assert joined["counter_at_join"] == hold_at  # the registered counter came with the state
    # What its first step would load lazily was loaded before it joined: the survivors, stopped
    # from the join to its first gradients, do not wait for torch's imports.
    assert joined["preloaded"]
    for key in ("params", "buffers", "momentum", "counter", "members"):
        assert all(result[key] == joined[key] for result in outcome), key
    assert joined["members"] == list(range(world))
    sizes = outcome[0]["world_sizes"]
    assert sizes[:die_at] == [world] * die_at and world - 1 in sizes and sizes[-1] == world


def await_iteration(node: LocalDaemon, job: str, iteration: int) -> None:
    """Until ``job`` on ``node`` has run ``iteration`` iterations, with a deadline."""
    deadline = time.monotonic() + 60
    while True:
        jobs = [j for j in daemon_status(node.socket)["jobs"] if j["job"] == job]
        if jobs and (jobs[0]["iteration"] or 0) >= iteration:
            return
        assert time.monotonic() < deadline, f"{job} never reached iteration {iteration}"
        time.sleep(0.05)  # polling a condition, with a deadline


@pytest.mark.parametrize("naming", ["the-old-address", "the-successor"])
def test_the_coordinators_node_is_replaced_and_its_rank_takes_a_live_peers_state(
        tmp_path: Path, naming: str) -> None:
    """SIGKILL of node 0's daemon, the coordinator (rank 0's node): node 1 takes over. A
    fresh daemon starts in node 0's place — at its old port, and its replacement rank with
    the very command rank 0 had (COMMD_COORDINATOR still the lost address), or elsewhere,
    naming the successor — and the replacement joins: sent on to the successor, it takes a
    live peer's state through jobs formed there, not at the lost address. All end equal.
    The peer timeout is longer than the test: only the closed links can drive it."""
    job = f"rejoin-{uuid.uuid4().hex[:8]}"
    steps, hold_at = 10, 6
    spec = {"steps": steps, "hold_at": hold_at, "joiner_rank": 0}
    with daemon_set(tmp_path, 3, "--peer-timeout-s", "600") as nodes:
        first = [launch(nodes, job, rank, spec) for rank in range(3)]
        try:
            await_iteration(nodes[1], job, hold_at)  # the survivors hold there for the joiner
            lost = nodes[0]
            lost.process.kill()
            lost.process.wait(timeout=30)
            assert first[0].wait(timeout=60) != 0  # its daemon gone, rank 0 fails
            again = naming == "the-old-address"
            fresh = LocalDaemon(tmp_path, "d0-again", "--backend", "gloo", "--peer-timeout-s",
                                "600", port=lost.port if again else 0)
            try:
                replacement = launch_on(fresh.socket,
                                        lost.address if again else nodes[1].address,
                                        job, 0, 3, spec)
                outcome = [last_json(done) for done in finish(
                    [first[1], first[2], replacement], 150.0)]
            finally:
                fresh.stop()
        finally:
            for process in first:
                if process.poll() is None:
                    process.kill()
    for result in outcome:
        assert "params" in result, result
    joined = outcome[-1]
    assert joined["joined_at"] == hold_at
    for key in ("params", "buffers", "momentum", "counter", "members"):
        assert all(result[key] == joined[key] for result in outcome), key
    assert joined["members"] == [0, 1, 2]


def test_the_rank_giving_the_state_dies_during_the_hand_over(
        nodes: list[LocalDaemon]) -> None:
    """3 × 1: rank 2 dies, its replacement joins, and rank 0, the source of its state,
    vanishes as it starts the hand-over. The source's loss is a membership change, which
    fails the transfer on the joiner's node at once: the joiner fails alone, saying to start
    it again, long before any timeout; rank 1 trains on. Started again, as it says, the
    replacement joins with rank 1's state, and the two end equal."""
    job = f"rejoin-{uuid.uuid4().hex[:8]}"
    steps, die_at, hold_at = 12, 3, 6
    # epochs: 1 rank 2 lost, 2 its replacement joined, 3 rank 0 lost, 4 the replacement
    # failed, 5 its second start joined
    spec = {"steps": steps, "hold_at": hold_at, "joiner_rank": 2, "hold_again_at": 9,
            "hold_again_epoch": 5}
    first = [launch(nodes, job, rank, {**spec, **extra}) for rank, extra in enumerate(
        [{"die_giving_state": True}, {}, {"die_at": die_at}])]
    try:
        assert first[2].wait(timeout=90) == 17
        replacement = launch(nodes, job, 2, spec)
        assert first[0].wait(timeout=90) == 17  # vanished at the hand-over
        vanished = time.monotonic()
        (joiner,) = finish([replacement], 90.0)
        failed_after = time.monotonic() - vanished
        again = launch(nodes, job, 2, spec)
        outcome = [last_json(done) for done in finish([first[1], again], 90.0)]
    finally:
        for process in first:
            if process.poll() is None:
                process.kill()
    assert joiner.returncode != 0
    assert "could not take the running job's training state from rank 0" in joiner.stderr
    assert "changed its membership" in joiner.stderr  # not a timeout
    assert "start it again" in joiner.stderr
    assert failed_after < 20.0, failed_after  # the ranks' timeout is 60 s
    for result in outcome:
        assert "params" in result, result
    survivor, joined = outcome
    assert joined["joined_at"] == 9
    for key in ("params", "buffers", "momentum", "counter", "members"):
        assert survivor[key] == joined[key], key
    assert joined["members"] == [1, 2]
