"""The real daemon speaks sd_notify: READY=1 after binding, WATCHDOG=1, STOPPING=1."""

from __future__ import annotations

import os

from commd.cli.status import query


def test_daemon_notifies_ready_watchdog_and_stopping(start_daemon) -> None:
    daemon = start_daemon(env={"WATCHDOG_USEC": "200000"})  # ping every 0.1 s
    ready = next(n for n in daemon.notifications if "READY=1" in n.split("\n"))
    assert "STATUS=" in ready
    assert os.path.exists(daemon.socket)  # READY=1 came after the socket was bound
    assert query(daemon.socket)["backend"] == "gloo"
    notify = daemon._notify
    notify.settimeout(10)
    pings = 0
    while pings < 3:  # three watchdog pings at ~0.1 s each; a hang fails by timeout
        if "WATCHDOG=1" in notify.recv(4096).decode().split("\n"):
            pings += 1
    daemon.process.terminate()
    seen = []
    while True:
        try:
            datagram = notify.recv(4096).decode()
        except TimeoutError:
            break
        seen.append(datagram)
        if "STOPPING=1" in datagram.split("\n"):
            break
    assert any("STOPPING=1" in d.split("\n") for d in seen), seen
    assert daemon.process.wait(15) == 0
    assert not os.path.exists(daemon.socket)


def test_watchdog_for_another_pid_is_ignored(start_daemon) -> None:
    daemon = start_daemon(env={"WATCHDOG_USEC": "100000", "WATCHDOG_PID": "1"})
    notify = daemon._notify
    notify.settimeout(0.5)  # five intervals: a ping would have come by now
    pings = []
    try:
        while True:
            pings.append(notify.recv(4096).decode())
    except TimeoutError:
        pass
    assert not any("WATCHDOG=1" in p.split("\n") for p in pings), pings
