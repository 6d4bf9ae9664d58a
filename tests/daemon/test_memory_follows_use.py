"""Memory follows what is used: the daemon maps only the bytes a registration's layout needs,
refuses a memfd larger than that plus one page, and unmaps a rank's buffer when it leaves and
every buffer of a job when the job fails or ends, even while views of it remain."""

from __future__ import annotations

import asyncio
import fcntl
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from commd.daemon.server import Daemon
from commd.job.segments import SLACK, SharedSegment
from commd.testing.processes import kill_all
from commd.testing.ranks import (
    JobSpec,
    assert_exact,
    await_registered,
    collect,
    daemon_status,
    start_ranks,
)
from commd_client.host_buffer import SEALS, HostBuffer
from commd_protocol import PROTOCOL_VERSION
from commd_protocol.handover import OK, buffer_socket_path

from inprocess import coordinator_of, hello

pytestmark = pytest.mark.timeout(180)

TIB = 1 << 40
MIB = 1 << 20


# --- the size rule ---------------------------------------------------------------------------


def sealed_memfd(name: str, size: int) -> int:
    """A memfd of ``size`` bytes (sparse: nothing is allocated), sealed as a client seals it."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    return fd


def hand_fd(socket_path: str, fd: int, token: str) -> bytes:
    """One raw hand-over of ``fd`` under ``token``; the daemon's answer."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as link:
        link.settimeout(10)
        link.connect(buffer_socket_path(socket_path))
        socket.send_fds(link, [token.encode()], [fd])
        return link.recv(512)


def register(token: str, elements: int, **extra: Any) -> dict[str, Any]:
    return {"type": "register", "dtype": "float32", "op": "sum", "planner": "wfbp",
            "buffer_token": token, "layers": [{"name": "w", "size": elements}], **extra}


@pytest.mark.parametrize(("extra", "accepted"), [
    (0, True), (SLACK, True),  # the client's exact size; a page-rounded allocation
    (SLACK + 1, False), (TIB, False), (-1, False)])
async def test_the_memfd_holds_the_layout_and_at_most_a_page_more(
        daemon: Daemon, connect: Any, extra: int, accepted: bool) -> None:
    needed = 16 * 4
    client = connect()
    await client.ask(hello(coordinator=coordinator_of(daemon)))
    fd = sealed_memfd("commd-test-size", needed + extra)
    try:
        # In a thread: the daemon answers on this test's loop.
        assert await asyncio.to_thread(hand_fd, daemon.settings.socket, fd, "a" * 32) == OK
    finally:
        os.close(fd)
    reply = await client.ask(register("a" * 32, 16))
    if accepted:
        assert reply["type"] == "registered", reply
        (session,) = daemon._sessions._sessions.values()
        assert session.member.segment is not None and session.member.segment.nbytes == needed
        return
    assert reply["type"] == "error" and reply["code"] == "invalid", reply
    assert reply["message"].startswith("commd: ")
    assert f"holds {needed + extra} bytes but the layers need {needed} bytes" \
        in reply["message"], reply
    assert f"memfd of exactly {needed} bytes" in reply["message"]


def test_a_segment_closed_under_a_live_view_drops_the_memfd_and_the_view_stays_memory() -> None:
    """Closing a segment while a view of it is used (a collective stuck on a dead peer may
    hold one and write) drops the memfd's mapping at once; the view stays valid memory whose
    writes reach no rank. A plain munmap would crash the writer's process instead."""
    fd = sealed_memfd("commd-test-views", 64)
    try:
        os.pwrite(fd, np.arange(16, dtype=np.float32).tobytes(), 0)
        segment = SharedSegment(fd, 64)
        view = segment.array(np.dtype(np.float32), 16)
        assert view.tolist() == list(range(16))
        assert memfd_mappings(os.getpid(), "commd-test-views") == 1
        stop = threading.Event()

        def write() -> None:  # as a stray collective would, all through the swap
            while not stop.is_set():
                view[:] = 7.0

        writer = threading.Thread(target=write)
        writer.start()
        try:
            segment.close()
            segment.close()  # idempotent
        finally:
            stop.set()
            writer.join(30)
        assert memfd_mappings(os.getpid(), "commd-test-views") == 0
        view[:] = 9.0  # still memory, now private
        assert view.tolist() == [9.0] * 16
        assert 9.0 not in np.frombuffer(os.pread(fd, 64, 0), np.float32)  # the rank's memory
    finally:
        os.close(fd)


# --- unmapping -------------------------------------------------------------------------------


async def test_a_rank_that_leaves_and_a_failed_job_are_unmapped_at_once(
        daemon: Daemon, connect: Any, segments: Any) -> None:
    """Rank 0 of three says goodbye: its buffer goes. Rank 1 registers a different layout:
    the job fails and every buffer goes, though the failed job stays for the ranks to read.
    Rank 2's register after the failure maps nothing."""
    coordinator = coordinator_of(daemon)
    clients = [connect() for _ in range(3)]
    for index, client in enumerate(clients):
        await client.ask(hello(rank=index, world=3, local=index, local_world=3,
                               coordinator=coordinator))
    buffers = [await segments(64) for _ in range(3)]
    names = [f"commd-test-{index}" for index in range(3)]  # the fixture's names
    assert [memfd_mappings(os.getpid(), name) for name in names] == [1, 1, 1]  # the ranks'
    await clients[0].send(register(buffers[0].token, 16))
    await clients[0].ask({"type": "status"})  # after the register, on the same connection
    assert memfd_mappings(os.getpid(), names[0]) == 2  # and the daemon's
    await clients[0].send({"type": "goodbye"})
    await clients[0].ask({"type": "status"})  # after the goodbye, on the same connection
    assert memfd_mappings(os.getpid(), names[0]) == 1

    reply = await clients[1].ask(register(buffers[1].token, 8))  # a different layout
    assert reply["code"] == "mismatch", reply
    (job,) = daemon.jobs.values()
    assert job.failure is not None
    assert not any(m.segment and m.segment.mapped for m in job.members.ranks.values())
    assert [memfd_mappings(os.getpid(), name) for name in names] == [1, 1, 1]
    reply = await clients[2].ask(register(buffers[2].token, 16))
    assert (reply["code"], reply["message"]) == ("mismatch", job.failure.message), reply
    assert memfd_mappings(os.getpid(), names[2]) == 1


# --- a real daemon, many jobs ----------------------------------------------------------------


def memory(pid: int) -> dict[str, int]:
    """VmSize, RssShmem and VmRSS of ``pid`` in bytes (/proc/PID/status)."""
    values = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmSize", "RssShmem", "VmRSS"):
            values[key] = int(value.split()[0]) * 1024
    return values


def memfd_mappings(pid: int, prefix: str) -> int:
    """How many mappings of memfds whose name starts with ``prefix`` ``pid`` has."""
    text = Path(f"/proc/{pid}/maps").read_text()
    return sum(1 for line in text.splitlines() if f"/memfd:{prefix}" in line)


class Ranks:
    """Raw ipc clients of one daemon (subprocess), as ranks in another language would talk."""

    def __init__(self, daemon: Any) -> None:
        self.daemon = daemon
        self.context = zmq.Context()
        self._sockets: list[zmq.Socket] = []

    def connect(self) -> zmq.Socket:
        sock = self.context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 30_000)  # a hang becomes zmq.Again
        sock.connect(f"ipc://{self.daemon.socket}")
        self._sockets.append(sock)
        return sock

    @staticmethod
    def ask(sock: zmq.Socket, message: dict[str, Any]) -> dict[str, Any]:
        sock.send(msgpack.packb(message))
        return Ranks.receive(sock)

    @staticmethod
    def receive(sock: zmq.Socket) -> dict[str, Any]:
        while True:
            reply: dict[str, Any] = msgpack.unpackb(sock.recv())
            if reply.get("type") != "progress":
                return reply

    def hello(self, job: str, local: int, local_world: int) -> zmq.Socket:
        sock = self.connect()
        welcome = self.ask(sock, {
            "type": "hello", "protocol": PROTOCOL_VERSION, "job": job, "rank": local,
            "world_size": local_world, "local_rank": local, "local_world_size": local_world,
            "coordinator": self.daemon.address})
        assert welcome["type"] == "welcome", welcome
        return sock

    def close(self) -> None:
        for sock in self._sockets:
            sock.close(linger=0)
        self.context.term()


@contextmanager
def ranks_of(daemon: Any) -> Iterator[Ranks]:
    """Raw clients of ``daemon``, all closed on the way out."""
    ranks = Ranks(daemon)
    try:
        yield ranks
    finally:
        ranks.close()


def await_forgotten(daemon: Any, job: str) -> None:
    """Until ``daemon`` no longer lists ``job``: its ranks exited after their goodbye, which
    the daemon handles on its own time."""
    deadline = time.monotonic() + 30
    while job in [entry["job"] for entry in daemon_status(daemon.socket)["jobs"]]:
        assert time.monotonic() < deadline, f"{daemon.name} still holds job {job!r}"
        time.sleep(0.05)  # polling a condition, with a deadline


def refuse_oversized(ranks: Ranks, count: int) -> None:
    """``count`` sealed sparse 1 TiB memfds registered for one 4-element layer: each refused."""
    for index in range(count):
        sock = ranks.hello(f"huge-{index}", 0, 1)
        fd = sealed_memfd("commd-test-huge", TIB)
        try:
            token = f"{index:032x}"
            assert hand_fd(ranks.daemon.socket, fd, token) == OK
        finally:
            os.close(fd)
        reply = ranks.ask(sock, register(token, 4))
        assert reply["type"] == "error" and reply["code"] == "invalid", reply
        assert f"holds {TIB} bytes but the layers need 16 bytes" in reply["message"], reply
        sock.send(msgpack.packb({"type": "goodbye"}))


def one_job(ranks: Ranks, job: str, elements: int) -> None:
    """Two local ranks reduce ``elements`` float32s once (the daemon sums both buffers and
    writes the sum back to both: it touches every page), exactly, then say goodbye; returns
    once the daemon has forgotten the job."""
    socks = [ranks.hello(job, local, 2) for local in range(2)]
    buffers = [HostBuffer(f"commd-test-job-{local}", elements * 4) for local in range(2)]
    try:
        for local, (sock, buffer) in enumerate(zip(socks, buffers, strict=True)):
            np.frombuffer(buffer.buf, np.float32)[:] = local + 1.0
            token = buffer.hand_over(buffer_socket_path(ranks.daemon.socket), 10)
            sock.send(msgpack.packb(register(token, elements)))
        for sock in socks:
            assert Ranks.receive(sock)["type"] == "registered"
        for sock in socks:
            sock.send(msgpack.packb({"type": "ready", "layers": [0]}))
        for sock in socks:
            assert Ranks.ask(sock, {"type": "wait", "iteration": 0})["type"] == "done"
        for buffer in buffers:
            assert (np.frombuffer(buffer.buf, np.float32) == 3.0).all()
        for sock in socks:
            sock.send(msgpack.packb({"type": "goodbye"}))
        for sock in socks:  # answered after that connection's goodbye
            status = Ranks.ask(sock, {"type": "status"})["status"]
        assert job not in [entry["job"] for entry in status["jobs"]]
    finally:
        for buffer in buffers:
            buffer.close()


# A daemon maps no shared memory of its own: a buffer left mapped shows as its touched pages.
# Half of one rank's buffer is the margin for RssShmem: any buffer left mapped exceeds it.
JOB_ELEMENTS = 8 * MIB  # 32 MiB per rank, 64 MiB per job
SHMEM_MARGIN = JOB_ELEMENTS * 4 // 2
# VmSize also moves with the daemon's threads: each of its two memory workers may first run
# after the baseline, with its stack (8 MiB) and its malloc arena (64 MiB reserved): three
# jobs left mapped exceed that.
VMSIZE_MARGIN = 2 * (8 + 64) * MIB


def test_an_oversized_memfd_is_refused_and_never_mapped(start_daemon: Any) -> None:
    daemon = start_daemon()
    before = memory(daemon.process.pid)
    with ranks_of(daemon) as ranks:
        refuse_oversized(ranks, 8)
        after = memory(daemon.process.pid)
        assert after["VmSize"] - before["VmSize"] < VMSIZE_MARGIN, (before, after)
        assert memfd_mappings(daemon.process.pid, "commd-test-huge") == 0
        one_job(ranks, "after", 1024)  # and it still serves


def test_finished_jobs_give_their_memory_back(start_daemon: Any) -> None:
    daemon = start_daemon()
    pid = daemon.process.pid
    with ranks_of(daemon) as ranks:
        for index in range(2):  # warm up: imports, the memory workers
            one_job(ranks, f"warm-{index}", JOB_ELEMENTS)
        before = memory(pid)
        for index in range(20):
            one_job(ranks, f"job-{index}", JOB_ELEMENTS)
        after = memory(pid)
    left = {"mappings": memfd_mappings(pid, "commd-test-job"),
            "RssShmem": after["RssShmem"] - before["RssShmem"],
            "VmSize": after["VmSize"] - before["VmSize"]}
    assert left["RssShmem"] < SHMEM_MARGIN and left["VmSize"] < VMSIZE_MARGIN, left
    assert left["mappings"] == 0, left


def test_a_two_node_job_is_exact_after_and_gives_its_memory_back(start_daemon: Any) -> None:
    """After oversized memfds and many jobs, real ranks (the real client's memfds: never
    refused) run a 2-node job exactly, and both daemons unmap its buffers afterwards (Gloo's
    collectives held views of them)."""
    nodes = [start_daemon(), start_daemon()]
    with ranks_of(nodes[0]) as ranks:
        refuse_oversized(ranks, 2)
        for index in range(3):
            one_job(ranks, f"local-{index}", JOB_ELEMENTS)
    before = [memory(node.process.pid) for node in nodes]
    layers = [("conv.weight", 27), ("conv.bias", 3), ("fc.weight", 2 * 65536)]
    spec = JobSpec("two-node", nodes, 2, layers, op="sum", iterations=2)
    assert_exact(spec, collect(start_ranks(spec)))
    for node, earlier in zip(nodes, before, strict=True):
        await_forgotten(node, spec.job)
        after = memory(node.process.pid)
        assert memfd_mappings(node.process.pid, "commd-two-node") == 0
        assert after["RssShmem"] - earlier["RssShmem"] < 2 * 65536 * 4 // 2, (earlier, after)



def test_a_job_failed_under_a_stuck_collective_is_unmapped_and_the_daemon_lives_on(
        start_daemon: Any) -> None:
    """Node 1's daemon stops mid-job: node 0's Gloo collective is stuck holding views of its
    ranks' buffers (its group is kept until Gloo's timeout, and may still write). Node 0 unmaps
    the buffers once the job is over anyway; when node 1 resumes and the collective ends, node
    0 lives on and the next 2-node job is exact."""
    nodes = [start_daemon(), start_daemon()]
    layers = [("w", 65536), ("b", 10)]
    stuck = JobSpec("stuck", nodes, 2, layers, iterations=10**6, timeout=120,
                    overrides={rank: {"skip_results": True} for rank in range(4)})
    processes = start_ranks(stuck)
    try:
        await_registered(processes)
        nodes[1].process.send_signal(signal.SIGSTOP)
        failed = collect(processes, timeout=60)
    finally:
        nodes[1].process.send_signal(signal.SIGCONT)
        kill_all(processes)
    assert all("error" in result for result in failed), failed
    await_forgotten(nodes[0], stuck.job)
    assert memfd_mappings(nodes[0].process.pid, "commd-stuck") == 0
    await_forgotten(nodes[1], stuck.job)
    assert memfd_mappings(nodes[1].process.pid, "commd-stuck") == 0
    spec = JobSpec("after-stuck", nodes, 2, layers, op="sum", iterations=2)
    assert_exact(spec, collect(start_ranks(spec)))
    assert [node.process.poll() for node in nodes] == [None, None]
