"""fault_tolerance="continue" under real faults (issue 36's proof): a daemon that stops
answering (SIGSTOP) and a link cut in a network namespace. Three daemons with
``--peer-timeout-s 3``, one rank each (``tests/ft_fault_worker.py``), real Gloo.

The fault lands in iteration ``HOLD_AT`` on every rank (``ft_fault_worker``'s hold): either
``between`` two iterations (every rank held until the fault is in place) or ``in_wait``
(only node 2's rank is held; the survivors have marked their layers and wait for node 2 when
it fails). Either way node 2 contributed nothing to that iteration: before it the survivors'
averages are all three ranks', from it on exactly the two survivors'. The survivors must run
every iteration without an error, agree bit for bit and see members [0, 1].

- ``test_a_stopped_daemon_is_dropped``: node 2's daemon is stopped; once the survivors have
  finished it is continued, and its rank must get a CommdError soon after (its node was
  dropped), never wait until its timeout.
- ``test_a_cut_link_is_dropped`` (``netns``: root only, skipped elsewhere): the daemons run
  in three network namespaces on a bridge; node 2's link is set down. Its rank gets a
  CommdError too (its node lost the coordinator).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from test_fault_tolerance import LAYERS, expected_digest

from commd.testing.daemons import LocalDaemon, commd_segments
from commd.testing.processes import FinishTimeout, finish, kill_all, start_json_worker

pytestmark = pytest.mark.timeout(180)

WORKER = str(Path(__file__).with_name("ft_fault_worker.py"))
PEER_TIMEOUT_S = 3
ITERATIONS = 8
HOLD_AT = 3
CLIENT_TIMEOUT_S = 60.0  # a rank that hung would wait this long
TOLD_WITHIN_S = 20.0  # the dropped node's rank hears of it well before its timeout
SURVIVORS = [0, 1]


@contextlib.contextmanager
def daemons(workdir: Path, prefixes: Sequence[Sequence[str]] = ((), (), ()),
            hosts: Sequence[str] = ("127.0.0.1",) * 3) -> Iterator[list[LocalDaemon]]:
    """Three daemons; a stopped one is continued before it is asked to stop."""
    before = commd_segments()
    started: list[LocalDaemon] = []
    try:
        for index, (prefix, host) in enumerate(zip(prefixes, hosts, strict=True)):
            started.append(LocalDaemon(workdir, f"d{index}", "--backend", "gloo",
                                       "--peer-timeout-s", str(PEER_TIMEOUT_S),
                                       listen_host=host, prefix=prefix))
        yield started
    finally:
        for daemon in started:
            if daemon.process.poll() is None:
                os.kill(daemon.process.pid, signal.SIGCONT)  # a stopped one must hear TERM
            daemon.stop()
    assert commd_segments() <= before


def start(nodes: list[LocalDaemon], progress: Path, when: str) -> list[subprocess.Popen[str]]:
    job = f"ftf-{uuid.uuid4().hex[:8]}"
    progress.mkdir()
    processes = []
    for rank, node in enumerate(nodes):
        spec = {"job": job, "rank": rank, "world_size": len(nodes), "local_rank": 0,
                "local_world_size": 1, "coordinator": nodes[0].address, "socket": node.socket,
                "timeout": CLIENT_TIMEOUT_S, "layers": LAYERS, "iterations": ITERATIONS,
                "hold_at": HOLD_AT, "progress_dir": str(progress),
                "hold_ranks": [0, 1, 2] if when == "between" else [2]}
        processes.append(start_json_worker([sys.executable, WORKER], spec))
    return processes


def await_held(progress: Path, processes: list[subprocess.Popen[str]], when: str) -> None:
    """Every rank is where ``when`` wants it in iteration HOLD_AT; polled, with a deadline."""
    files = ["held-0", "held-1"] if when == "between" else ["marked-0", "marked-1"]
    files.append("held-2")
    deadline = time.monotonic() + 60
    while not all((progress / name).exists() for name in files):
        exited = [rank for rank, p in enumerate(processes) if p.poll() is not None]
        assert not exited, f"ranks {exited} exited before the fault"
        assert time.monotonic() < deadline, "the ranks never reached the fault"
        time.sleep(0.02)  # polling a condition, with a deadline


def collect(processes: list[subprocess.Popen[str]], timeout_s: float,
            nodes: list[LocalDaemon]) -> list[dict[str, Any]]:
    """Each process's last JSON line with its exit code and stderr; a hang fails the test
    with the daemons' logs."""
    try:
        finished = finish(processes, timeout_s)
    except FinishTimeout as timeout:
        logs = "\n".join(f"--- {d.name}\n{d.log()[-3000:]}" for d in nodes)
        pytest.fail(f"{timeout}\n{logs}")
    out = []
    for done in finished:
        final = done.last_json()
        final.update(returncode=done.returncode, stderr=done.stderr[-3000:])
        out.append(final)
    return out


def check_survivors(outcome: list[dict[str, Any]]) -> None:
    for rank in SURVIVORS:
        record = outcome[rank]
        assert "error" not in record, record
        assert len(record["digests"]) == ITERATIONS, record
        assert record["members"] == SURVIVORS
        assert record["world_sizes"][-1] == len(SURVIVORS)
        assert record["epochs"][-1] >= 1
    first = outcome[SURVIVORS[0]]["digests"]
    assert outcome[SURVIVORS[1]]["digests"] == first, "the survivors diverged"
    for iteration in range(ITERATIONS):
        ranks = [0, 1, 2] if iteration < HOLD_AT else SURVIVORS
        assert first[iteration] == expected_digest(ranks, iteration), iteration


def run_fault(nodes: list[LocalDaemon], progress: Path, when: str, fault: Any) -> tuple[
        list[dict[str, Any]], list[subprocess.Popen[str]]]:
    """Start the job, inject ``fault()`` in iteration HOLD_AT, let the held ranks go, and
    collect the survivors; returns their records and every process (node 2's rank still
    running)."""
    processes = start(nodes, progress, when)
    try:
        await_held(progress, processes, when)
        fault()
        (progress / "go").touch()
        return collect(processes[:2], 90, nodes), processes
    except BaseException:
        kill_all(processes)
        raise


WHEN = ["between", "in_wait"]


@pytest.mark.parametrize("when", WHEN)
def test_a_stopped_daemon_is_dropped(tmp_path: Path, when: str) -> None:
    with daemons(tmp_path) as nodes:
        victim = nodes[2].process
        try:
            outcome, processes = run_fault(nodes, tmp_path / "progress", when,
                                           lambda: victim.send_signal(signal.SIGSTOP))
        finally:
            continued_at = time.time()
            victim.send_signal(signal.SIGCONT)
        (dropped,) = collect(processes[2:], TOLD_WITHIN_S + 10, nodes)
        logs = nodes[2].log()[-3000:]
    check_survivors(outcome)
    assert dropped.get("error_type") == "CommdError", f"{dropped}\n{logs}"
    assert len(dropped["digests"]) == HOLD_AT, dropped
    assert dropped["error_at"] - continued_at < TOLD_WITHIN_S, dropped
    assert dropped["error"].startswith("commd: "), dropped


@pytest.mark.netns
@pytest.mark.parametrize("when", WHEN)
def test_a_cut_link_is_dropped(tmp_path: Path, when: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from netbed import NetBed, NetBedUnavailable

    try:
        bed = NetBed(nodes=3, rate=None).__enter__()
    except NetBedUnavailable as exc:
        pytest.skip(f"no network namespaces here: {exc}")
    try:
        with daemons(tmp_path, [bed.argv(node, []) for node in range(3)],
                     [bed.address(node) for node in range(3)]) as nodes:
            outcome, processes = run_fault(nodes, tmp_path / "progress", when, lambda: bed.run(
                2, ["ip", "link", "set", "eth0", "down"]))
            (cut,) = collect(processes[2:], CLIENT_TIMEOUT_S, nodes)
            logs = nodes[2].log()[-3000:]
            coordinator = nodes[0].address
    finally:
        bed.__exit__(None, None, None)
    check_survivors(outcome)
    assert cut.get("error_type") == "CommdError", f"{cut}\n{logs}"
    assert len(cut["digests"]) == HOLD_AT, cut
    # its daemon cannot tell a cut link from a silent coordinator, and says both
    assert f"the coordinator daemon at {coordinator} has sent nothing" in cut["error"], cut
