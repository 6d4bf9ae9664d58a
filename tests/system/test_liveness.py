"""Every stall is named within seconds: a stopped or unreachable daemon, a link down, a rank
that stops marking. Real daemons and ranks; the waits are bounded by the fault's deadline."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from commd.testing.ports import free_port
from commd.testing.processes import kill_all
from commd.testing.ranks import JobSpec, await_registered, collect, daemon_status, start_ranks

LAYERS = [("conv.weight", 27), ("conv.bias", 3), ("fc.weight", 130), ("fc.bias", 10)]
TARGET_S = 15.0  # every rank errors within this of the fault (the target)
SLACK_S = 10.0  # a loaded 2-core machine: what the assertions allow beyond the target


def endless(job: str, nodes: list[Any], **extra: Any) -> JobSpec:
    """A job that runs until something stops it: ranks fail, they never finish."""
    return JobSpec(job, nodes, 2, LAYERS, iterations=10**6, timeout=120,
                   overrides={r: {"skip_results": True} for r in range(4)}, **extra)


def errors_after(processes: list[Any], fault: Any) -> tuple[list[dict[str, Any]], float]:
    """Run ``fault()``, then collect every rank; the seconds until the last one exited."""
    fault()
    started = time.monotonic()
    results = collect(processes, timeout=TARGET_S + 2 * SLACK_S)
    return results, time.monotonic() - started


def one_daemon_stopped(start_daemon: Any, job: str, stopped: int
                       ) -> tuple[list[Any], list[dict[str, Any]]]:
    """Two nodes running ``job``; daemon ``stopped`` is SIGSTOPped once every rank has
    registered, and every rank must error within the target. The nodes, and each rank's
    result."""
    nodes = [start_daemon(), start_daemon()]
    processes = start_ranks(endless(job, nodes))
    try:
        await_registered(processes)
        results, took = errors_after(processes, lambda: nodes[stopped].process.send_signal(
            signal.SIGSTOP))
    finally:
        nodes[stopped].process.send_signal(signal.SIGCONT)
        kill_all(processes)
    assert took < TARGET_S + SLACK_S, took
    return nodes, results


def test_a_stopped_daemon_fails_every_rank_naming_it(start_daemon) -> None:
    nodes, results = one_daemon_stopped(start_daemon, "stopped", stopped=1)
    for result in results[:2]:  # node 0: its coordinator names the silent node
        assert result.get("error_type") == "CommdError", result
        assert "node 1 (127.0.0.1, ranks [2, 3]) has sent nothing" in result["error"], result
    for result in results[2:]:  # node 1: its ranks notice their daemon is silent
        assert result.get("error_type") == "CommdError", result
        assert f"the daemon at {nodes[1].socket} has sent nothing" in result["error"], result


def test_a_stopped_coordinator_fails_every_rank_naming_it(start_daemon) -> None:
    nodes, results = one_daemon_stopped(start_daemon, "headless", stopped=0)
    for result in results[2:]:
        assert f"the coordinator daemon at {nodes[0].address} has sent nothing" in \
            result.get("error", ""), result
    for result in results[:2]:
        assert f"the daemon at {nodes[0].socket} has sent nothing" in result.get("error", ""), \
            result


def test_a_killed_coordinator_fails_every_other_rank_at_once_naming_it(start_daemon) -> None:
    """SIGKILL of the coordinator's daemon closes its connections: the link to it closes
    while it still talks, and the job's ranks fail naming it. The job's two ranks are on the
    other daemon, so no collective crosses to the killed one and could fail first; the peer
    timeout is longer than the test's budget: only that close can have told them."""
    coordinator = start_daemon("--peer-timeout-s", "600")
    node = start_daemon("--peer-timeout-s", "600")
    spec = JobSpec("beheaded", [node], 2, LAYERS, iterations=10**6, timeout=120,
                   overrides={r: {"skip_results": True, "coordinator": coordinator.address}
                              for r in range(2)})
    processes = start_ranks(spec)
    try:
        await_registered(processes)
        results, took = errors_after(processes, coordinator.process.kill)
    finally:
        kill_all(processes)
    assert took < TARGET_S + SLACK_S, took
    for result in results:
        assert result.get("error_type") == "CommdError", result
        assert f"the coordinator daemon at {coordinator.address} closed its connection: its " \
            "process ended" in result["error"], result


def test_an_unreachable_coordinator_is_named_within_seconds(start_daemon) -> None:
    node = start_daemon()
    nowhere = f"127.0.0.1:{free_port()}"  # nothing listens there
    spec = JobSpec("lost", [node], 1, LAYERS, timeout=60,
                   overrides={0: {"world_size": 2, "coordinator": nowhere}})
    started = time.monotonic()
    (result,) = collect(start_ranks(spec), timeout=40)
    took = time.monotonic() - started
    assert f"no commd daemon answers at {nowhere} (peer port of the coordinator daemon)" in \
        result.get("error", ""), result
    assert took < 5.0 + SLACK_S, took


def test_a_stalled_rank_is_named(start_daemon) -> None:
    # Warned at 2 s; failed at 8 s, so that the waiting ranks heard the warning (every 2 s)
    # before they exit on their own and their logs can be read.
    flags = ["--stall-warn-s", "2", "--stall-timeout-s", "8", "--watchdog-floor-s", "60"]
    nodes = [start_daemon(*flags), start_daemon(*flags)]
    processes = start_ranks(endless("stall", nodes))
    try:
        await_registered(processes)
        stopped_at = time.monotonic()
        processes[3].send_signal(signal.SIGSTOP)  # rank 3 stops marking: a stall
        stall = until_stalled(nodes, limit_s=2 + 5 + SLACK_S)
        assert time.monotonic() - stopped_at < 2 + 5 + SLACK_S
        for text in stall:
            assert "rank 3 (on 127.0.0.1) has not marked layer" in text, stall
            assert "ranks [0, 1, 2] have marked theirs" in text, stall
        results = collect(processes[:3], timeout=8 + 5 + SLACK_S)
    finally:
        processes[3].send_signal(signal.SIGCONT)
        kill_all(processes)
    warned = [r["stderr"].count("has not marked layer") for r in results]
    assert all(count == 1 for count in warned), warned  # each waiting rank logged it, once
    assert nodes[0].log().count("has not marked layer") >= 1  # the coordinator's warning
    assert nodes[0].log().count("WARNING commd.coordinator") == 1  # once per stall


def test_a_stall_past_the_stall_timeout_fails_the_job(start_daemon) -> None:
    flags = ["--stall-warn-s", "2", "--stall-timeout-s", "6", "--watchdog-floor-s", "60"]
    nodes = [start_daemon(*flags), start_daemon(*flags)]
    processes = start_ranks(endless("stall-timeout", nodes))
    try:
        await_registered(processes)
        processes[3].send_signal(signal.SIGSTOP)
        results = collect(processes[:3], timeout=6 + 5 + SLACK_S)  # rank 3 cannot run
    finally:
        processes[3].send_signal(signal.SIGCONT)
        kill_all(processes)
    for result in results:
        assert "stalled in iteration" in result.get("error", ""), result
        assert "(stall_timeout_s)" in result["error"], result


def until_stalled(nodes: list[Any], limit_s: float) -> list[str]:
    """Both nodes' `commd status --json` show the job's stall; polled, with a deadline."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        stalls = [daemon_status(node.socket)["jobs"][0].get("stall") for node in nodes]
        if all(stalls):
            return [str(s) for s in stalls]
        time.sleep(0.2)  # polling a condition, bounded by the deadline
    raise AssertionError(f"no stall shown within {limit_s}s")


@pytest.mark.netns
def test_a_link_down_fails_every_rank_naming_the_node(tmp_path: Path) -> None:
    """Two daemons in network namespaces; node 1's link is set down mid-job."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    from commd.testing.daemons import LocalDaemon
    from commd.testing.netbed import NetBed, NetBedUnavailable

    try:
        bed = NetBed(nodes=2, rate=None).__enter__()
    except NetBedUnavailable as exc:
        pytest.skip(f"no network namespaces here: {exc}")
    daemons: list[LocalDaemon] = []
    try:
        for node in range(2):
            daemons.append(LocalDaemon(tmp_path, f"n{node}", "--backend", "gloo",
                                       listen_host=bed.address(node),
                                       prefix=bed.argv(node, [])))
        processes = start_ranks(endless("cut", daemons))
        try:
            await_registered(processes)
            results, took = errors_after(processes, lambda: bed.run(
                1, ["ip", "link", "set", "eth0", "down"]))
        finally:
            kill_all(processes)
        assert took < TARGET_S + SLACK_S, took
        for result in results[:2]:
            assert f"node 1 ({bed.address(1)}, ranks [2, 3]) has sent nothing" in \
                result.get("error", ""), result
        for result in results[2:]:
            assert f"the coordinator daemon at {daemons[0].address} has sent nothing" in \
                result.get("error", ""), result
    finally:
        for daemon in daemons:
            daemon.stop()
        bed.__exit__(None, None, None)


def test_the_status_table_shows_a_stall() -> None:
    from commd.cli.status import render
    from commd_protocol.status import read_status

    status = read_status({"version": "x", "protocol": 2, "backend": "gloo", "uptime_s": 1.0,
                          "jobs": [{"job": "j", "state": "running", "world_size": 4,
                                    "stall": "stalled in iteration 7: rank 3 …",
                                    "stall_s": 61.0}]})
    assert "j: STALL (61s): stalled in iteration 7: rank 3 …" in render(status).splitlines()
