"""`commd trace`: a timeline of a running job, from the daemon's recorder to the Chrome trace.

In-process daemon (raw frames, iterations driven by hand): what is recorded, when a trace
starts and ends, and every request the daemon refuses. A fake daemon: the file and the plot
the command makes of a reply. Real daemons: 2 daemons × 2 ranks through the command line.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import subprocess
import sys
import threading
from collections import defaultdict
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from commd.daemon.server import Daemon
from commd.job.trace import MAX_EVENTS, MAX_ITERATIONS
from commd.testing.processes import kill_all
from commd.testing.ranks import JobSpec, await_registered, collect, start_ranks
from commd_client.host_buffer import HostBuffer
from commd_protocol import TraceEvent, TraceReply, TraceRequest, encode
from commd_protocol.codec import client_codec, daemon_codec

from inprocess import RawClient, hello, register_job, still_serving

REPO = Path(__file__).resolve().parents[2]
LAYERS = [{"name": "conv.weight", "size": 64}, {"name": "conv.bias", "size": 8},
          {"name": "fc.weight", "size": 32}]
EPS_US = 0.01  # the file's times are rounded to 0.001 µs
SPANS = ("local sum", "wire", "write back")


# --- checking a Chrome trace ----------------------------------------------------------------------


def check_chrome_trace(data: Any) -> dict[str, list[dict[str, Any]]]:
    """Assert ``data`` is a valid Chrome trace-event object; its events by process name."""
    assert isinstance(data, dict) and isinstance(data["traceEvents"], list)
    names: dict[int, str] = {}
    threads: dict[tuple[int, int], str] = {}
    for event in data["traceEvents"]:
        assert event["ph"] in ("X", "i", "M"), event
        assert isinstance(event["pid"], int) and isinstance(event["tid"], int), event
        assert isinstance(event["name"], str) and isinstance(event.get("args", {}), dict)
        if event["ph"] == "M":
            if event["name"] == "process_name":
                names[event["pid"]] = event["args"]["name"]
            elif event["name"] == "thread_name":
                threads[event["pid"], event["tid"]] = event["args"]["name"]
            continue
        assert math.isfinite(event["ts"]) and event["ts"] >= 0, event
        if event["ph"] == "X":
            assert math.isfinite(event["dur"]) and event["dur"] >= 0, event
        else:
            assert event["s"] in ("t", "p", "g"), event
    by_process: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for event in data["traceEvents"]:
        if event["ph"] != "M":
            assert (event["pid"], event["tid"]) in threads, f"a thread without a name: {event}"
            by_process[names[event["pid"]]].append(event)
    assert len(set(names.values())) == len(names), names
    return by_process


def check_node(events: list[dict[str, Any]], iterations: int, layers: int) -> None:
    """Every recorded iteration: a ready mark per layer, every group's local sum, wire and
    write-back, each after the one before and all inside the iteration."""
    whole = sorted((e for e in events if e["cat"] == "iteration"), key=lambda e: e["ts"])
    numbers = [e["args"]["iteration"] for e in whole]
    assert numbers == list(range(numbers[0], numbers[0] + iterations)), numbers
    assert any(e["cat"] == "plan" and e["args"]["iteration"] == numbers[0] for e in events)
    for span in whole:
        number, start, end = span["args"]["iteration"], span["ts"], span["ts"] + span["dur"]
        mine = [e for e in events if e["args"]["iteration"] == number]
        assert all(start - EPS_US <= e["ts"] and e["ts"] + e.get("dur", 0) <= end + EPS_US
                   for e in mine), f"an event outside iteration {number}"
        ready = {e["args"]["layer"]: e for e in mine if e["cat"] == "ready"}
        assert sorted(ready) == list(range(layers)), ready
        for group in range(span["args"]["groups"]):
            rows = {row: [e for e in mine if e["cat"] == row and e["args"]["group"] == group]
                    for row in SPANS}
            assert all(len(found) == 1 for found in rows.values()), (number, group, rows)
            summed, wire, written = (rows[row][0] for row in SPANS)
            assert summed["ph"] == wire["ph"] == written["ph"] == "X"
            assert wire["ts"] >= summed["ts"] - EPS_US, (summed, wire)
            assert written["ts"] >= wire["ts"] + wire["dur"] - EPS_US, (wire, written)
            marks = [e for e in ready.values() if e["args"]["group"] == group]
            assert marks and all(m["ts"] <= summed["ts"] + EPS_US for m in marks), \
                "a group was summed before its layers were ready"


# --- in-process daemon: what is recorded and what is refused --------------------------------------


@pytest.fixture
def daemon_settings() -> dict[str, Any]:
    return {"timeout_s": 10}


@contextlib.asynccontextmanager
async def one_rank_job(daemon: Daemon, rank: RawClient, job: str) -> AsyncIterator[None]:
    """A running one-rank, one-node job; the test drives its iterations (``iterate``)."""
    buffer = HostBuffer(f"commd-test-{job}", 4 * sum(layer["size"] for layer in LAYERS))
    try:
        reply = await register_job(daemon, rank, buffer, job, LAYERS)
        assert reply["type"] == "registered", reply
        yield
        await rank.send({"type": "goodbye"})
        await still_serving(rank)
    finally:
        buffer.close()


async def iterate(rank: RawClient, iteration: int) -> None:
    await rank.send({"type": "ready", "layers": [2, 1, 0]})
    reply = await rank.ask({"type": "wait", "iteration": iteration})
    assert reply["type"] == "done" and reply["iteration"] == iteration, reply


async def arm(tracer: RawClient, job: str, iterations: int, timeout_s: float = 10.0) -> None:
    """Send a trace request; the status round trip after it on the same connection shows the
    daemon has taken it (a connection's messages are handled in order)."""
    await tracer.send({"type": "trace", "job": job, "iterations": iterations,
                       "timeout_s": timeout_s})
    await still_serving(tracer)


def node_events(reply: dict[str, Any]) -> list[dict[str, Any]]:
    """A raw trace_reply as the command turns it into Chrome events (one node)."""
    from commd.cli.trace import chrome_trace

    typed = msgspec.convert(reply, TraceReply)
    return check_chrome_trace(chrome_trace([typed], ["d.sock"]))["node 0"]


async def test_a_trace_records_whole_iterations_then_lets_go(daemon: Daemon, connect: Any) -> None:
    rank, tracer = connect(), connect()  # the tracer never says hello: a trace is like status
    async with one_rank_job(daemon, rank, "t1"):
        await arm(tracer, "t1", 2)
        for iteration in range(3):
            await iterate(rank, iteration)
        reply = await tracer.receive()
        assert reply["type"] == "trace_reply", reply
        assert reply["iterations"] == [0, 1] and reply["truncated"] == ""
        assert (reply["node_index"], reply["nodes"]) == (0, 1)
        check_node(node_events(reply), iterations=2, layers=len(LAYERS))
        names = {e["name"] for e in reply["events"] if e["row"] == "ready"}
        assert names == {layer["name"] for layer in LAYERS}
        assert daemon.jobs["t1"].pipeline.trace is None  # detached: no cost from now on
        await arm(tracer, "t1", 1)  # a second trace of the job, once the first is done
        await iterate(rank, 3)
        reply = await tracer.receive()
        assert reply["type"] == "trace_reply" and reply["iterations"] == [3], reply


async def test_an_iteration_under_way_is_skipped(daemon: Daemon, connect: Any) -> None:
    rank, tracer = connect(), connect()
    async with one_rank_job(daemon, rank, "t2"):
        await rank.send({"type": "ready", "layers": [2]})
        await still_serving(rank)
        await arm(tracer, "t2", 1)
        await rank.send({"type": "ready", "layers": [1, 0]})
        await rank.ask({"type": "wait", "iteration": 0})
        await iterate(rank, 1)
        reply = await tracer.receive()
        assert reply["type"] == "trace_reply" and reply["iterations"] == [1], reply


async def test_one_trace_of_a_job_at_a_time(daemon: Daemon, connect: Any) -> None:
    rank, first, second = connect(), connect(), connect()
    async with one_rank_job(daemon, rank, "t3"):
        await arm(first, "t3", 1)
        reply = await second.ask({"type": "trace", "job": "t3", "iterations": 1})
        assert reply["type"] == "error" and reply["code"] == "limit", reply
        assert reply["ref"] == "trace" and "traced already" in reply["message"]
        await iterate(rank, 0)
        assert (await first.receive())["type"] == "trace_reply"
        await arm(second, "t3", 1)  # the first one is done: the next may start
        await iterate(rank, 1)
        assert (await second.receive())["type"] == "trace_reply"


async def test_a_trace_answers_at_its_timeout(daemon: Daemon, connect: Any) -> None:
    rank, tracer = connect(), connect()
    async with one_rank_job(daemon, rank, "t4"):
        reply = await tracer.ask({"type": "trace", "job": "t4", "iterations": 2,
                                  "timeout_s": 0.3})
        assert reply["type"] == "error" and reply["code"] == "timeout", reply
        assert "no iteration of job 't4' finished within the trace's timeout of 0.3 s" in \
            reply["message"]
        assert daemon.jobs["t4"].pipeline.trace is None
        await arm(tracer, "t4", 3, timeout_s=1.5)  # an iteration takes milliseconds
        await iterate(rank, 0)
        reply = await tracer.receive()  # what it has: one whole iteration of three
        assert reply["type"] == "trace_reply" and reply["iterations"] == [0], reply
        assert "1 of 3 iterations: the trace's timeout of 1.5 s passed" in reply["truncated"]
        check_node(node_events(reply), iterations=1, layers=len(LAYERS))


async def test_a_forming_job_cannot_be_traced(connect: Any) -> None:
    rank, tracer = connect(), connect()
    assert (await rank.ask(hello(job="forming", world=2, local_world=2)))["type"] == "welcome"
    reply = await tracer.ask({"type": "trace", "job": "forming", "iterations": 1})
    assert reply["type"] == "error" and reply["code"] == "out_of_order", reply
    assert "trace before the job is formed" in reply["message"]


@pytest.mark.parametrize(("fields", "code", "words"), [
    ({"job": "nobody"}, "invalid", "no job 'nobody' on this daemon"),
    ({"iterations": 0}, "invalid", "iterations must be 1 to 1000, got 0"),
    ({"iterations": -3}, "invalid", "got -3"),
    ({"iterations": 10**6}, "limit", f"1 to {MAX_ITERATIONS}, got 1000000"),
    ({"iterations": 2**64 - 1}, "limit", f"got {2**64 - 1}"),
    ({"iterations": 1e30}, "malformed", "iterations"),
    ({"iterations": "5"}, "malformed", "iterations"),
    ({"iterations": 1.5}, "malformed", "iterations"),
    ({"job": 5}, "malformed", "job"),
    ({"job": "bad id!"}, "invalid", "invalid job id"),
    ({"job": "j" * 100_000}, "invalid", "invalid job id"),
    ({"timeout_s": 0}, "invalid", "timeout_s must be over 0"),
    ({"timeout_s": -1.0}, "invalid", "timeout_s"),
    ({"timeout_s": float("nan")}, "invalid", "timeout_s"),
    ({"timeout_s": float("inf")}, "invalid", "timeout_s"),
    ({"timeout_s": 1e9}, "limit", "at most 600"),
    ({"timeout_s": "soon"}, "malformed", "timeout_s"),
], ids=lambda v: json.dumps(v)[:40] if isinstance(v, dict) else None)
async def test_bad_trace_requests_get_typed_errors(connect: Any, fields: dict[str, Any],
                                                  code: str, words: str) -> None:
    client = connect()
    reply = await client.ask({"type": "trace", "job": "anything", "iterations": 1, **fields})
    assert reply["type"] == "error" and reply["code"] == code, reply
    assert words in reply["message"] and reply["message"].startswith("commd: "), reply
    assert reply["ref"] == "trace" and len(reply["message"]) < 400
    await still_serving(client)


async def test_a_trace_without_a_job_field_is_malformed(connect: Any) -> None:
    reply = await connect().ask({"type": "trace", "iterations": 1})
    assert reply["type"] == "error" and reply["code"] == "malformed" and "job" in reply["message"]


def test_a_full_reply_fits_in_a_message() -> None:
    """The largest event the recorder makes (a top-k group's), MAX_EVENTS times."""
    event = TraceEvent(row="compression", name="group 65535", start_s=123456.123456789,
                       duration_s=0.000123456789, iteration=2**40,
                       args={"group": 65535, "layers": "65000-65535", "bytes": 2**40,
                             "exchange": "allreduce", "k": 2**30, "ratio": 0.123456789,
                             "gain": 0.123456, "wire_ms": 123.456789})
    reply = TraceReply(job="j" * 128, iterations=list(range(MAX_ITERATIONS)),
                       events=[event] * MAX_EVENTS, truncated="t" * 200)
    frame = encode(reply)
    assert len(frame) < daemon_codec.max_bytes, len(frame)
    assert daemon_codec.decode(frame) == reply
    assert client_codec.decode(encode(TraceRequest(job="j"))) == TraceRequest(job="j")


# --- a fake daemon: the file and the plot ---------------------------------------------------------


def canned_reply(node: int, shift: float) -> TraceReply:
    """One iteration of two groups; the write-backs overlap (two worker threads)."""
    t = 1000.0 + shift

    def span(row: str, group: int, start: float, end: float) -> TraceEvent:
        return TraceEvent(row=row, name=f"group {group}", start_s=t + start, iteration=7,
                          duration_s=end - start, args={"group": group, "layers": str(group)})

    ready = [TraceEvent(row="ready", name=f"l{layer}", start_s=t + 0.001 * (3 - layer),
                        iteration=7, args={"layer": layer, "group": min(layer, 1)})
             for layer in range(3)]
    return TraceReply(job="fake", node_index=node, nodes=2, iterations=[7], events=[
        TraceEvent(row="iteration", name="iteration 7", start_s=t, duration_s=0.02, iteration=7,
                   args={"plan": 1, "groups": 2}),
        TraceEvent(row="plan", name="plan v1", start_s=t, iteration=7, args={"version": 1}),
        *ready,
        span("local sum", 1, 0.0021, 0.0025), span("wire", 1, 0.0025, 0.006),
        span("write back", 1, 0.006, 0.012),
        span("local sum", 0, 0.0031, 0.0035), span("wire", 0, 0.006, 0.008),
        span("write back", 0, 0.008, 0.0101),
    ])


@pytest.fixture
def fake_daemons(tmp_path: Path) -> Iterator[list[str]]:
    """Two ROUTER sockets that answer a trace request with a canned reply; "error" as the
    job gets an error reply, "silent" none at all."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    paths, routers = [], []
    for node in range(2):
        router = context.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        paths.append(str(tmp_path / f"fake{node}.sock"))
        router.bind(f"ipc://{paths[-1]}")
        routers.append(router)
    stop = threading.Event()

    def serve() -> None:
        poller = zmq.Poller()
        for router in routers:
            poller.register(router, zmq.POLLIN)
        while not stop.is_set():
            for router, _ in poller.poll(50):
                identity, frame = router.recv_multipart()
                request = client_codec.decode(frame)
                assert isinstance(request, TraceRequest)
                node = routers.index(router)
                if request.job == "error":
                    reply: Any = {"type": "error", "code": "limit", "message": "commd: no way"}
                    router.send_multipart([identity, packed(reply)])
                elif request.job != "silent":
                    reply = canned_reply(node, shift=0.0005 * node)
                    router.send_multipart([identity, encode(reply)])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield paths
    finally:
        stop.set()
        thread.join(5)
        for router in routers:
            router.close(linger=0)


def packed(message: dict[str, Any]) -> bytes:
    return msgspec.msgpack.encode(message)


def trace_cli(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("COMMD_")}
    return subprocess.run([sys.executable, "-m", "commd.cli", "trace", *argv],
                          capture_output=True, text=True, timeout=timeout, cwd=REPO, env=environ)


def one_error_line(result: subprocess.CompletedProcess[str], code: int = 1) -> str:
    assert result.returncode == code, result
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("commd: "), result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    return lines[0]


def sockets(paths: list[str]) -> list[str]:
    return [word for path in paths for word in ("--socket", path)]


def test_the_file_has_a_process_per_daemon_and_lanes_for_overlaps(
        fake_daemons: list[str], tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    result = trace_cli(*sockets(fake_daemons), "--job", "fake", "-o", str(out))
    assert result.returncode == 0, result
    assert "node 0: iterations 7-7; node 1: iterations 7-7" in result.stdout
    data = json.loads(out.read_text())
    by_process = check_chrome_trace(data)
    assert sorted(by_process) == ["node 0", "node 1"]
    first = min(e["ts"] for events in by_process.values() for e in events)
    assert first == 0.0  # one clock: the earliest event of any daemon is the origin
    node1 = min(e["ts"] for e in by_process["node 1"])
    assert node1 == pytest.approx(500.0)  # 0.5 ms later, on the shared clock
    threads = {e["args"]["name"] for e in data["traceEvents"] if e["name"] == "thread_name"}
    assert {"ready", "local sum", "wire", "write back", "write back (2)"} <= threads
    for events in by_process.values():
        check_node(events, iterations=1, layers=3)


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="needs matplotlib")
def test_plot_writes_a_png(fake_daemons: list[str], tmp_path: Path) -> None:
    picture = tmp_path / "t.png"
    result = trace_cli(*sockets(fake_daemons), "--job", "fake", "-o", str(tmp_path / "t.json"),
                       "--plot", str(picture))
    assert result.returncode == 0, result
    assert "iteration 7 drawn in" in result.stdout
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_command_line_errors_are_one_line(fake_daemons: list[str], tmp_path: Path) -> None:
    out = str(tmp_path / "t.json")
    line = one_error_line(trace_cli("--socket", fake_daemons[0], "--job", "error", "-o", out))
    assert line == f"commd: {fake_daemons[0]}: no way"
    line = one_error_line(trace_cli("--socket", fake_daemons[0], "--job", "silent", "-o", out,
                                    "--timeout", "0.1"))
    assert line == f"commd: no trace from {fake_daemons[0]} within 2.1s"
    line = one_error_line(trace_cli("--socket", "/nonexistent", "--job", "j", "-o", out))
    assert line == "commd: no daemon socket at /nonexistent; is `commd run` running?"
    assert not os.path.exists(out)


@pytest.mark.parametrize(("argv", "words"), [
    (["--job", "j", "-n", "many"], "invalid int value: 'many'"),
    (["-n", "3"], "the following arguments are required: --job"),
    (["--job", "j", "--timeout", "0"], "--timeout must be a number of seconds over 0"),
    (["--job", "j", "--timeout", "nan"], "--timeout must be a number of seconds over 0"),
    (["--socket", "a.sock", "--socket", "a.sock", "--job", "j"], "a --socket is given twice"),
])
def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str],
                             words: str) -> None:
    from commd.cli.main import main

    try:
        code = main(["trace", *argv])
    except SystemExit as exc:  # argparse's own checks
        code = int(exc.code or 0)
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    (line,) = captured.err.splitlines()
    assert line.startswith("commd: ") and words in line, line


def test_an_unwritable_output_is_one_line(fake_daemons: list[str], tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    from commd.cli.main import main

    out = tmp_path / "no" / "such" / "t.json"
    assert main(["trace", "--socket", fake_daemons[0], "--job", "fake", "-o", str(out)]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line == f"commd: cannot write {out}: No such file or directory"


# --- real daemons and ranks -----------------------------------------------------------------------


def test_trace_two_daemons_with_two_ranks_each(start_daemon: Any, tmp_path: Path) -> None:
    nodes = [start_daemon(), start_daemon()]
    layers = [("embed", 4096), ("conv", 20000), ("norm", 64), ("fc", 30000)]
    # The ranks sleep a little in backward, as a model computes: the CPUs stay free enough.
    slow = {"skip_results": True, "backward_sleep_s": [0.002] * len(layers)}
    dense = JobSpec("dense", nodes, 2, layers, iterations=100_000, planner="wfbp", timeout=30,
                    overrides={r: slow for r in range(4)})
    topk = JobSpec("topk", nodes, 1, layers[:2], iterations=100_000, planner="wfbp",
                   timeout=30, compression="topk:0.1:allgather",
                   overrides={r: {**slow, "backward_sleep_s": [0.004] * 2} for r in range(2)})
    # A low-rank group has no k and no ratio: its trace names the exchange and its gain.
    lowrank = JobSpec("lowrank", nodes, 1, [("w", [64, 32]), ("b", 32)], iterations=100_000,
                      planner="wfbp", timeout=30, compression="powersgd:2:start=2",
                      overrides={r: {**slow, "backward_sleep_s": [0.004] * 2} for r in range(2)})
    processes = start_ranks(dense) + start_ranks(topk) + start_ranks(lowrank)
    try:
        await_registered(processes)
        out = tmp_path / "dense.json"
        result = trace_cli(*sockets([n.socket for n in nodes]), "--job", "dense", "-n", "3",
                           "-o", str(out))
        assert result.returncode == 0, result
        by_process = check_chrome_trace(json.loads(out.read_text()))
        assert sorted(by_process) == ["node 0", "node 1"]
        for events in by_process.values():
            check_node(events, iterations=3, layers=len(layers))
        out = tmp_path / "topk.json"
        result = trace_cli(*sockets([n.socket for n in nodes]), "--job", "topk", "-n", "2",
                           "-o", str(out))
        assert result.returncode == 0, result
        for events in check_chrome_trace(json.loads(out.read_text())).values():
            check_node(events, iterations=2, layers=2)
            chosen = [e for e in events if e["cat"] == "compression"]
            assert len(chosen) == 2 * 2 and {e["args"]["exchange"] for e in chosen} == \
                {"allgather"}
            assert all(e["args"]["k"] >= 1 and 0 < e["args"]["gain"] <= 1 for e in chosen)
        out = tmp_path / "lowrank.json"
        result = trace_cli(*sockets([n.socket for n in nodes]), "--job", "lowrank", "-n", "2",
                           "-o", str(out))
        assert result.returncode == 0, result
        for events in check_chrome_trace(json.loads(out.read_text())).values():
            chosen = [e for e in events if e["cat"] == "compression"]
            assert chosen and {e["args"]["exchange"] for e in chosen} == {"lowrank"}
            assert all("k" not in e["args"] and "ratio" not in e["args"] for e in chosen)
        line = one_error_line(trace_cli("--socket", nodes[0].socket, "--job", "nobody"))
        assert line == f"commd: {nodes[0].socket}: no job 'nobody' on this daemon; " \
            "`commd status` lists them"
    finally:
        kill_all(processes)
        collect(processes)
