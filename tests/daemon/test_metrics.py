"""Prometheus metrics (`commd run --metrics-listen HOST:PORT`, docs/metrics.md): scraped over
real HTTP from real daemons while two jobs run, the per-job series gone once the jobs end,
refusals and errors counted, a busy port refused in one line, and nothing served when off."""

from __future__ import annotations

import asyncio
import os
import re
import selectors
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import zmq
import zmq.asyncio
from metrics_scrape import Samples, metrics_address, parse, scrape, value
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from commd.daemon.metrics import Counts, Metrics
from commd.daemon.server import Daemon
from commd.daemon.settings import Settings
from commd.job.measurements import CommSample, IterationRecord
from commd.job.schedule import make_plan
from commd.testing.ports import busy_port
from commd.testing.processes import kill_all
from commd.testing.ranks import JobSpec, await_registered, collect, start_ranks
from commd_protocol import __version__
from commd_protocol.handover import buffer_socket_path
from commd_protocol.peer import ALLGATHER, ALLREDUCE
from commd_protocol.status import DaemonStatus, JobState, JobStatus, LatencySummary

from inprocess import peer_dealer
from polling import until, until_sync

LAYERS = [("w0", 4096), ("b0", 16), ("w1", 2048), ("b1", 8)]
def jobs_in(samples: Samples) -> set[str]:
    return {v for (_, labels) in samples for k, v in labels if k == "job"}


def listening_ports(pid: int) -> set[int]:
    """TCP ports process ``pid`` listens on (its socket inodes in /proc/net/tcp{,6})."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


# --- real daemons, two jobs ----------------------------------------------------------------------


@pytest.mark.timeout(240)
def test_two_jobs_on_two_daemons_scraped_while_they_run(start_daemon) -> None:
    nodes = [start_daemon("--metrics-listen", "127.0.0.1:0") for _ in range(2)]
    addresses = [metrics_address(node) for node in nodes]
    assert all(a.startswith("127.0.0.1:") and not a.endswith(":0") for a in addresses)
    # Each layer's ready waits 10 ms: the jobs run for seconds, then end by themselves.
    slow = {r: {"skip_results": True, "backward_sleep_s": [0.01] * len(LAYERS)}
            for r in range(4)}
    dense = JobSpec("m-dense", nodes, 2, LAYERS, iterations=150, timeout=60, overrides=slow)
    topk = JobSpec("m-topk", nodes, 2, LAYERS, iterations=150, timeout=60, overrides=slow,
                   compression="topk:0.1:allgather")
    running = [start_ranks(dense), start_ranks(topk)]
    try:
        for processes in running:
            await_registered(processes)

        def both_past_a_report() -> list[Samples] | None:
            scrapes = [scrape(address)[0] for address in addresses]
            done = [value(s, "commd_job_iterations_total", job=job) or 0
                    for s in scrapes for job in ("m-dense", "m-topk")]
            return scrapes if min(done) >= 12 else None

        scrapes = until_sync(both_past_a_report, "12 iterations of both jobs on both nodes",
                             timeout_s=60, poll_s=0.05)
        kinds = scrape(addresses[0])[1]
        for index, samples in enumerate(scrapes):
            assert value(samples, "commd_jobs", state="running") == 2
            assert value(samples, "commd_jobs", state="failed") == 0
            assert value(samples, "commd_clients_connected") == 4  # 2 jobs x 2 local ranks
            assert value(samples, "commd_peer_links_open") == 1  # both jobs' coordinator
            assert value(samples, "commd_nodes_coordinated") == (4 if index == 0 else 0)
            assert value(samples, "commd_jobs_coordinated") == (2 if index == 0 else 0)
            assert value(samples, "commd_peer_handshakes_refused_total") == 0
            assert value(samples, "commd_buffer_handovers_refused_total") == 0
            assert value(samples, "commd_daemon_info", version=__version__, protocol="2",
                         backend="gloo") == 1
            for job, exchange in (("m-dense", "allreduce"), ("m-topk", "allgather")):
                assert value(samples, "commd_job_iterations_total", job=job) >= 12
                assert value(samples, "commd_job_plan_groups", job=job) >= 1
                assert value(samples, "commd_job_plan_version", job=job) is not None
                assert value(samples, "commd_job_replans_total", job=job) >= 0
                assert value(samples, "commd_job_stall_seconds", job=job) == 0
                assert value(samples, "commd_job_exposed_comm_measured_seconds", job=job) >= 0
                assert value(samples, "commd_job_exposed_comm_predicted_seconds",
                             job=job) is not None
                for unit in ("bytes", "seconds"):
                    name = f"commd_job_wire_{unit}"
                    count = value(samples, f"{name}_count", job=job, exchange=exchange)
                    assert count is not None and count >= 12, (job, unit, count)
                    assert value(samples, f"{name}_bucket", job=job, exchange=exchange,
                                 le="+Inf") == count
                    assert value(samples, f"{name}_sum", job=job, exchange=exchange) > 0
            # Status has ready-to-launch figures once a client's ready carried its send time.
            launch = [value(samples, "commd_job_ready_to_launch_seconds", job="m-dense",
                            quantile=q) for q in ("0.5", "0.99", "1")]
            assert launch == [None] * 3 or 0 <= launch[0] <= launch[1] <= launch[2], launch
        assert {"commd_job_iterations counter", "commd_job_replans counter",
                "commd_job_wire_bytes histogram", "commd_job_wire_seconds histogram",
                "commd_jobs gauge", "commd_errors_sent counter", "commd_frames_refused counter",
                "commd_job_plan_groups gauge", "commd_job_stall_seconds gauge"} <= kinds
        for processes in running:
            for result in collect(processes):
                assert "error" not in result and result["returncode"] == 0, result
    finally:
        for processes in running:
            kill_all(processes)
    # Bounded cardinality: jobs gone from the job table are gone from every series.
    for address in addresses:

        def without_jobs(address: str = address) -> Samples | None:
            samples = scrape(address)[0]
            return None if jobs_in(samples) else samples

        samples = until_sync(without_jobs, "the ended jobs' series to go", timeout_s=20,
                             poll_s=0.05)
        assert value(samples, "commd_jobs", state="running") == 0
        assert value(samples, "commd_clients_connected") == 0
        assert value(samples, "commd_errors_sent_total", code="rank_lost") is None


def test_metrics_off_listens_on_nothing_but_the_peer_port(start_daemon) -> None:
    off = start_daemon()
    assert not any("metrics on" in note for note in off.notifications)
    assert listening_ports(off.process.pid) == {off.port}
    on = start_daemon("--metrics-listen", "127.0.0.1:0")
    port = int(metrics_address(on).rsplit(":", 1)[1])
    assert listening_ports(on.process.pid) == {on.port, port}
    assert "serving Prometheus metrics on http://127.0.0.1:" in on.log()


def test_a_busy_metrics_port_fails_the_start_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "d.sock"
    with busy_port() as port:
        done = subprocess.run(
            [sys.executable, "-m", "commd.cli", "run", "--backend", "gloo", "--socket", str(path),
             "--listen", "127.0.0.1:0", "--metrics-listen", f"127.0.0.1:{port}"],
            capture_output=True, text=True, timeout=30)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.splitlines()[-1] == (
        f"commd: cannot serve metrics on 127.0.0.1:{port}: Address already in use; pass "
        "another --metrics-listen")
    assert not path.exists()


# --- an in-process daemon ------------------------------------------------------------------------


@pytest.fixture
def daemon_settings() -> dict[str, Any]:
    return {"metrics_listen": "127.0.0.1:0"}


async def test_refusals_and_errors_sent_are_counted(daemon: Daemon, connect: Any) -> None:
    assert daemon._metrics is not None
    address = daemon._metrics.address
    client = connect()
    reply = await client.ask(b"\xc1")  # not MessagePack
    assert reply["type"] == "error" and reply["code"] == "malformed"
    context = zmq.asyncio.Context()
    peer = peer_dealer(context, daemon)  # a key holder: its frame reaches the peer loop
    await peer.send_multipart([b"one", b"two"])  # a peer message of several frames

    def hand_over_nothing() -> bytes:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as handover:
            handover.settimeout(10)
            handover.connect(buffer_socket_path(daemon.settings.socket))
            handover.send(b"0" * 32)  # a token without its descriptor
            return handover.recv(512)

    try:
        assert b"exactly one descriptor" in await asyncio.to_thread(hand_over_nothing)
        deadline = time.monotonic() + 20
        while True:
            samples, _ = await asyncio.to_thread(scrape, address)
            refused = value(samples, "commd_frames_refused_total", loop="peer",
                            kind="peer message of several frames")
            if refused or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
    finally:
        peer.close(linger=0)
        context.term()
    assert refused == 1
    assert value(samples, "commd_errors_sent_total", code="malformed") == 1
    assert value(samples, "commd_buffer_handovers_refused_total") == 1
    assert value(samples, "commd_clients_connected") == 0  # no hello: no session


async def test_the_server_runs_on_the_loop_without_a_thread_and_stops_with_the_daemon(
        tmp_path: Path) -> None:
    def names() -> list[str]:  # less the loop's default executor (to_thread, here)
        return sorted(t.name for t in threading.enumerate() if not t.name.startswith("asyncio_"))

    before = names()
    for listen in ("", "127.0.0.1:0"):
        daemon = Daemon(Settings(socket=str(tmp_path / "d.sock"), listen="127.0.0.1:0",
                                 backend="gloo", metrics_listen=listen))
        try:
            await daemon.setup()
            assert names() == before
            assert (daemon._metrics is None) == (listen == "")
            address = daemon._metrics.address if daemon._metrics else ""
            if address:
                samples, _ = await asyncio.to_thread(scrape, address)
                assert value(samples, "commd_uptime_seconds") is not None
                assert names() == before  # a scrape starts no thread either
        finally:
            await daemon.cleanup()
        assert names() == before
        if address:
            with pytest.raises(urllib.error.URLError):
                await asyncio.to_thread(scrape, address)


# --- scrapers that are not polite (commd/daemon/metrics_http.py) --------------------------------

DAEMON_FAMILIES = {"commd_daemon_info", "commd_uptime_seconds", "commd_jobs",
                   "commd_jobs_coordinated", "commd_nodes_coordinated",
                   "commd_peer_handshakes_refused", "commd_peer_handshakes_refused_by_reason",
                   "commd_clients_connected",
                   "commd_peer_links_open", "commd_errors_sent", "commd_frames_refused",
                   "commd_buffer_handovers_refused", "commd_job_iterations",
                   "commd_job_plan_groups", "commd_job_plan_version", "commd_job_replans",
                   "commd_job_exposed_comm_predicted_seconds",
                   "commd_job_exposed_comm_measured_seconds", "commd_job_stall_seconds",
                   "commd_job_ready_to_launch_seconds", "commd_job_wire_bytes",
                   "commd_job_wire_seconds", "commd_membership_changes",
                   "commd_job_membership_epoch", "commd_job_membership_ranks"}
GET = b"GET /metrics HTTP/1.1\r\nHost: x\r\nAccept: */*\r\n\r\n"


def threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError(f"no Threads line for {pid}")


def closings(socks: list[socket.socket], pid: int,
             timeout: float = 30.0) -> tuple[list[bytes], int]:
    """Wait until the server closed every socket of ``socks`` (a reset counts as a close):
    what each got, and the most threads process ``pid`` had meanwhile. A server that keeps one
    open past ``timeout`` fails the test."""
    got = {sock: b"" for sock in socks}
    peak = threads(pid)
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as selector:
        for sock in socks:
            sock.setblocking(False)
            selector.register(sock, selectors.EVENT_READ)
        while selector.get_map():
            left = deadline - time.monotonic()
            assert left > 0, f"{len(selector.get_map())} of {len(socks)} connections still open"
            for key, _ in selector.select(min(left, 0.5)):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                try:
                    chunk = sock.recv(65536)
                except ConnectionResetError:
                    chunk = b""
                got[sock] += chunk
                if not chunk:
                    selector.unregister(sock)
            peak = max(peak, threads(pid))
    return [got[sock] for sock in socks], peak


def host_port(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host, int(port)


def test_slow_connections_hold_no_thread_and_are_closed_by_the_deadline(start_daemon) -> None:
    node = start_daemon("--metrics-listen", "127.0.0.1:0")
    address = metrics_address(node)
    pid = node.process.pid
    before = threads(pid)
    slow = []
    try:
        for _ in range(40):  # one header byte each, then silence
            sock = socket.create_connection(host_port(address), timeout=10)
            slow.append(sock)
            sock.sendall(b"G")
        # 16 take the slots, the other 24 are closed at once (a 503, unless their byte came
        # first: then a reset); the 16 go at the 5 s deadline with no reply. A server with a
        # thread per connection grows 40 threads and closes none.
        replies, peak = closings(slow, pid)
        assert peak <= before
        assert all(r == b"" or r.startswith(b"HTTP/1.1 503 ") for r in replies), replies
        assert sum(r == b"" for r in replies) >= 16
    finally:
        for sock in slow:
            sock.close()
    kinds = scrape(address)[1]  # the slots are free again
    assert {kind.split()[0] for kind in kinds} == DAEMON_FAMILIES
    assert threads(pid) <= before


async def ask(address: str, request: bytes, *, close_after: bool = False) -> bytes:
    """Send ``request`` on a fresh connection; what comes back until the server closes."""
    host, port = host_port(address)
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(request)
        if close_after:
            writer.write_eof()
        return await asyncio.wait_for(reader.read(), 30)
    except ConnectionResetError:
        return b""
    finally:
        writer.close()


WAIT_S = 30.0  # a wait on the in-process server's counts


async def test_the_17th_connection_is_refused_at_once_and_scrapes_work_once_slots_free(
        daemon: Daemon) -> None:
    assert daemon._metrics is not None
    server, address = daemon._metrics.server, daemon._metrics.address
    server.head_deadline_s = 600.0  # the 16 idle ones stay while the 17th is tried
    host, port = host_port(address)
    idle = [await asyncio.open_connection(host, port) for _ in range(16)]
    try:
        for _, writer in idle:
            writer.write(b"G")
        await until(lambda: server.connections == 16, "16 connections accepted", WAIT_S)
        reply = await ask(address, b"")  # says nothing: the 503 is read before the close
        assert reply.startswith(b"HTTP/1.1 503 Service Unavailable\r\n"), reply
        assert reply.endswith(b"commd: too many metrics connections\n")
        reply = await ask(address, GET)  # a 503 too, or a reset if the request came first
        assert reply == b"" or reply.startswith(b"HTTP/1.1 503 "), reply
        assert (server.connections, server.refused, server.expired) == (16, 2, 0)
    finally:
        for _, writer in idle:
            writer.close()
    await until(lambda: server.connections == 0, "the idle connections to go", WAIT_S)
    reply = await ask(address, GET)
    assert reply.startswith(b"HTTP/1.1 200 OK\r\n"), reply[:200]
    families = {f.name for f in text_string_to_metric_families(reply.split(b"\r\n\r\n", 1)[1]
                                                               .decode())}
    assert families == DAEMON_FAMILIES


async def test_a_silent_connection_is_dropped_at_the_deadline(daemon: Daemon) -> None:
    assert daemon._metrics is not None
    server = daemon._metrics.server
    server.head_deadline_s = 0.2
    assert await ask(daemon._metrics.address, b"GET /metr") == b""  # no reply, closed
    assert server.expired == 1
    await until(lambda: server.connections == 0, "the connection to go", WAIT_S)


async def test_hostile_requests_get_a_typed_answer_and_a_close(daemon: Daemon) -> None:
    assert daemon._metrics is not None
    address, server = daemon._metrics.address, daemon._metrics.server

    def status_line(reply: bytes) -> bytes:
        return reply.split(b"\r\n", 1)[0]

    cases = [
        (b"GET /other HTTP/1.1\r\n\r\n", b"HTTP/1.1 404 Not Found", b"commd: only /metrics"),
        (b"GET /metricsX HTTP/1.1\r\n\r\n", b"HTTP/1.1 404 Not Found", b"commd: only /metrics"),
        (b"POST /metrics HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc",
         b"HTTP/1.1 405 Method Not Allowed", b"commd: only GET and HEAD"),
        (b"GET /metrics\r\n\r\n", b"HTTP/1.1 400 Bad Request", b"commd: not an HTTP request"),
        (b"\x00\xff\x16\x03\x01 garbage\r\n\r\n", b"HTTP/1.1 400 Bad Request",
         b"commd: not an HTTP request"),
        (b"GET http://x/metrics HTTP/1.1\r\n\r\n", b"HTTP/1.1 400 Bad Request",
         b"commd: not an HTTP request"),
        (b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 9000 + b"\r\n\r\n",
         b"HTTP/1.1 431 Request Header Fields Too Large", b"commd: request head over 8192"),
        (b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 100_000,  # never ends
         b"HTTP/1.1 431 Request Header Fields Too Large", b"commd: request head over 8192"),
    ]
    for request, expected, says in cases:
        reply = await ask(address, request)
        assert status_line(reply) == expected, (request[:40], reply[:200])
        assert says in reply and b"Connection: close" in reply
    # A head cut short by the client's close gets no answer.
    assert await ask(address, b"GET /metrics HTTP/1.1\r\n", close_after=True) == b""
    # HEAD: the headers alone; a query string is ignored.
    head = await ask(address, b"HEAD /metrics HTTP/1.0\r\n\r\n")
    assert status_line(head) == b"HTTP/1.1 200 OK" and head.endswith(b"\r\n\r\n")
    length = int(re.search(rb"Content-Length: (\d+)", head).group(1))  # type: ignore[union-attr]
    full = await ask(address, b"GET /metrics?x=1 HTTP/1.1\r\n\r\n")
    assert status_line(full) == b"HTTP/1.1 200 OK"
    assert len(full.split(b"\r\n\r\n", 1)[1]) == length > 0
    # A request sent a byte at a time is still one request.
    host, port = host_port(address)
    reader, writer = await asyncio.open_connection(host, port)
    try:
        for byte in GET:
            writer.write(bytes([byte]))
            await writer.drain()
        assert status_line(await asyncio.wait_for(reader.read(), 30)) == b"HTTP/1.1 200 OK"
    finally:
        writer.close()
    await until(lambda: server.connections == 0, "every connection to go", WAIT_S)
    assert server.refused == server.expired == 0


async def test_scrapes_in_a_burst_render_once_per_interval(daemon: Daemon) -> None:
    assert daemon._metrics is not None
    server = daemon._metrics.server
    server.cache_s = 600.0  # the burst below falls in one interval, however slow the machine
    before = server.renders
    bodies = {(await ask(daemon._metrics.address, GET)).split(b"\r\n\r\n", 1)[1]
              for _ in range(50)}
    assert server.renders - before <= 1 and len(bodies) == 1


async def test_a_slow_render_stretches_the_interval_between_renders() -> None:
    from commd.daemon.metrics_http import RENDER_SHARE, MetricsServer

    def slow() -> bytes:  # a daemon with very many jobs: rendering takes long on the loop
        until = time.monotonic() + 0.2
        while time.monotonic() < until:
            pass
        return b"text"

    server = MetricsServer(slow, "text/plain", cache_s=0.0)  # no fixed interval at all
    port = await server.start("127.0.0.1", 0)
    try:
        for _ in range(3):  # within 0.2 s / RENDER_SHARE (10 s) of the first render
            assert (await ask(f"127.0.0.1:{port}", GET)).endswith(b"\r\n\r\ntext")
        assert server.renders == 1 and RENDER_SHARE <= 0.02
    finally:
        await server.close()


async def test_a_reply_nobody_reads_is_dropped_at_the_deadline() -> None:
    from commd.daemon.metrics_http import MetricsServer

    server = MetricsServer(lambda: b"x" * (64 << 20), "text/plain", head_deadline_s=0.5)
    port = await server.start("127.0.0.1", 0)
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(GET)  # then never read the 64 MiB: more than the sockets buffer
            await until(lambda: server.expired == 1, "the reply's deadline", WAIT_S)
            await until(lambda: server.connections == 0, "the connection to go", WAIT_S)
        finally:
            writer.close()
    finally:
        await server.close()


# --- the collector alone -------------------------------------------------------------------------


def job_status(job: str, **fields: Any) -> JobStatus:
    return JobStatus(job=job, state=JobState.RUNNING, world_size=2, **fields)


async def test_exchanges_replans_and_forgotten_jobs() -> None:
    plan = make_plan(3, [[0], [1], [2]], [1024, 1024, 1024], ["dense", "allreduce", "allgather"],
                     0.1)
    table: dict[str, Any] = {"a": SimpleNamespace(pipeline=SimpleNamespace(plan=plan))}
    latency = LatencySummary(p50_us=120.0, p99_us=450.0, max_us=900.0, samples=10.0)
    status = DaemonStatus(version="v", protocol=2, backend="gloo", uptime_s=1.0,
                          jobs=[job_status("a", plan_version=3, groups=plan.groups,
                                           ready_to_launch=latency)])
    metrics = Metrics(lambda: status, Counts, table)

    def record(version: int, iteration: int) -> IterationRecord:
        import numpy as np

        key = (iteration, 0)
        return IterationRecord(
            iteration=iteration, ready_offsets_s=np.zeros(3), exposed_comm_s=0.0,
            iteration_s=0.01, plan=version, ratio=0.1,
            comm=[CommSample(key, 4096, 0.001), CommSample((iteration, 1), 400, 0.002, ALLREDUCE),
                  CommSample((iteration, 2), 800, 0.003, ALLGATHER)])

    metrics.observe_iteration("a", record(3, 0))
    metrics.observe_iteration("a", record(3, 1))
    metrics.observe_iteration("a", record(4, 2))  # not the running plan: guessed from the kind
    metrics.error_sent("invalid")
    await asyncio.sleep(0)  # observed right after the current callback
    samples = parse(generate_latest(metrics.registry).decode())
    count = "commd_job_wire_bytes_count"
    assert value(samples, count, job="a", exchange="allreduce") == 2
    assert value(samples, count, job="a", exchange="allreduce_topk") == 4
    assert value(samples, count, job="a", exchange="allgather") == 3
    assert value(samples, "commd_job_wire_bytes_bucket", job="a", exchange="allreduce",
                 le="4096.0") == 2
    assert value(samples, "commd_job_wire_bytes_bucket", job="a", exchange="allreduce",
                 le="1024.0") == 0
    assert value(samples, "commd_job_wire_seconds_sum", job="a", exchange="allgather") == \
        pytest.approx(0.009)
    assert value(samples, "commd_job_replans_total", job="a") == 1
    assert value(samples, "commd_job_stall_seconds", job="a") == 0
    assert value(samples, "commd_errors_sent_total", code="invalid") == 1
    assert value(samples, "commd_jobs", state="running") == 1
    assert value(samples, "commd_job_exposed_comm_predicted_seconds", job="a") is None
    assert [value(samples, "commd_job_ready_to_launch_seconds", job="a", quantile=q)
            for q in ("0.5", "0.99", "1")] == pytest.approx([120e-6, 450e-6, 900e-6])
    # A stall figure, once JobStatus has one, is read as it is.
    fields = {f: getattr(status.jobs[0], f) for f in JobStatus.__struct_fields__}
    stalled = SimpleNamespace(**{**fields, "stall_s": 2.5})
    status = DaemonStatus(version="v", protocol=2, backend="gloo", uptime_s=1.0,
                          jobs=[stalled])  # type: ignore[list-item]
    samples = parse(generate_latest(metrics.registry).decode())
    assert value(samples, "commd_job_stall_seconds", job="a") == 2.5
    # The job leaves the table: every series labelled with it goes.
    status = DaemonStatus(version="v", protocol=2, backend="gloo", uptime_s=1.0, jobs=[])
    samples = parse(generate_latest(metrics.registry).decode())
    assert jobs_in(samples) == set()
    assert value(samples, "commd_errors_sent_total", code="invalid") == 1
    metrics.observe_iteration("a", record(4, 3))  # the id used again: a fresh series
    await asyncio.sleep(0)
    status = DaemonStatus(version="v", protocol=2, backend="gloo", uptime_s=1.0,
                          jobs=[job_status("a")])
    samples = parse(generate_latest(metrics.registry).decode())
    assert value(samples, count, job="a", exchange="allgather") == 1
    assert value(samples, "commd_job_replans_total", job="a") == 0
