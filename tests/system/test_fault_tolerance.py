"""fault_tolerance="continue": a lost rank, daemon or node costs the job a membership epoch,
not its life. Real daemons on 127.0.0.1, one rank each, real Gloo; the survivors must end
every iteration with bit-identical averages — of every rank before the loss, of the
survivors after it, and of one of the two in the iteration the loss lands in."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from commd.testing.daemons import LocalDaemon, daemon_set
from commd.testing.processes import finish, start_json_worker
from commd.testing.ranks import daemon_status, value
from commd_client import Client, CommdError

pytestmark = pytest.mark.timeout(180)

WORKER = str(Path(__file__).parents[1] / "tolerant_worker.py")
LAYERS = [("a", 3000), ("b", 700), ("c", 50)]
PEER_TIMEOUT_S = 3


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[list[LocalDaemon]]:
    with daemon_set(tmp_path, 3, "--peer-timeout-s", str(PEER_TIMEOUT_S)) as started:
        yield started


def expected_digest(members: list[int], iteration: int) -> str:
    results = []
    for index, (_, size) in enumerate(LAYERS):
        total = sum(value(rank, iteration, index, size) for rank in members).astype(np.float64)
        results.append(total * (1.0 / len(members)))
    return hashlib.sha256(b"".join(r.tobytes() for r in results)).hexdigest()


def start(nodes: list[LocalDaemon], tmp_path: Path, iterations: int,
          overrides: dict[int, dict[str, Any]], min_world_size: int = 1,
          per_node: int = 1) -> list[subprocess.Popen[str]]:
    job = f"ft-{uuid.uuid4().hex[:8]}"
    progress = tmp_path / job
    progress.mkdir()
    env = {**os.environ, "COMMD_FAULT_TOLERANCE": "continue",
           "COMMD_MIN_WORLD_SIZE": str(min_world_size)}
    processes = []
    for rank in range(len(nodes) * per_node):
        node = nodes[rank // per_node]
        spec = {"job": job, "rank": rank, "world_size": len(nodes) * per_node,
                "local_rank": rank % per_node, "local_world_size": per_node,
                "coordinator": nodes[0].address, "socket": node.socket,
                "timeout": 60.0, "layers": LAYERS, "iterations": iterations,
                "progress_dir": str(progress), **overrides.get(rank, {})}
        processes.append(start_json_worker([sys.executable, WORKER], spec, env=env))
    return processes


def start_one(nodes: list[LocalDaemon], tmp_path: Path, job: str, rank: int,
              iterations: int, extra: dict[str, Any],
              per_node: int = 1) -> subprocess.Popen[str]:
    """One more rank of ``job`` (a replacement), on the node that holds ``rank``."""
    env = {**os.environ, "COMMD_FAULT_TOLERANCE": "continue"}
    spec = {"job": job, "rank": rank, "world_size": len(nodes) * per_node,
            "local_rank": rank % per_node, "local_world_size": per_node,
            "coordinator": nodes[0].address, "socket": nodes[rank // per_node].socket,
            "timeout": 60.0, "layers": LAYERS, "iterations": iterations,
            "progress_dir": str(tmp_path / job), **extra}
    return start_json_worker([sys.executable, WORKER], spec, env=env)


def results(processes: list[subprocess.Popen[str]]) -> list[dict[str, Any]]:
    finished = finish(processes, 120.0)
    out = []
    for done in finished:
        try:
            final = done.last_json()
        except (ValueError, IndexError):
            final = {}
        final["returncode"] = done.returncode
        final["stderr"] = done.stderr
        out.append(final)
    return out


def check_survivors(outcome: list[dict[str, Any]], survivors: list[int], lost_at: int,
                    iterations: int, world: int) -> None:
    """Every survivor ran every iteration; all agree bit for bit; before the loss all ranks'
    average, after it the survivors'; in it one of the two."""
    everyone = list(range(world))
    for rank in survivors:
        assert "error" not in outcome[rank], outcome[rank]
        assert len(outcome[rank]["digests"]) == iterations, outcome[rank]
        assert outcome[rank]["members"] == survivors
        assert outcome[rank]["world_sizes"][-1] == len(survivors)
        assert outcome[rank]["epochs"][-1] >= 1
    first = outcome[survivors[0]]["digests"]
    for rank in survivors[1:]:
        assert outcome[rank]["digests"] == first, f"rank {rank} diverged from {survivors[0]}"
    for iteration in range(iterations):
        before = expected_digest(everyone, iteration)
        after = expected_digest(survivors, iteration)
        if iteration < lost_at:
            assert first[iteration] == before, iteration
        elif iteration > lost_at:
            assert first[iteration] == after, iteration
        else:
            assert first[iteration] in (before, after)


@pytest.mark.parametrize(("victim", "when"), [(2, "after_ready"), (1, "before_ready"),
                                              (0, "after_ready")])
def test_survivors_go_on_after_a_rank_dies(nodes: list[LocalDaemon], tmp_path: Path,
                                           victim: int, when: str) -> None:
    """A rank vanishes mid-iteration (rank 0 too: its node's daemon coordinates on); the
    others finish every iteration with identical averages and see world size 2."""
    iterations, lost_at = 8, 3
    others = {rank: {"loss_at": lost_at} for rank in range(3) if rank != victim}
    processes = start(nodes, tmp_path, iterations,
                      {victim: {"die_at": lost_at, "die_when": when}, **others})
    outcome = results(processes)
    assert outcome[victim]["returncode"] == 17
    survivors = [rank for rank in range(3) if rank != victim]
    check_survivors(outcome, survivors, lost_at, iterations, 3)
    status = daemon_status(nodes[survivors[0]].socket)
    assert status["jobs"] == [] or all(j["epoch"] >= 1 for j in status["jobs"])


def test_below_min_world_size_the_job_fails_as_before(nodes: list[LocalDaemon],
                                                      tmp_path: Path) -> None:
    processes = start(nodes, tmp_path, 6, {2: {"die_at": 2, "die_when": "after_ready"},
                                           0: {"loss_at": 2}, 1: {"loss_at": 2}},
                      min_world_size=3)
    outcome = results(processes)
    for rank in (0, 1):
        assert outcome[rank]["code"] == "rank_lost", outcome[rank]
        assert "min_world_size 3" in outcome[rank]["error"]


def kill_a_daemon(pair: list[LocalDaemon], tmp_path: Path, iterations: int, hold_at: int,
                  victim: int, *more: int) -> list[dict[str, Any]]:
    """Train one rank per node of ``pair``; SIGKILL daemon ``victim`` (and the daemons
    ``more``, at once) while every rank holds before iteration ``hold_at`` (a survivor's
    daemon shows the job there), then let them go on; every rank's outcome."""
    hold = {"hold_at": hold_at, "hold_for": "killed"}
    processes = start(pair, tmp_path, iterations, dict.fromkeys(range(len(pair)), hold))
    progress = next(p for p in tmp_path.iterdir() if p.name.startswith("ft-"))
    victims = {victim, *more}
    watcher = pair[min(set(range(len(pair))) - victims)]
    deadline = time.monotonic() + 60
    while True:
        jobs = daemon_status(watcher.socket)["jobs"]
        if jobs and jobs[0]["iteration"] == hold_at:
            break
        assert time.monotonic() < deadline, "the job never reached the hold"
        time.sleep(0.05)  # polling a condition, with a deadline
    for node in sorted(victims):
        pair[node].process.kill()
    (progress / "killed").touch()
    return results(processes)


def check_after_kill(outcome: list[dict[str, Any]], victim: int, iterations: int,
                     hold_at: int, *more: int) -> None:
    """The victims' ranks failed; the others ran every iteration, identical, with every
    rank's average before the hold and the survivors' from it on."""
    everyone = list(range(len(outcome)))
    survivors = [rank for rank in everyone if rank not in (victim, *more)]
    for lost in (victim, *more):
        assert "error" in outcome[lost]
    for rank in survivors:
        assert "error" not in outcome[rank], outcome[rank]
        assert len(outcome[rank]["digests"]) == iterations
        assert outcome[rank]["members"] == survivors
        assert outcome[rank]["digests"] == outcome[survivors[0]]["digests"]
    for iteration in range(iterations):
        members = everyone if iteration < hold_at else survivors
        assert outcome[survivors[0]]["digests"][iteration] == expected_digest(members, iteration)


def test_a_killed_daemon_costs_its_node_only(nodes: list[LocalDaemon], tmp_path: Path) -> None:
    """SIGKILL of node 2's daemon while the job trains: its rank fails, the others go on."""
    check_after_kill(kill_a_daemon(nodes, tmp_path, 12, 5, victim=2), 2, 12, 5)


@pytest.mark.parametrize("victim", [3, 2])
def test_a_node_goes_on_without_its_lost_rank(nodes: list[LocalDaemon], tmp_path: Path,
                                              victim: int) -> None:
    """Two nodes of two ranks: one rank of node 1 dies mid-iteration (the second or the first
    of the node's buffers); its node goes on with its other rank, world size 3."""
    iterations, lost_at = 8, 3
    others = {rank: {"loss_at": lost_at} for rank in range(4) if rank != victim}
    processes = start(nodes[:2], tmp_path, iterations,
                      {victim: {"die_at": lost_at, "die_when": "after_ready"}, **others},
                      per_node=2)
    outcome = results(processes)
    assert outcome[victim]["returncode"] == 17
    survivors = [rank for rank in range(4) if rank != victim]
    check_survivors(outcome, survivors, lost_at, iterations, 4)


@pytest.mark.parametrize(("node_count", "per_node", "victim"), [
    pytest.param(3, 1, 2, id="3x1"),
    # its node runs on with the other rank, which takes the replacement in
    pytest.param(2, 2, 3, id="2x2-second-local-rank"),
    pytest.param(2, 2, 0, id="2x2-rank-0"),
])
def test_a_replacement_rejoins_the_running_job(nodes: list[LocalDaemon], tmp_path: Path,
                                               node_count: int, per_node: int,
                                               victim: int) -> None:
    """A rank dies at iteration 3; a replacement started with its number joins the running
    job (its Client learns the iteration the job is at) and all end identical."""
    iterations, lost_at, hold_at = 12, 3, 6
    world = node_count * per_node
    everyone = list(range(world))
    survivors = [rank for rank in everyone if rank != victim]
    processes = start(nodes[:node_count], tmp_path, iterations,
                      {victim: {"die_at": lost_at, "die_when": "after_ready"},
                       **{rank: {"loss_at": lost_at, "hold_at": hold_at} for rank in survivors}},
                      per_node=per_node)
    assert processes[victim].wait(timeout=60) == 17
    job = next(p.name for p in tmp_path.iterdir() if p.name.startswith("ft-"))
    replacement = start_one(nodes[:node_count], tmp_path, job, victim, iterations,
                            {"joiner": True}, per_node=per_node)
    outcome = dict(zip([*survivors, victim],
                       results([*(processes[rank] for rank in survivors), replacement]),
                       strict=True))
    joined = outcome[victim]
    assert "error" not in joined, joined
    start_at = joined["joined_at"]
    assert lost_at < start_at <= hold_at
    assert len(joined["digests"]) == iterations - start_at
    first = outcome[survivors[0]]
    for rank in survivors:
        assert "error" not in outcome[rank], outcome[rank]
        assert outcome[rank]["members"] == everyone
        assert outcome[rank]["world_sizes"][-1] == world
        assert outcome[rank]["digests"][start_at:] == joined["digests"]
        assert outcome[rank]["digests"] == first["digests"]
    for iteration in range(iterations):
        digest = first["digests"][iteration]
        if iteration < lost_at or iteration >= start_at:
            assert digest == expected_digest(everyone, iteration), iteration
        elif iteration > lost_at:
            assert digest == expected_digest(survivors, iteration), iteration
    assert joined["members"] == everyone and joined["epochs"][-1] == first["epochs"][-1]


def test_the_coordinators_daemon_killed_the_next_node_takes_over(
        nodes: list[LocalDaemon], tmp_path: Path) -> None:
    """SIGKILL of node 0's daemon, the job's coordinator and rendezvous store: node 1 (the
    lowest rank left) coordinates from its nodes' word, the survivors go on identical."""
    check_after_kill(kill_a_daemon(nodes, tmp_path, 12, 5, victim=0), 0, 12, 5)
    coordinating = daemon_status(nodes[1].socket)["coordinating"]
    assert coordinating == [] or coordinating[0]["epoch"] >= 1


def test_a_killed_coordinators_closed_link_is_taken_over_without_the_timeout(
        tmp_path: Path) -> None:
    """A killed process closes its connections: the survivors' links to the coordinator's
    daemon close while it still talks, and they turn to the roster's next node at once. The
    peer timeout here is longer than the test's whole budget, so only that close can have
    started the takeover; the survivors go on identical."""
    with daemon_set(tmp_path, 3, "--peer-timeout-s", "600") as nodes:
        outcome = kill_a_daemon(nodes, tmp_path, 12, 5, victim=0)
    check_after_kill(outcome, 0, 12, 5)


def test_two_daemons_killed_at_once_the_coordinator_among_them_leave_the_last_node_training(
        tmp_path: Path) -> None:
    """SIGKILL of node 0's daemon, the coordinator, and node 1's, the roster's next, at once:
    node 2 asks node 1 to take over, finds nothing listening there (its connection is refused:
    a dead daemon, not a silent one) and takes over for itself, both counted dead, and trains
    on alone. The peer timeout here is longer than the test's whole budget: only the closed
    link and the refused connection can have driven it."""
    with daemon_set(tmp_path, 3, "--peer-timeout-s", "600") as nodes:
        outcome = kill_a_daemon(nodes, tmp_path, 12, 5, 0, 1)
    check_after_kill(outcome, 0, 12, 5, 1)
    assert "not a majority" not in outcome[2]["stderr"]


@pytest.mark.parametrize("victim", [0, 1])
def test_two_nodes_survive_a_crashed_daemon(nodes: list[LocalDaemon], tmp_path: Path,
                                            victim: int) -> None:
    """Two nodes: one node is no majority, but a daemon that dies closes its connections, and
    the survivor's collective says so: a crash, not a split. The survivor goes on alone,
    also when the dead daemon was the coordinator (it takes over for itself)."""
    check_after_kill(kill_a_daemon(nodes[:2], tmp_path, 10, 4, victim), victim, 10, 4)


def hostile_replacement(nodes: list[LocalDaemon], job: str, rank: int, local_rank: int,
                        world_size: int = 4, layers: list[tuple[str, int]] | None = None) -> str:
    """A replacement on node 1 that does not fit: the words of the CommdError it gets (at
    its hello or its register)."""
    with pytest.raises(CommdError) as refused, Client(
            job=job, rank=rank, world_size=world_size, local_rank=local_rank,
            local_world_size=2, coordinator=nodes[0].address, socket=nodes[1].socket,
            timeout=20.0, fault_tolerance="continue") as client:
        client.register(layers or LAYERS, dtype="float64", op="avg", planner="wfbp")
    return str(refused.value)


def test_replacements_that_do_not_fit_a_running_node_are_refused_alone(
        nodes: list[LocalDaemon], tmp_path: Path) -> None:
    """Two nodes of two ranks; rank 3 (node 1's second) dies. Replacements for a live rank,
    for another slot, with another model or world size, and a second one for rank 3 once
    the first is in, are each refused alone, named; the job runs on untouched and the
    right replacement ends identical to the others."""
    iterations, lost_at, hold_at = 10, 3, 6
    survivors = [0, 1, 2]
    processes = start(nodes[:2], tmp_path, iterations,
                      {3: {"die_at": lost_at, "die_when": "after_ready"},
                       **{rank: {"loss_at": lost_at, "hold_at": hold_at} for rank in survivors}},
                      per_node=2)
    try:
        assert processes[3].wait(timeout=60) == 17
        job = next(p.name for p in tmp_path.iterdir() if p.name.startswith("ft-"))
        live = hostile_replacement(nodes, job, 2, 0)
        assert "rank 2 of job" in live and "is live" in live
        assert "was not one of its ranks on this node" in hostile_replacement(nodes, job, 3, 0)
        other_model = hostile_replacement(nodes, job, 3, 1, layers=[("a", 3000), ("b", 7)])
        assert "does not fit the running job" in other_model
        assert "first differing layer is 1" in other_model
        assert "world_size=5" in hostile_replacement(nodes, job, 3, 1, world_size=5)
        replacement = start_one(nodes[:2], tmp_path, job, 3, iterations, {"joiner": True},
                                per_node=2)
        processes.append(replacement)
        await_joined(tmp_path / job / "joined", replacement)
        second = hostile_replacement(nodes, job, 3, 1)
        assert "rank 3 of job" in second and "is live" in second
        outcome = results([*(processes[rank] for rank in survivors), replacement])
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
    for record in outcome:
        assert "error" not in record, record
        assert record["members"] == [0, 1, 2, 3]
    joined = outcome[-1]
    for record in outcome[:-1]:
        assert record["digests"][joined["joined_at"]:] == joined["digests"]


def await_joined(marker: Path, process: subprocess.Popen[str]) -> None:
    """Until the replacement says it is in (its marker file), with a deadline."""
    deadline = time.monotonic() + 60
    while not marker.exists():
        assert process.poll() is None, "the replacement exited before it joined"
        assert time.monotonic() < deadline, "the replacement never joined"
        time.sleep(0.02)  # polling a condition, with a deadline


@pytest.mark.parametrize(("node_count", "per_node"), [pytest.param(3, 1, id="3x1"),
                                                      pytest.param(2, 2, id="2x2")])
@pytest.mark.parametrize("fault", ["daemon", "coordinator", "stop"])
def test_a_lost_node_is_replaced_and_every_replica_ends_identical(
        tmp_path: Path, fault: str, node_count: int, per_node: int) -> None:
    """A node is lost (its daemon killed, the coordinator's daemon killed, or its daemon
    stopped until the others have dropped it); the survivors train on; then replacements
    for its ranks start (on a fresh daemon, or on the woken one once its old ranks are
    gone) and join: every replica ends every iteration since with the same averages."""
    iterations, strike_at, join_at = 14, 4, 8
    world = node_count * per_node
    everyone = list(range(world))
    lost_node = 0 if fault == "coordinator" else node_count - 1
    victims = [rank for rank in everyone if rank // per_node == lost_node]
    survivors = [rank for rank in everyone if rank not in victims]
    holds = {rank: {"holds": [[strike_at, "struck"]]} for rank in victims}
    holds |= {rank: {"holds": [[strike_at, "struck"], [join_at, "joined"]]}
              for rank in survivors}
    with daemon_set(tmp_path, node_count, "--peer-timeout-s", str(PEER_TIMEOUT_S)) as nodes:
        processes = start(nodes, tmp_path, iterations, holds, per_node=per_node)
        progress = next(p for p in tmp_path.iterdir() if p.name.startswith("ft-"))
        try:
            await_files([progress / f"held-{strike_at}-{rank}" for rank in everyone], processes)
            daemon = nodes[lost_node].process
            daemon.send_signal(signal.SIGSTOP if fault == "stop" else signal.SIGKILL)
            (progress / "struck").touch()
            await_files([progress / f"held-{join_at}-{rank}" for rank in survivors], processes)
            if fault == "stop":  # dropped by now: woken, it tells its ranks, which exit
                daemon.send_signal(signal.SIGCONT)
            for rank in victims:
                processes[rank].wait(timeout=60)
            host = nodes[lost_node] if fault == "stop" else LocalDaemon(
                tmp_path, "d-new", "--backend", "gloo", "--peer-timeout-s", str(PEER_TIMEOUT_S))
            coordinator = nodes[1 if fault == "coordinator" else 0].address
            try:
                replacements = [replacement(host, coordinator, progress, rank, world, per_node,
                                            iterations) for rank in victims]
                outcome = results([*(processes[rank] for rank in survivors), *replacements])
            finally:
                if host is not nodes[lost_node]:
                    host.stop()
        finally:
            for process in processes:
                if process.poll() is None:
                    process.kill()
    first = outcome[0]
    for record in outcome:
        assert "error" not in record and "members" in record, record
        assert record["members"] == everyone
        assert record["digests"] == first["digests"][record["joined_at"]:]
    last_in = max(record["joined_at"] for record in outcome)
    assert join_at <= last_in < iterations
    for iteration in range(last_in, iterations):
        assert first["digests"][iteration] == expected_digest(everyone, iteration), iteration


def test_a_one_node_job_takes_a_replacement_on_a_second_node(tmp_path: Path) -> None:
    """Two ranks on one daemon; rank 1 dies and its replacement starts on a second daemon. A
    job formed on one node had no rendezvous store: the change that takes the new node in
    opens one, and both nodes end every iteration since with the same averages."""
    iterations, lost_at, hold_at = 10, 3, 6
    with daemon_set(tmp_path, 2, "--peer-timeout-s", str(PEER_TIMEOUT_S)) as nodes:
        processes = start(nodes[:1], tmp_path, iterations,
                          {1: {"die_at": lost_at, "die_when": "after_ready"},
                           0: {"loss_at": lost_at, "hold_at": hold_at}}, per_node=2)
        try:
            assert processes[1].wait(timeout=60) == 17
            progress = next(p for p in tmp_path.iterdir() if p.name.startswith("ft-"))
            joiner = replacement(nodes[1], nodes[0].address, progress, 1, 2, 1, iterations)
            processes.append(joiner)
            await_joined(progress / "joined", joiner)
            survivor, joined = results([processes[0], joiner])
        finally:
            for process in processes:
                if process.poll() is None:
                    process.kill()
    for record in (survivor, joined):
        assert "error" not in record and record["members"] == [0, 1], record
    assert joined["digests"] == survivor["digests"][joined["joined_at"]:]
    for iteration in range(joined["joined_at"], iterations):
        assert survivor["digests"][iteration] == expected_digest([0, 1], iteration), iteration


def replacement(host: LocalDaemon, coordinator: str, progress: Path, rank: int, world: int,
                per_node: int, iterations: int) -> subprocess.Popen[str]:
    env = {**os.environ, "COMMD_FAULT_TOLERANCE": "continue"}
    spec = {"job": progress.name, "rank": rank, "world_size": world,
            "local_rank": rank % per_node, "local_world_size": per_node,
            "coordinator": coordinator, "socket": host.socket, "timeout": 60.0,
            "layers": LAYERS, "iterations": iterations, "progress_dir": str(progress),
            "joiner": True}
    return start_json_worker([sys.executable, WORKER], spec, env=env)


def await_files(paths: list[Path], processes: list[subprocess.Popen[str]]) -> None:
    """Until every one of ``paths`` exists (ranks at a gate), with a deadline."""
    deadline = time.monotonic() + 60
    while not all(path.exists() for path in paths):
        assert time.monotonic() < deadline, f"never reached: {[str(p) for p in paths]}"
        time.sleep(0.02)  # polling a condition, with a deadline


def test_a_survivors_restart_after_a_takeover_rejoins_with_its_unchanged_environment(
        tmp_path: Path) -> None:
    """3 × 1: the coordinator's daemon (node 0) is killed and node 1 takes over; then rank 2
    dies, and is restarted as torchrun restarts it, COMMD_COORDINATOR still naming the lost
    address where nothing listens: its daemon knows who took the job over and joins it
    there, and both nodes end every iteration since with the same averages."""
    iterations, strike_at, lost_at, join_at = 14, 3, 6, 9
    holds: dict[int, dict[str, Any]] = {
        0: {"holds": [[strike_at, "struck"]]},
        1: {"holds": [[strike_at, "struck"], [join_at, "joined"]]},
        2: {"holds": [[strike_at, "struck"]], "die_at": lost_at, "die_when": "after_ready"},
    }
    with daemon_set(tmp_path, 3, "--peer-timeout-s", "600") as nodes:
        processes = start(nodes, tmp_path, iterations, holds)
        progress = next(p for p in tmp_path.iterdir() if p.name.startswith("ft-"))
        try:
            await_files([progress / f"held-{strike_at}-{rank}" for rank in range(3)], processes)
            nodes[0].process.kill()
            (progress / "struck").touch()
            assert processes[2].wait(timeout=60) == 17
            restarted = replacement(nodes[2], nodes[0].address, progress, 2, 3, 1, iterations)
            processes.append(restarted)
            survivor, joined = results([processes[1], restarted])
            lost = results([processes[0]])[0]
        finally:
            for process in processes:
                if process.poll() is None:
                    process.kill()
    assert "error" in lost  # rank 0 went with its daemon
    for record in (survivor, joined):
        assert "error" not in record and record["members"] == [1, 2], record
    assert lost_at < joined["joined_at"] <= join_at
    assert joined["digests"] == survivor["digests"][joined["joined_at"]:]
    for iteration in range(joined["joined_at"], iterations):
        assert survivor["digests"][iteration] == expected_digest([1, 2], iteration), iteration

