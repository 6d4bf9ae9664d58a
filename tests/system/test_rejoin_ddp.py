"""A replacement rank rejoins a running ``fault_tolerance="continue"`` DDP job with the state
of a live peer: parameters, buffers and every registered state, and the step to go on from.
Three real daemons, one rank each, real Gloo."""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from commd.testing.daemons import LocalDaemon, daemon_set
from commd.testing.processes import finish, start_json_worker

pytestmark = pytest.mark.timeout(180)

WORKER = str(Path(__file__).parents[1] / "rejoin_ddp_worker.py")


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[list[LocalDaemon]]:
    with daemon_set(tmp_path, 3, "--peer-timeout-s", "3") as started:
        yield started


def launch(nodes: list[LocalDaemon], job: str, rank: int, spec: dict[str, Any],
           per_node: int = 1) -> Any:
    env = {"RANK": str(rank), "WORLD_SIZE": str(len(nodes) * per_node),
           "LOCAL_RANK": str(rank % per_node), "LOCAL_WORLD_SIZE": str(per_node),
           "COMMD_JOB": job, "COMMD_COORDINATOR": nodes[0].address,
           "COMMD_SOCKET": nodes[rank // per_node].socket, "COMMD_TIMEOUT": "60"}
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
