"""The collective watchdog, the progress a waiting rank hears, and the client's own checks:
a missing socket fails at once, COMMD_TIMEOUT sets the timeout, progress is logged."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import pytest

from commd.daemon.server import Daemon
from commd.job.watchdog import CollectiveOverdue, CollectiveWatch
from commd_client import Client, CommdError, env
from commd_client.connection import ProgressLog
from commd_protocol import Progress

from inprocess import coordinator_of, hello
from polling import until

WAIT_S = 90.0  # a wait for the watch's report, inside the test's timeout: a hang is named


async def test_an_overdue_collective_is_named_with_its_node() -> None:
    failures: list[BaseException] = []
    watch = CollectiveWatch(2.0, 0.05, "node 1 of 3", failures.append)
    never: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    watch.watch(never, "the collective of group 4 (layers 7..9, 1200 bytes)", 0.01)
    assert watch.oldest_s() >= 0.0
    await until(lambda: failures, "the overdue collective's report", WAIT_S)
    (failure,) = failures
    assert isinstance(failure, CollectiveOverdue)
    assert "the collective of group 4 (layers 7..9, 1200 bytes) has run over 0.1s" in \
        str(failure)
    assert "node 1 of 3" in str(failure) and "predicted 10.0 ms" in str(failure)


async def test_a_collective_done_in_time_is_forgotten() -> None:
    failures: list[BaseException] = []
    watch = CollectiveWatch(1.0, 0.05, "node 0 of 2", failures.append)
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    watch.watch(done, "group 0", 0.0)
    done.set_result(None)
    with watch.span("a compressed group", 0.0):
        await asyncio.sleep(0)
    await asyncio.sleep(0.2)  # past both limits: nothing fires (a negative check)
    assert failures == [] and watch.oldest_s() == 0.0


async def test_the_watch_is_patient_while_marks_are_pending() -> None:
    failures: list[BaseException] = []
    patient = [True]
    watch = CollectiveWatch(1.0, 0.02, "node 0 of 2", failures.append, lambda: patient[0])
    never: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    watch.watch(never, "group 0", 0.0)
    await asyncio.sleep(0.2)  # ten limits: patience holds (a negative check)
    assert failures == []
    patient[0] = False  # the stalled node marked; the collective still hangs
    await until(lambda: failures, "the overdue collective's report", WAIT_S)


async def test_a_waiting_rank_hears_what_its_job_waits_for(daemon: Daemon, connect: Any,
                                                           segments: Any) -> None:
    client = connect()
    await client.ask(hello(job="half", world=2, local_world=2,
                           coordinator=coordinator_of(daemon)))
    buffer = await segments(16)
    await client.send({"type": "register", "dtype": "float32", "op": "sum", "planner": "wfbp",
                       "layers": [{"name": "w", "size": 4}], "buffer_token": buffer.token})
    progress = await client.receive(progress=True)
    assert progress["type"] == "progress", progress
    assert progress["message"] == ("commd: job 'half' forms on this node: local ranks [0] of 2 "
                                   "registered, waiting for local ranks [1]")


def test_progress_is_logged_every_ten_seconds_and_a_stall_once(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    log = ProgressLog()
    waiting = Progress(message="commd: job 'j' forms: waiting for local ranks [1]")
    stall = Progress(message="commd: job 'j' runs iteration 7", stall="stalled: rank 3 …")
    with caplog.at_level(logging.WARNING, logger="commd_client"):
        log.show(waiting, 2.0)  # early: quiet
        log.show(waiting, 10.0)  # ten seconds in: said
        clock[0] += 5
        log.show(waiting, 15.0)  # five seconds later: quiet
        clock[0] += 5
        log.show(waiting, 20.0)  # ten seconds later: said again
        log.show(stall, 1.0)
        log.show(stall, 3.0)  # the same stall: once
    lines = [record.getMessage() for record in caplog.records]
    assert lines == ["commd: job 'j' forms: waiting for local ranks [1] (waiting 10s)",
                     "commd: job 'j' forms: waiting for local ranks [1] (waiting 20s)",
                     "stalled: rank 3 …"]


def test_a_missing_socket_fails_at_once(tmp_path: Any) -> None:
    started = time.monotonic()
    with pytest.raises(CommdError, match=r"no daemon socket at .*missing\.sock"):
        Client(job="j", rank=0, world_size=1, local_rank=0, local_world_size=1,
               coordinator="127.0.0.1:1", socket=str(tmp_path / "missing.sock"))
    assert time.monotonic() - started < 1.0  # not the 10 s hello timeout


@pytest.mark.timeout(60)
def test_a_killed_daemons_socket_file_fails_a_client_at_once(start_daemon: Any) -> None:
    """A daemon killed with SIGKILL cannot remove its socket file; a rank started then (a
    torchrun restart) hears at once that nothing listens there. Its hello timeout is longer
    than the test's budget: only that check can have ended the wait."""
    daemon = start_daemon()
    daemon.process.kill()
    daemon.process.wait()
    with pytest.raises(CommdError, match=r"no daemon listens on .*\(a socket file left by a "
                       r"daemon that stopped\); is `commd run` running there\?"):
        Client(job="j", rank=0, world_size=1, local_rank=0, local_world_size=1,
               coordinator="127.0.0.1:1", socket=daemon.socket, timeout=600.0)


def test_commd_timeout_sets_the_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COMMD_TIMEOUT", raising=False)
    assert env.timeout() == 300.0 and env.timeout(12) == 12.0
    monkeypatch.setenv("COMMD_TIMEOUT", "42.5")
    assert env.timeout() == 42.5 and env.timeout(7) == 7.0  # a keyword still wins
    for bad in ("soon", "0", "-3", "inf"):
        monkeypatch.setenv("COMMD_TIMEOUT", bad)
        with pytest.raises(CommdError, match=r"COMMD_TIMEOUT|timeout must be"):
            env.timeout()


async def test_a_joining_rank_hears_which_ranks_have_not_joined(
        daemon: Daemon, connect: Any, segments: Any) -> None:
    client = connect()
    await client.ask(hello(job="far", world=3, coordinator=coordinator_of(daemon)))
    buffer = await segments(16)
    await client.send({"type": "register", "dtype": "float32", "op": "sum", "planner": "wfbp",
                       "layers": [{"name": "w", "size": 4}], "buffer_token": buffer.token})
    for _ in range(5):  # the first may come before the coordinator's first status
        progress = await client.receive(progress=True)
        if "1 of 3 ranks joined" in progress["message"]:
            break
    assert progress["message"].endswith("1 of 3 ranks joined, waiting for ranks [1, 2]"), \
        progress
