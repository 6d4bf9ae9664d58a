"""fault_tolerance="continue" under real faults (issue 36's proof): a daemon that stops
answering (SIGSTOP) and a link cut in a network namespace, on two layouts: three daemons
with one rank each, and two daemons with two ranks each (``--peer-timeout-s 3``,
``tests/ft_fault_worker.py``, real Gloo). The victim is always the last node, never the
coordinator's (node 0, rank 0's).

The fault lands in iteration ``HOLD_AT`` on every rank (``ft_fault_worker``'s hold): either
``between`` two iterations (every rank held until the fault is in place) or ``in_wait``
(only the victim's ranks are held; the survivors have marked their layers and wait for the
victim when it fails). Either way the victim contributed nothing to that iteration: before
it the survivors' averages are every rank's, from it on exactly the survivors'. The
survivors must run every iteration without an error, agree bit for bit and see only
themselves as members.

- ``test_a_stopped_daemon_is_dropped``: the victim's daemon is stopped; once the survivors
  have finished it is continued, and its ranks must get a CommdError soon after (their node
  was dropped), never wait until their timeout.
- ``test_a_dropped_node_that_wakes_leaves_the_survivors_alone``: the same, but the victim
  is continued while the survivors still train (held in iteration ``WAKE_AT``, past the
  loss): its ranks get a CommdError, and the survivors go on untouched, with exactly their
  own averages (a woken node taken back in, or a second coordinator of the job started for
  it, would show in them).
- ``test_a_cut_link_is_dropped`` (``netns``: root only, skipped elsewhere): the daemons run
  in network namespaces on a bridge; the victim's link is set down. Its ranks get a
  CommdError too (their node lost the coordinator), never train on alone.

With three nodes the survivors are a majority; with two, a half that holds the coordinator,
which goes on where the other half cannot (the majority rule, docs/fault-tolerance.md). The
last two tests also run with ``--peer-timeout-s 7``, longer than a takeover's wait for the
roster: there the cut-off (or woken) node asks the roster's next node to take over the
coordination, and only finds itself: one node of three is no majority, one of two is a half
without the coordinator, so its ranks get a CommdError instead of training on alone beside
the survivors (no split brain).
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from test_fault_tolerance import LAYERS, expected_digest

from commd.testing.daemons import LocalDaemon, daemon_set
from commd.testing.processes import FinishTimeout, finish, kill_all, start_json_worker

pytestmark = pytest.mark.timeout(180)

WORKER = str(Path(__file__).parents[1] / "ft_fault_worker.py")
PEER_TIMEOUT_S = 3
ITERATIONS = 8
HOLD_AT = 3  # the fault lands in this iteration
WAKE_AT = 5  # the survivors wait here while the dropped node wakes
CLIENT_TIMEOUT_S = 90.0  # a rank that hung would wait this long
TOLD_WITHIN_S = 30.0  # the dropped node's ranks hear of it well before their timeout
# Longer than the ~5 s a daemon that takes over coordination waits for the roster's nodes,
# shorter than the 10 s of silence after which a rank gives up on its stopped daemon.
LONG_PEER_TIMEOUT_S = 7

Hold = dict[str, Any]  # ft_fault_worker's {"name", "at", "ranks"}


@dataclass(frozen=True)
class Layout:
    """``nodes`` daemons with ``per_node`` ranks each; the last node is the victim."""

    nodes: int
    per_node: int

    @property
    def world_size(self) -> int:
        return self.nodes * self.per_node

    @property
    def everyone(self) -> list[int]:
        return list(range(self.world_size))

    @property
    def victims(self) -> list[int]:
        return self.everyone[-self.per_node:]

    @property
    def survivors(self) -> list[int]:
        return self.everyone[:-self.per_node]

    def node_of(self, rank: int) -> int:
        return rank // self.per_node


LAYOUTS = [pytest.param(Layout(3, 1), id="3x1"), pytest.param(Layout(2, 2), id="2x2")]


def fault_hold(layout: Layout, when: str) -> Hold:
    """``between``: every rank held before HOLD_AT; ``in_wait``: the victim's only, the
    others have marked their layers."""
    return {"name": "fault", "at": HOLD_AT,
            "ranks": layout.everyone if when == "between" else layout.victims}


@contextlib.contextmanager
def daemons(workdir: Path, layout: Layout, prefixes: Sequence[Sequence[str]] = (),
            hosts: Sequence[str] = (),
            peer_timeout_s: float = PEER_TIMEOUT_S) -> Iterator[list[LocalDaemon]]:
    """A daemon per node; a stopped one is continued before it is asked to stop."""
    with daemon_set(workdir, layout.nodes, "--peer-timeout-s", f"{peer_timeout_s:g}",
                    prefixes=prefixes, hosts=hosts) as started:
        yield started


def start(nodes: list[LocalDaemon], layout: Layout, progress: Path,
          holds: list[Hold]) -> list[subprocess.Popen[str]]:
    progress.mkdir()
    return start_ranks(nodes, layout, progress, holds, f"ftf-{uuid.uuid4().hex[:8]}",
                       layout.everyone)


def start_ranks(nodes: list[LocalDaemon], layout: Layout, progress: Path, holds: list[Hold],
                job: str, ranks: Sequence[int]) -> list[subprocess.Popen[str]]:
    processes = []
    for rank in ranks:
        spec = {"job": job, "rank": rank, "world_size": layout.world_size,
                "local_rank": rank % layout.per_node, "local_world_size": layout.per_node,
                "coordinator": nodes[0].address, "socket": nodes[layout.node_of(rank)].socket,
                "timeout": CLIENT_TIMEOUT_S, "layers": LAYERS, "iterations": ITERATIONS,
                "holds": holds, "progress_dir": str(progress)}
        processes.append(start_json_worker([sys.executable, WORKER], spec))
    return processes


def await_hold(progress: Path, hold: Hold, ranks: Sequence[int],
               processes: list[subprocess.Popen[str]]) -> None:
    """Every rank of ``ranks`` is at ``hold``: held there, or past its marks; polled, with a
    deadline."""
    name = hold["name"]
    files = [f"{name}-{'held' if rank in hold['ranks'] else 'marked'}-{rank}" for rank in ranks]
    deadline = time.monotonic() + 60
    while not all((progress / file).exists() for file in files):
        exited = [rank for rank in ranks if processes[rank].poll() is not None]
        assert not exited, f"ranks {exited} exited before the {name} hold"
        assert time.monotonic() < deadline, f"the ranks never reached the {name} hold"
        time.sleep(0.02)  # polling a condition, with a deadline


def release(progress: Path, hold: Hold) -> None:
    (progress / f"{hold['name']}-go").touch()


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


def check_survivors(outcome: list[dict[str, Any]], layout: Layout,
                    nodes: list[LocalDaemon]) -> None:
    logs = "\n".join(f"--- {d.name}\n{d.log()[-2000:]}" for d in nodes)
    survivors = layout.survivors
    for record in outcome:
        assert "error" not in record, f"{record}\n{logs}"
        assert len(record["digests"]) == ITERATIONS, record
        assert record["members"] == survivors
        assert record["world_sizes"][-1] == len(survivors)
        assert record["epochs"][-1] >= 1
    first = outcome[0]["digests"]
    for record in outcome[1:]:
        assert record["digests"] == first, f"the survivors diverged\n{logs}"
    for iteration in range(ITERATIONS):
        ranks = layout.everyone if iteration < HOLD_AT else survivors
        assert first[iteration] == expected_digest(ranks, iteration), f"{iteration}\n{logs}"


def check_dropped(records: list[dict[str, Any]], node: LocalDaemon) -> None:
    """The victim's ranks: a CommdError in the iteration of the fault, never the results of
    a job of their own."""
    for record in records:
        assert record.get("error_type") == "CommdError", f"{record}\n{node.log()[-3000:]}"
        assert record["error"].startswith("commd: "), record
        assert len(record["digests"]) == HOLD_AT, record


def run_fault(nodes: list[LocalDaemon], layout: Layout, progress: Path, when: str,
              fault: Any) -> tuple[list[dict[str, Any]], list[subprocess.Popen[str]]]:
    """Start the job, inject ``fault()`` in iteration HOLD_AT, let the held ranks go, and
    collect the survivors; returns their records and every process (the victim's ranks
    still running)."""
    hold = fault_hold(layout, when)
    processes = start(nodes, layout, progress, [hold])
    try:
        await_hold(progress, hold, layout.everyone, processes)
        fault()
        release(progress, hold)
        return collect(processes[:len(layout.survivors)], 90, nodes), processes
    except BaseException:
        kill_all(processes)
        raise


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_stopped_daemon_is_dropped(tmp_path: Path, layout: Layout) -> None:
    """Stopped while the survivors wait for it; continued once they have finished."""
    with daemons(tmp_path, layout) as nodes:
        victim = nodes[-1].process
        try:
            outcome, processes = run_fault(nodes, layout, tmp_path / "progress", "in_wait",
                                           lambda: victim.send_signal(signal.SIGSTOP))
        finally:
            continued_at = time.time()
            victim.send_signal(signal.SIGCONT)
        dropped = collect(processes[len(layout.survivors):], TOLD_WITHIN_S + 10, nodes)
        check_survivors(outcome, layout, nodes)
        check_dropped(dropped, nodes[-1])
    for record in dropped:
        assert record["error_at"] - continued_at < TOLD_WITHIN_S, record


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("peer_timeout_s", [
    PEER_TIMEOUT_S,
    LONG_PEER_TIMEOUT_S,
])
def test_a_dropped_node_that_wakes_leaves_the_survivors_alone(tmp_path: Path,
                                                              peer_timeout_s: int,
                                                              layout: Layout) -> None:
    """Stopped between two iterations, continued while the survivors still train."""
    fault = fault_hold(layout, "between")
    wake = {"name": "wake", "at": WAKE_AT, "ranks": layout.survivors}
    with daemons(tmp_path, layout, peer_timeout_s=peer_timeout_s) as nodes:
        victim = nodes[-1].process
        processes = start(nodes, layout, tmp_path / "progress", [fault, wake])
        try:
            await_hold(tmp_path / "progress", fault, layout.everyone, processes)
            victim.send_signal(signal.SIGSTOP)
            release(tmp_path / "progress", fault)
            # past the loss: the survivors ran iterations HOLD_AT.. WAKE_AT - 1 without it
            await_hold(tmp_path / "progress", wake, layout.survivors, processes)
        finally:
            continued_at = time.time()
            victim.send_signal(signal.SIGCONT)
        try:
            dropped = collect(processes[len(layout.survivors):], TOLD_WITHIN_S + 10, nodes)
            release(tmp_path / "progress", wake)
            outcome = collect(processes[:len(layout.survivors)], 60, nodes)
        finally:
            kill_all(processes)
        check_survivors(outcome, layout, nodes)
        check_dropped(dropped, nodes[-1])
    for record in dropped:
        assert record["error_at"] - continued_at < TOLD_WITHIN_S, record


@pytest.mark.netns
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("when", "peer_timeout_s"), [
    ("in_wait", PEER_TIMEOUT_S),
    ("between", LONG_PEER_TIMEOUT_S),
])
def test_a_cut_link_is_dropped(tmp_path: Path, when: str, peer_timeout_s: int,
                               layout: Layout) -> None:
    with netns_daemons(tmp_path, layout, peer_timeout_s) as (nodes, link):
        outcome, processes = run_fault(nodes, layout, tmp_path / "progress", when,
                                       lambda: link("down"))
        cut = collect(processes[len(layout.survivors):], CLIENT_TIMEOUT_S, nodes)
        check_survivors(outcome, layout, nodes)
        check_dropped(cut, nodes[-1])


@contextlib.contextmanager
def netns_daemons(workdir: Path, layout: Layout, peer_timeout_s: float = PEER_TIMEOUT_S
                  ) -> Iterator[tuple[list[LocalDaemon], Any]]:
    """A daemon per node, each in its network namespace on one bridge, and ``link(state)``
    setting the victim's link "down" or "up"; skips where there are no namespaces (not
    root, or no ``ip``)."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    from commd.testing.netbed import NetBed, NetBedUnavailable

    try:
        bed = NetBed(nodes=layout.nodes, rate=None).__enter__()
    except NetBedUnavailable as exc:
        pytest.skip(f"no network namespaces here: {exc}")
    try:
        with daemons(workdir, layout, [bed.argv(node, []) for node in range(layout.nodes)],
                     [bed.address(node) for node in range(layout.nodes)],
                     peer_timeout_s) as nodes:
            yield nodes, lambda state: bed.run(layout.nodes - 1,
                                               ["ip", "link", "set", "eth0", state])
    finally:
        bed.__exit__(None, None, None)


REJOIN_AT = 6  # the survivors wait here for the cut-off node's replacements


@pytest.mark.netns
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_cut_off_node_is_replaced_once_its_link_is_back(tmp_path: Path,
                                                          layout: Layout) -> None:
    """The victim's link is cut and its ranks fail; the survivors train on to REJOIN_AT and
    wait. The link comes back, and replacements for its ranks start on its daemon (the
    coordinator's word that the node was dropped may come in late: test_membership_hostile
    checks that it cannot end them). They join, and every replica ends every iteration
    since identical."""
    fault = fault_hold(layout, "in_wait")
    rejoin = {"name": "rejoin", "at": REJOIN_AT, "ranks": layout.survivors}
    progress = tmp_path / "progress"
    with netns_daemons(tmp_path, layout) as (nodes, link):
        progress.mkdir()
        job = f"ftf-{uuid.uuid4().hex[:8]}"
        processes = start_ranks(nodes, layout, progress, [fault, rejoin], job,
                                layout.everyone)
        try:
            await_hold(progress, fault, layout.everyone, processes)
            link("down")
            release(progress, fault)
            check_dropped(collect(processes[len(layout.survivors):], CLIENT_TIMEOUT_S, nodes),
                          nodes[-1])
            await_hold(progress, rejoin, layout.survivors, processes)
            link("up")
            replacements = start_ranks(nodes, layout, progress, [], job, layout.victims)
            processes += replacements
            await_files([progress / f"joined-{rank}" for rank in layout.victims], replacements)
            release(progress, rejoin)
            outcome = collect([*processes[:len(layout.survivors)], *replacements], 90, nodes)
        finally:
            kill_all(processes)
    first = outcome[0]
    for record in outcome:
        assert "error" not in record, record
        assert record["members"] == layout.everyone
        assert record["digests"] == first["digests"][record["joined_at"]:]
    assert all(record["joined_at"] == REJOIN_AT for record in outcome[len(layout.survivors):])
    for iteration in range(REJOIN_AT, ITERATIONS):
        assert first["digests"][iteration] == expected_digest(layout.everyone, iteration)


def await_files(paths: list[Path], processes: list[subprocess.Popen[str]]) -> None:
    """Until every one of ``paths`` exists, with a deadline; a process that exits first
    fails the test."""
    deadline = time.monotonic() + 60
    while not all(path.exists() for path in paths):
        exited = [p.args for p in processes if p.poll() is not None]
        assert not exited, f"exited before it joined: {str(exited)[:300]}"
        assert time.monotonic() < deadline, f"never appeared: {[str(p) for p in paths]}"
        time.sleep(0.02)  # polling a condition, with a deadline
