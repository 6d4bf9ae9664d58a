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

WORKER = str(Path(__file__).with_name("rejoin_ddp_worker.py"))


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[list[LocalDaemon]]:
    with daemon_set(tmp_path, 3, "--peer-timeout-s", "3") as started:
        yield started


def launch(nodes: list[LocalDaemon], job: str, rank: int, spec: dict[str, Any]) -> Any:
    env = {"RANK": str(rank), "WORLD_SIZE": str(len(nodes)), "LOCAL_RANK": "0",
           "LOCAL_WORLD_SIZE": "1", "COMMD_JOB": job, "COMMD_COORDINATOR": nodes[0].address,
           "COMMD_SOCKET": nodes[rank].socket, "COMMD_TIMEOUT": "60"}
    return start_json_worker([sys.executable, WORKER], spec, env=env)


def last_json(done: Any) -> dict[str, Any]:
    try:
        return done.last_json()
    except (ValueError, IndexError):
        return {"stderr": done.stderr, "returncode": done.returncode}


def test_a_replacement_takes_a_live_peers_state(nodes: list[LocalDaemon]) -> None:
    """Rank 2 dies inside step 3's backward; the survivors go on alone, then hold before
    step 6 until a replacement rank 2 is in. It starts at the job's step with the peer's
    parameters, buffers, optimizer momentum and counter; at the end all three are equal."""
    job = f"rejoin-{uuid.uuid4().hex[:8]}"
    steps, die_at, hold_at = 10, 3, 6
    spec = {"steps": steps, "hold_at": hold_at, "joiner_rank": 2}
    first = [launch(nodes, job, rank, {**spec, **({"die_at": die_at} if rank == 2 else {})})
             for rank in range(3)]
    assert first[2].wait(timeout=90) == 17
    replacement = launch(nodes, job, 2, spec)
    outcome = [last_json(done) for done in finish([first[0], first[1], replacement], 150.0)]
    for result in outcome:
        assert "params" in result, result
    joined = outcome[2]
    assert joined["joined_at"] == hold_at
    assert joined["counter_at_join"] == hold_at  # the registered counter came with the state
    # What its first step would load lazily was loaded before it joined: the survivors, stopped
    # from the join to its first gradients, do not wait for torch's imports.
    assert joined["preloaded"]
    for key in ("params", "buffers", "momentum", "counter", "members"):
        assert outcome[0][key] == outcome[1][key] == joined[key], key
    assert outcome[0]["members"] == [0, 1, 2]
    sizes = outcome[0]["world_sizes"]
    assert sizes[:die_at] == [3] * die_at and 2 in sizes and sizes[-1] == 3
