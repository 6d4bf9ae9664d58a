"""The launch pattern of docs/fault-tolerance.md with examples/elastic_train.py: one
``torchrun --standalone --max-restarts`` per node, commd forming the job across them. A rank
that crashes is restarted by its own node's torchrun only, the restart rejoins the running job
from a live peer, and every rank ends with the same parameters. Three real daemons on
127.0.0.1, one rank each, real Gloo; the same with plain processes restarted by hand."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest
from bench_scripts import load_script

from commd.testing.daemons import LocalDaemon, commd_segments
from commd.testing.processes import finish, kill_all, run_launchers

pytestmark = pytest.mark.timeout(150)

TESTS = Path(__file__).resolve().parents[1]
WORKER = str(TESTS / "elastic_launch_worker.py")
SPAWN = str(TESTS / "elastic_spawn_worker.py")
EXAMPLE = TESTS.parent / "examples" / "elastic_train.py"
STEPS, EPOCHS, CRASH_AT, HOLD_AT, CRASH_RANK = 24, 4, 8, 10, 2
SUMMARY = re.compile(r"^elastic_train: rank=(\d+) joined_at=(\d+) steps_run=(\d+) counter=(\d+) "
                     r"world_size=(\d+) members=([\d,]+) checksum=([0-9a-f]{16})$", re.MULTILINE)


@pytest.fixture
def daemons(tmp_path: Path) -> Iterator[Callable[[int], list[LocalDaemon]]]:
    """``daemons(n)``: n real daemons on 127.0.0.1, stopped after the test."""
    before = commd_segments()
    started: list[LocalDaemon] = []

    def start(count: int) -> list[LocalDaemon]:
        for index in range(count):
            started.append(LocalDaemon(tmp_path, f"d{index}", "--backend", "gloo",
                                       "--peer-timeout-s", "3"))
        return started

    try:
        yield start
    finally:
        for daemon in started:
            daemon.stop()
    assert commd_segments() <= before


@pytest.fixture
def nodes(daemons: Callable[[int], list[LocalDaemon]]) -> list[LocalDaemon]:
    return daemons(3)


def options(marker: Path, crash_rank: int = CRASH_RANK) -> list[str]:
    return ["--steps", str(STEPS), "--epochs", str(EPOCHS), "--crash-at", str(CRASH_AT),
            "--crash-rank", str(crash_rank), "--crash-marker", str(marker)]


def torchrun(per_node: int, marker: Path, crash_rank: int = CRASH_RANK) -> list[str]:
    """One node's torchrun, as docs/fault-tolerance.md gives it."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
            f"--nproc-per-node={per_node}", "--max-restarts=3", WORKER, str(HOLD_AT),
            *options(marker, crash_rank)]


def node_env(nodes: list[LocalDaemon], job: str, node: int) -> dict[str, str]:
    """What a user exports on node ``node`` before its torchrun. Without
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE: the workers never open torchrun's store (no process
    group), so its sharing cannot get in a restart's way, and the test shows it."""
    env = {**os.environ, "COMMD_NODE_RANK": str(node), "COMMD_NNODES": str(len(nodes)),
           "COMMD_JOB": job, "COMMD_COORDINATOR": nodes[0].address,
           "COMMD_SOCKET": nodes[node].socket, "COMMD_FAULT_TOLERANCE": "continue",
           "COMMD_TIMEOUT": "60", "OMP_NUM_THREADS": "1"}
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    return env


def summaries(text: str) -> list[dict[str, str]]:
    keys = ("rank", "joined_at", "steps_run", "counter", "world_size", "members", "checksum")
    return [dict(zip(keys, match.groups(), strict=True)) for match in SUMMARY.finditer(text)]


def check_outcome(lines: list[dict[str, str]], output: str, world: int = 3,
                  restarted: tuple[int, ...] = (CRASH_RANK,)) -> None:
    """One summary per rank; the restarted ranks' from their restart, which joined the
    running job past the crash; everyone at the last step with the same parameters."""
    assert sorted(int(line["rank"]) for line in lines) == list(range(world)), output
    for line in lines:
        if int(line["rank"]) in restarted:
            assert CRASH_AT < int(line["joined_at"]) <= HOLD_AT, output
        else:
            assert line["joined_at"] == "0", output
        assert int(line["joined_at"]) + int(line["steps_run"]) == STEPS, output
        assert line["counter"] == str(STEPS), output  # the registered counter came along
        assert line["world_size"] == str(world), output
        assert line["members"] == ",".join(map(str, range(world))), output
    assert len({line["checksum"] for line in lines}) == 1, output


def test_one_torchrun_per_node_restarts_only_the_crashed_node(
        nodes: list[LocalDaemon], tmp_path: Path) -> None:
    """Node 2's worker crashes inside step 8's backward; nodes 0 and 1 finish that step
    without it and go on, their torchruns untouched; node 2's torchrun restarts its worker,
    which rejoins the running job from a live peer. Every torchrun exits 0."""
    job = f"elastic-{uuid.uuid4().hex[:8]}"
    marker = tmp_path / "crashed"
    logs = [tmp_path / f"node{node}.log" for node in range(3)]
    problem = run_launchers([torchrun(1, marker)] * 3,
                            [node_env(nodes, job, node) for node in range(3)], logs,
                            timeout_s=120)
    texts = [log.read_text(errors="replace") for log in logs]
    output = "\n".join(f"--- node {node}\n{text}" for node, text in enumerate(texts))
    assert problem == "", f"{problem}\n{output}"
    assert marker.exists(), output  # the crash happened
    check_outcome([line for text in texts for line in summaries(text)], output)
    # Only node 2's agent saw a failure and started its worker again; the others' workers
    # ran once, through the loss and the rejoin (their clients' warnings).
    assert "failed (exitcode: 1)" in texts[2], output
    assert "rank 2: joined the running job" in texts[2], output
    for node in (0, 1):
        assert "failed (exitcode" not in texts[node], output
        assert texts[node].count(f"rank {node}: epoch 0 done") == 1, output
        assert "world size 3 -> 2" in texts[node] and "world size 2 -> 3" in texts[node], output


def test_a_node_of_two_ranks_comes_back_whole(
        daemons: Callable[[int], list[LocalDaemon]], tmp_path: Path) -> None:
    """Two nodes of two ranks: rank 3 crashes; node 1's torchrun stops rank 2 too (as it
    always stops a node's workers) and starts both again; both rejoin node 0's running job
    at once, on the node that no longer runs a rank of the job."""
    nodes = daemons(2)
    job = f"elastic-{uuid.uuid4().hex[:8]}"
    marker = tmp_path / "crashed"
    logs = [tmp_path / f"node{node}.log" for node in range(2)]
    problem = run_launchers([torchrun(2, marker, crash_rank=3)] * 2,
                            [node_env(nodes, job, node) for node in range(2)], logs,
                            timeout_s=120)
    texts = [log.read_text(errors="replace") for log in logs]
    output = "\n".join(f"--- node {node}\n{text}" for node, text in enumerate(texts))
    assert problem == "", f"{problem}\n{output}"
    assert marker.exists(), output
    check_outcome([line for text in texts for line in summaries(text)], output, world=4,
                  restarted=(2, 3))
    assert "failed (exitcode" not in texts[0], output
    # How the loss reaches node 0 varies (rank 3's exit, or a collective that rank 2's
    # SIGTERM breaks; the second loss and the rejoin may share an epoch): only that it did.
    assert "membership epoch" in texts[0], output


def test_plain_processes_with_a_restart_by_hand(nodes: list[LocalDaemon],
                                                tmp_path: Path) -> None:
    """The same script without torchrun, and the rank that crashes is rank 0 (the buffer
    and state source of a fresh job; its daemon stays): starting it again by hand, same job
    and rank, brings it back into the job that ranks 1 and 2 kept running."""
    job = f"elastic-{uuid.uuid4().hex[:8]}"
    marker = tmp_path / "crashed"

    def start(rank: int) -> subprocess.Popen[str]:
        env = {**node_env(nodes, job, rank), "RANK": str(rank), "WORLD_SIZE": "3",
               "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
        for name in ("COMMD_NODE_RANK", "COMMD_NNODES"):
            del env[name]
        return subprocess.Popen([sys.executable, WORKER, str(HOLD_AT),
                                 *options(marker, crash_rank=0)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env)

    first = [start(rank) for rank in range(3)]
    running = list(first)
    try:
        crashed = finish([first[0]], 90.0)[0]
        assert crashed.returncode == 1, crashed.stderr
        assert marker.exists(), crashed.stderr
        running.append(start(0))
        outcome = finish([running[-1], first[1], first[2]], 90.0)
    finally:
        kill_all(running)
    output = "\n".join(f"--- rank {rank}\n{done.stdout}{done.stderr[-3000:]}"
                       for rank, done in enumerate(outcome))
    assert [done.returncode for done in outcome] == [0, 0, 0], output
    check_outcome([line for done in outcome for line in summaries(done.stdout)], output,
                  restarted=(0,))


def test_one_spawn_per_node_loses_its_node_and_a_second_spawn_brings_it_back(
        daemons: Callable[[int], list[LocalDaemon]], tmp_path: Path) -> None:
    """Two nodes, each one ``torch.multiprocessing.spawn`` of two ranks: rank 3 crashes, and
    spawn ends rank 2 too (its own rule), so node 1 is lost whole; node 0 trains on. Running
    node 1's spawn again brings ranks 2 and 3 back into the running job."""
    nodes = daemons(2)
    job = f"elastic-{uuid.uuid4().hex[:8]}"
    marker = tmp_path / "crashed"

    def spawn_node(node: int) -> subprocess.Popen[str]:
        return subprocess.Popen([sys.executable, SPAWN, "2", str(HOLD_AT),
                                 *options(marker, crash_rank=3)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=node_env(nodes, job, node))

    first = [spawn_node(0), spawn_node(1)]
    running = list(first)
    try:
        lost = finish([first[1]], 90.0)[0]
        assert lost.returncode != 0 and marker.exists(), lost.stderr[-3000:]
        running.append(spawn_node(1))
        outcome = finish([first[0], running[-1]], 120.0)
    finally:
        kill_all(running)
    output = "\n".join(f"--- node {node}\n{done.stdout}{done.stderr[-3000:]}"
                       for node, done in enumerate(outcome))
    assert [done.returncode for done in outcome] == [0, 0], output
    check_outcome([line for done in outcome for line in summaries(done.stdout)], output,
                  world=4, restarted=(2, 3))


def load_example() -> ModuleType:
    return load_script(EXAMPLE, "elastic_train_example")


@pytest.mark.parametrize(("argv", "named"), [
    (["--steps", "0"], "--steps"),
    (["--steps", "many"], "--steps"),
    (["--steps", "4", "--epochs", "5"], "--epochs"),
    (["--epochs", "0"], "--epochs"),
    (["--batch-size", "0"], "--batch-size"),
    (["--samples", "8", "--batch-size", "16"], "--batch-size"),
    (["--crash-at", "3"], "--crash-rank"),
    (["--crash-rank", "1"], "--crash-at"),
    (["--crash-at", "1e400", "--crash-rank", "1"], "--crash-at"),
    (["--lr", ""], "--lr"),
    (["--step-time", "-1"], "--step-time"),
    (["--step-time", "nan"], "--step-time"),
    (["--step-time", "1e9"], "--step-time"),
    (["--unknown"], "--unknown"),
])
def test_the_example_refuses_bad_options_naming_them(argv: list[str], named: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Bad options end the example before it talks to commd, with argparse's usage error
    naming the option."""
    example = load_example()
    with pytest.raises(SystemExit) as exit_info:
        example.parse_args(argv)
    assert exit_info.value.code == 2
    assert named in capsys.readouterr().err


def test_the_crash_marker_defaults_to_one_per_job_and_rank(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Without --crash-marker the marker is named by the job and the rank, so another job
    crashes again and a restart of this one does not."""
    monkeypatch.setenv("COMMD_JOB", "job-a")
    example = load_example()
    args = example.parse_args(["--crash-at", "3", "--crash-rank", "1"])
    assert args.crash_marker.name == "elastic_train-job-a-rank1.crashed"
    assert example.parse_args([]).crash_marker is None
