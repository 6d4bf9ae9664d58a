"""No frame costs more than its size, and no integer in one overflows later.

Each hostile frame below used to stall the daemon (a quadratic duplicate check in a ready),
break its peer loop (an iteration past 2**64 - 1 in a report) or bloat the coordinator (joins
over --max-layers). Each must now get a typed refusal at once, with both loops serving
afterwards; the last test runs a real 2-node job after them and checks it is exact.
Peers connect with the workdir's cluster key when the daemon has one (keyed or not, the
frames are the same)."""

from __future__ import annotations

import asyncio
import tomllib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
import zmq.asyncio

from commd.daemon.peer_security import ClusterKey, connect_securely
from commd.daemon.server import Daemon
from commd.daemon.settings import SettingsError, load
from commd.testing.ranks import JobSpec, assert_exact, collect, start_ranks
from commd_client.host_buffer import HostBuffer
from commd_protocol import PROTOCOL_VERSION
from commd_protocol.handover import buffer_socket_path
from commd_protocol.limits import MAX_COUNT, MAX_LOCAL_RANKS, MAX_RANKS
from commd_protocol.limits import MAX_LAYERS as PROTOCOL_MAX_LAYERS

from inprocess import RawClient, coordinator_of, hand_over, still_serving

MAX_LAYERS = 64  # the daemon's --max-layers in this module
LAYERS = [{"name": f"l{i}", "size": 2} for i in range(4)]
REGISTER = {"type": "register", "dtype": "float32", "op": "sum", "planner": "wfbp",
            "layers": LAYERS}


@pytest.fixture
def daemon_settings() -> dict[str, Any]:
    return {"max_layers": MAX_LAYERS, "max_job_bytes": 1 << 20}


def peer_dealer(context: zmq.Context[Any] | zmq.asyncio.Context, port: int,
                key_dir: Path) -> Any:
    """A DEALER to a daemon's peer port; CurveZMQ with ``key_dir/cluster.key`` when the daemon
    made or was given one there (an unkeyed daemon's automatic key), plain otherwise."""
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    key = key_dir / "cluster.key"
    if key.exists():  # read as a daemon beside it does; the test's user owns the file
        pair = tomllib.loads(key.read_text())
        connect_securely(sock, ClusterKey(pair["public"].encode(), pair["secret"].encode()))
    sock.connect(f"tcp://127.0.0.1:{port}")
    return sock


@pytest.fixture
async def peer(daemon: Daemon) -> AsyncIterator[zmq.asyncio.Socket]:
    context = zmq.asyncio.Context()
    sock = peer_dealer(context, daemon.peer_port, Path(daemon.settings.socket).parent)
    yield sock
    sock.close(linger=0)
    context.term()


async def answer(sock: zmq.asyncio.Socket) -> dict[str, Any]:
    """The coordinator's next message but its every-2-s ``peer_status``."""
    while True:
        reply: dict[str, Any] = msgpack.unpackb(await asyncio.wait_for(sock.recv(), 20))
        if reply["type"] != "peer_status":
            return reply


def join(job: str = "pj", **fields: Any) -> dict[str, Any]:
    return {"type": "peer_join", "protocol": PROTOCOL_VERSION, "job": job, "ranks": [0],
            "world_size": 1, "layers": LAYERS, "dtype": "float32", "op": "sum",
            "planner": "wfbp", "host": "127.0.0.1", **fields}


def failures(daemon: Daemon) -> dict[str, int]:
    """What the daemon's guards caught as exceptions (not refusals): "<Error> in <where>"."""
    guards = (daemon._peer_guard, daemon._client_guard)
    return {kind: n for guard in guards for kind, n in guard.counts.items() if " in " in kind}


async def register_job(daemon: Daemon, client: RawClient, buffer: HostBuffer, job: str,
                       **fields: Any) -> dict[str, Any]:
    """A one-rank job coordinated by ``daemon``: hello, the buffer handed over, register
    (with ``fields`` changed). The reply to register."""
    welcome = await client.ask({"type": "hello", "protocol": PROTOCOL_VERSION, "job": job,
                                "rank": 0, "world_size": 1, "local_rank": 0,
                                "local_world_size": 1, "coordinator": coordinator_of(daemon)})
    assert welcome["type"] == "welcome", welcome
    token = await hand_over(daemon, buffer)
    return await client.ask({**REGISTER, "buffer_token": token, **fields})


async def running_rank(daemon: Daemon, client: RawClient, job: str) -> HostBuffer:
    buffer = HostBuffer(f"commd-cost-{job}", 4 * 8)
    reply = await register_job(daemon, client, buffer, job)
    assert reply["type"] == "registered", reply
    return buffer


# --- client frames ---------------------------------------------------------------------------


@pytest.mark.parametrize(("layers", "words"), [
    ([0] * 1_000_000, "ready lists 1000000 layers; the job has 4"),
    ([i % 4 for i in range(10_000)], "ready lists 10000 layers; the job has 4"),
    ([2**64 - 1, 0], f"unknown layer {2**64 - 1}"),
    ([3, 2, 3], "ready twice in iteration 0 for layer(s) [3]"),
], ids=["million-duplicates", "i-mod-4", "past-int64", "a-duplicate"])
async def test_a_costly_ready_is_refused_at_once_and_status_still_answers(
        daemon: Daemon, connect: Any, layers: list[int], words: str) -> None:
    client = connect()
    buffer = await running_rank(daemon, client, "costly")
    try:
        await client.send({"type": "ready", "layers": layers})
        # Another user's status on another connection: answered, so the loop was not held
        # (before, the million duplicates held it for minutes and this wait failed).
        await still_serving(connect())
        reply = await client.receive()
        assert reply["type"] == "error" and reply["code"] == "invalid", reply
        assert words in reply["message"] and reply["message"].startswith("commd: "), reply
        assert len(reply["message"]) < 400, reply  # a refusal does not echo the frame
        # nothing was marked: the rank's real iteration still completes
        await client.send({"type": "ready", "layers": [3, 2, 1, 0]})  # no reply: marked
        done = await client.ask({"type": "wait", "iteration": 0})
        assert done["type"] == "done" and done["iteration"] == 0, done
    finally:
        buffer.close()
    assert failures(daemon) == {}


async def test_a_ready_past_the_protocols_layer_bound_is_refused_from_its_header(
        daemon: Daemon, connect: Any) -> None:
    """A ready of more layers than any job may have (2**20) is refused from the array's
    header, before its elements are built (a 4 MiB frame holds four million one-byte
    integers); the rank's job goes on."""
    client = connect()
    buffer = await running_rank(daemon, client, "bound")
    try:
        for field in ("layers", "stamps"):
            too_many = PROTOCOL_MAX_LAYERS + 1
            frame: dict[str, Any] = {"type": "ready", "layers": [0] * too_many}
            if field == "stamps":
                frame = {"type": "ready", "layers": [0], "stamps": [0] * too_many}  # one byte each
            reply = await client.ask(frame)
            assert reply["type"] == "error" and reply["code"] == "malformed", reply
            assert f"length <= {PROTOCOL_MAX_LAYERS}" in reply["message"], reply
            assert f"$.{field}" in reply["message"], reply
        await client.send({"type": "ready", "layers": [3, 2, 1, 0]})  # nothing was marked
        done = await client.ask({"type": "wait", "iteration": 0})
        assert done["type"] == "done" and done["iteration"] == 0, done
    finally:
        buffer.close()
    assert failures(daemon) == {}


def test_max_layers_may_not_exceed_the_protocols_bound() -> None:
    bound = PROTOCOL_MAX_LAYERS
    assert load(environ={"COMMD_MAX_LAYERS": str(bound)}).max_layers == bound
    with pytest.raises(SettingsError, match=r"max_layers must be at most 1048576"):
        load(environ={"COMMD_MAX_LAYERS": str(bound + 1)})


async def test_duplicates_within_the_job_size_are_named_briefly(daemon: Daemon,
                                                                connect: Any) -> None:
    """A ready as long as the job, every layer twice: counted, not searched per layer, and
    the refusal names the first 20 layers only."""
    client = connect()
    buffer = HostBuffer("commd-cost-dups", 4 * MAX_LAYERS)
    layers = [{"name": f"l{i}", "size": 1} for i in range(MAX_LAYERS)]
    try:
        reply = await register_job(daemon, client, buffer, "dups", layers=layers)
        assert reply["type"] == "registered", reply
        half = list(range(MAX_LAYERS // 2))
        reply = await client.ask({"type": "ready", "layers": half + half})
        assert reply["code"] == "invalid" and "ready twice" in reply["message"], reply
        assert f"and {MAX_LAYERS // 2 - 20} more" in reply["message"], reply
    finally:
        buffer.close()


@pytest.mark.parametrize(("fields", "words"), [
    ({"world_size": MAX_RANKS + 1, "local_world_size": 1}, "world_size 1048577 is outside"),
    ({"world_size": 2**64 - 1}, "world_size"),
    ({"pid": 2**63 - 1}, "is not a process id"),
    ({"pid": -5}, "is not a process id"),
], ids=["world-over-2**20", "world-2**64", "pid-huge", "pid-negative"])
async def test_hello_integers_out_of_range_are_invalid(connect: Any, fields: dict[str, Any],
                                                      words: str) -> None:
    client = connect()
    hello = {"type": "hello", "protocol": PROTOCOL_VERSION, "job": "ints", "rank": 0,
             "world_size": 2, "local_rank": 0, "local_world_size": 1,
             "coordinator": "127.0.0.1:1", **fields}
    reply = await client.ask(hello)
    assert reply["type"] == "error" and reply["code"] == "invalid", reply
    assert words in reply["message"], reply
    ok = await connect().ask({**hello, "world_size": MAX_RANKS, "local_world_size": 1,
                              "pid": 0})
    assert ok["type"] == "welcome", ok  # the largest world is fine


@pytest.mark.parametrize(("fields", "words"), [
    ({"layers": [{"name": "w", "size": 2**40 + 1}]}, "over 2**40"),
    ({"ipc_offset": 2**64 - 1}, "ipc_offset"),
    ({"device_index": 2**63 - 1}, "device_index"),
], ids=["layer-size", "ipc-offset", "device-index"])
async def test_register_integers_out_of_range_are_invalid(
        daemon: Daemon, connect: Any, fields: dict[str, Any], words: str) -> None:
    client = connect()
    buffer = HostBuffer("commd-cost-reg", 4 * 8)
    try:
        reply = await register_job(daemon, client, buffer, "reg-ints", **fields)
        assert reply["type"] == "error" and reply["code"] == "invalid", reply
        assert words in reply["message"], reply
        # the happy path: the same rank registers right, once corrected
        ok = await client.ask({**REGISTER, "buffer_token": await hand_over(daemon, buffer)})
        assert ok["type"] == "registered", ok
    finally:
        buffer.close()


ROWS_REFUSED = [
    ({"name": "w", "size": 12, "rows": -1}, "invalid", "has rows -1; must be between 0"),
    ({"name": "w", "size": 12, "rows": 13}, "invalid", "has rows 13; must be between 0 (a "
                                                       "vector) and the layer's size 12"),
    ({"name": "w", "size": 12, "rows": 5}, "invalid", "has rows 5; must divide"),
    ({"name": "w", "size": 12, "rows": 2**64 - 1}, "invalid", "has rows 18446744073709551615"),
    ({"name": "w", "size": 12, "rows": "3"}, "malformed", "$.layers[1].rows"),
    ({"name": "w", "size": 12, "rows": 3.0}, "malformed", "$.layers[1].rows"),
    ({"name": "w", "size": 12, "rows": True}, "malformed", "$.layers[1].rows"),
    ({"name": "w", "size": 12, "rows": [3, 4]}, "malformed", "$.layers[1].rows"),
]
ROWS_IDS = ["negative", "over-size", "not-dividing", "2**64-1", "str", "float", "bool", "list"]
SHAPED = [{"name": "b", "size": 4}, {"name": "w", "size": 12, "rows": 3}]  # 3 x 4


@pytest.mark.parametrize(("layer", "code", "words"), ROWS_REFUSED, ids=ROWS_IDS)
async def test_a_register_with_bad_rows_is_refused_naming_the_layer(
        daemon: Daemon, connect: Any, layer: dict[str, Any], code: str, words: str) -> None:
    """A layer's matrix rows (``Layer.rows``) out of range, not dividing its size or of the
    wrong type: a typed refusal naming the layer, and the same rank then registers right;
    the node's job keeps the rows per layer (``members.rows``) and its join carries them to
    the coordinator."""
    client = connect()
    buffer = HostBuffer("commd-cost-rows", 4 * 16)
    try:
        reply = await register_job(daemon, client, buffer, "rows",
                                   layers=[{"name": "b", "size": 4}, layer])
        assert reply["type"] == "error" and reply["code"] == code, reply
        assert words in reply["message"], reply
        if code == "invalid":
            assert "layer 1 ('w')" in reply["message"], reply
        assert failures(daemon) == {}
        ok = await client.ask({**REGISTER, "layers": SHAPED,
                               "buffer_token": await hand_over(daemon, buffer)})
        assert ok["type"] == "registered", ok
        members = daemon.jobs["rows"].members
        assert members.rows == [0, 3] and members.sizes == [4, 12]
        (join_held,) = daemon._coordinator._jobs["rows"].joins.values()
        assert [layer.rows for layer in join_held.layers] == [0, 3]
    finally:
        buffer.close()


# --- peer frames -----------------------------------------------------------------------------


@pytest.mark.parametrize(("report", "words"), [
    ({"iteration": 2**64 - 1}, "iteration 18446744073709551615 is outside -1..2**53"),
    ({"iteration": MAX_COUNT + 1}, "iteration"),
    ({"round": 2**63 - 1}, "round"),
    ({"plan": 2**64 - 1}, "plan"),
    ({"comm": [[1e300, 0, 8, 0.001]]}, "comm row"),
], ids=["iteration-2**64-1", "iteration-2**53+1", "round", "plan", "comm-key"])
async def test_a_report_with_an_integer_out_of_range_is_refused_not_raised(
        daemon: Daemon, peer: zmq.asyncio.Socket, report: dict[str, Any], words: str) -> None:
    await peer.send(msgpack.packb(join()))
    assert (await answer(peer))["type"] == "peer_setup"
    base = {"type": "peer_profile", "job": "pj", "round": 1, "iteration": 9}
    await peer.send(msgpack.packb({**base, **report}))
    reply = await answer(peer)
    assert reply["type"] == "peer_abort" and reply["code"] == "invalid", reply
    assert "report is refused" in reply["message"] and words in reply["message"], reply
    assert failures(daemon) == {}  # before: OverflowError encoding the plan, caught by the guard
    # the happy path: the same job id again, a plain report, a plan back
    await peer.send(msgpack.packb(join()))
    assert (await answer(peer))["type"] == "peer_setup"
    await peer.send(msgpack.packb({**base, "iteration": MAX_COUNT - 100}))
    plan = await answer(peer)
    assert plan["type"] == "peer_plan" and plan["round"] == 1, plan


@pytest.mark.parametrize(("fields", "code", "words"), [
    ({"layers": [{"name": f"l{i}", "size": 1} for i in range(MAX_LAYERS + 1)]}, "limit",
     f"{MAX_LAYERS + 1} layers is over this coordinator's limit of {MAX_LAYERS}"),
    ({"layers": [{"name": f"l{i}", "size": 1} for i in range(180_000)]}, "limit",
     "180000 layers is over"),
    ({"layers": [{"name": "w", "size": 1 << 20}]}, "limit", "max_job_bytes"),
    ({"layers": [{"name": "w", "size": 2**64 - 1}]}, "invalid", "over 2**40"),
    ({"world_size": MAX_RANKS + 1}, "invalid", "world_size 1048577 is outside"),
    ({"world_size": 2**64 - 1, "ranks": [2**64 - 2]}, "invalid", "world_size"),
], ids=["max-layers", "180k-layers", "max-job-bytes", "layer-2**64", "world-2**20",
        "world-2**64"])
async def test_a_join_over_the_daemons_limits_is_refused(
        daemon: Daemon, peer: zmq.asyncio.Socket, fields: dict[str, Any], code: str,
        words: str) -> None:
    await peer.send(msgpack.packb(join("big", **fields)))
    reply = await answer(peer)
    assert reply["type"] == "peer_abort" and reply["code"] == code, reply
    assert words in reply["message"] and "refused this node's join" in reply["message"], reply
    assert daemon.status().coordinating == []  # nothing held for it
    await peer.send(msgpack.packb(join("big", layers=[{"name": f"l{i}", "size": 1}
                                                      for i in range(MAX_LAYERS)])))
    assert (await answer(peer))["type"] == "peer_setup"  # at the limit: formed


@pytest.mark.parametrize(("layer", "code", "words"), ROWS_REFUSED, ids=ROWS_IDS)
async def test_a_join_with_bad_rows_is_refused_naming_the_layer(
        daemon: Daemon, peer: zmq.asyncio.Socket, layer: dict[str, Any], code: str,
        words: str) -> None:
    """The coordinator checks a join's rows as a node checks its ranks' registers: a peer
    daemon is not trusted either. A malformed one never reaches the coordinator (the peer
    loop drops what it cannot decode); a well-typed bad one is refused naming the layer."""
    await peer.send(msgpack.packb(join("rows", layers=[{"name": "b", "size": 4}, layer])))
    if code == "invalid":
        reply = await answer(peer)
        assert reply["type"] == "peer_abort" and reply["code"] == "invalid", reply
        assert "refused this node's join" in reply["message"], reply
        assert "layer 1 ('w')" in reply["message"] and words in reply["message"], reply
    assert failures(daemon) == {}
    assert daemon.status().coordinating == []  # nothing held for it
    await peer.send(msgpack.packb(join("rows", layers=SHAPED)))
    assert (await answer(peer))["type"] == "peer_setup"
    (held,) = daemon._coordinator._jobs["rows"].joins.values()
    assert [layer.rows for layer in held.layers] == [0, 3]
    if code == "malformed":  # the frames of one link arrive in order: it was refused first
        assert daemon._peer_guard.counts.get("bad peer message (malformed)", 0) >= 1


async def test_joins_of_one_job_share_one_layer_list(daemon: Daemon) -> None:
    """N nodes joining a job with the same layers: the coordinator holds one list, and a join
    is compared with one other, not with every join so far."""
    context = zmq.asyncio.Context()
    root = Path(daemon.settings.socket).parent
    nodes = [peer_dealer(context, daemon.peer_port, root) for _ in range(8)]
    layers = [{"name": f"l{i}", "size": 1} for i in range(MAX_LAYERS)]
    try:
        for rank, sock in enumerate(nodes[:-1]):
            await sock.send(msgpack.packb(join("shared", ranks=[rank], world_size=len(nodes),
                                               layers=layers)))
        jobs = daemon._coordinator._jobs
        while "shared" not in jobs or len(jobs["shared"].joins) < len(nodes) - 1:
            await asyncio.sleep(0.01)  # polling a condition, bounded by the test timeout
        formation = jobs["shared"]
        held = {id(j.layers) for j in formation.joins.values()}
        assert len(held) == 1, held
        # a rank twice is still found (from the ranks seen, not by comparing every pair)
        await nodes[-1].send(msgpack.packb(join("shared", ranks=[3], world_size=len(nodes),
                                                layers=layers)))
        reply = await answer(nodes[-1])
        assert reply["type"] == "peer_abort" and "rank 3 joined from two nodes" in \
            reply["message"], reply
    finally:
        for sock in nodes:
            sock.close(linger=0)
        context.term()


@pytest.mark.parametrize(("beat", "words"), [
    ({"missing": [[0, 0], [0, 1]]}, "missing has 2 rows for the node's 1 ranks"),
    ({"missing": [[0, 0, 0]]}, "missing row"),
    ({"missing": [[5, 0]]}, "missing row"),
    ({"missing": [[0, 2**64 - 1]]}, "missing row"),
    ({"iteration": 2**64 - 1}, "iteration"),
    ({"waiting_s": float("inf")}, "waiting_s"),
], ids=["two-rows", "row-of-3", "not-its-rank", "layer-2**64", "iteration", "waiting-inf"])
async def test_a_bad_heartbeat_aborts_its_job_only(
        daemon: Daemon, peer: zmq.asyncio.Socket, beat: dict[str, Any], words: str) -> None:
    await peer.send(msgpack.packb(join()))
    assert (await answer(peer))["type"] == "peer_setup"
    await peer.send(msgpack.packb({"type": "peer_heartbeat", "job": "pj", "iteration": 3,
                                   "missing": [[0, 1]]}))  # the happy path: nothing back
    await peer.send(msgpack.packb({"type": "peer_heartbeat", "job": "pj", **beat}))
    reply = await answer(peer)
    assert reply["type"] == "peer_abort" and reply["code"] == "invalid", reply
    assert "heartbeat is refused" in reply["message"] and words in reply["message"], reply
    assert failures(daemon) == {}


async def test_frames_past_what_any_node_sends_are_dropped_before_they_are_built(
        daemon: Daemon, peer: zmq.asyncio.Socket) -> None:
    """A heartbeat naming more ranks than a daemon serves, a coordinator's own messages sent
    to a coordinator: refused from their header or tag (counted), the job goes on."""
    await peer.send(msgpack.packb(join()))
    assert (await answer(peer))["type"] == "peer_setup"
    await peer.send(msgpack.packb({"type": "peer_heartbeat", "job": "pj",
                                   "missing": [[0, 0]] * (MAX_LOCAL_RANKS + 1)}))
    await peer.send(msgpack.packb({"type": "peer_plan", "job": "pj", "round": 0,
                                   "effective_iteration": 0, "version": 1,
                                   "groups": [[0]] * 1_000_000, "alpha_s": 0.0,
                                   "beta_s_per_byte": 0.0, "predicted_comm_s": 0.0}))
    await peer.send(msgpack.packb({"type": "peer_profile", "job": "pj", "round": 0,
                                   "iteration": -1}))
    reply = await answer(peer)
    assert reply["type"] == "peer_plan" and reply["round"] == 0, reply  # the job went on
    counts = daemon._peer_guard.counts
    assert counts["bad peer message (malformed)"] == 1, counts
    assert counts["bad peer message (not for a coordinator)"] == 1, counts
    assert failures(daemon) == {}


# --- afterwards: a real 2-node job -----------------------------------------------------------


@pytest.fixture
def hostile_client() -> Iterator[zmq.Context[Any]]:
    context: zmq.Context[Any] = zmq.Context()
    yield context
    context.destroy(linger=0)


def ask(sock: zmq.Socket[Any], message: dict[str, Any], timeout_s: float = 30.0) -> Any:
    sock.send(msgpack.packb(message))
    while True:
        if not sock.poll(int(timeout_s * 1000)):
            raise AssertionError(f"no answer to {message['type']} within {timeout_s:g}s")
        reply = msgpack.unpackb(sock.recv())
        if reply["type"] not in ("progress", "peer_status"):
            return reply


def test_after_the_worst_frames_a_two_node_job_is_exact(
        start_daemon: Any, tmp_path: Path, hostile_client: zmq.Context[Any]) -> None:
    nodes = [start_daemon("--max-layers", str(MAX_LAYERS)) for _ in range(2)]
    coordinator = nodes[0]
    # a running one-rank job on node 0, then a million-duplicate ready from its rank
    rank = hostile_client.socket(zmq.DEALER)
    rank.setsockopt(zmq.LINGER, 0)
    rank.connect(f"ipc://{coordinator.socket}")
    buffer = HostBuffer("commd-cost-real", 4 * 8)
    try:
        welcome = ask(rank, {"type": "hello", "protocol": PROTOCOL_VERSION, "job": "victim",
                             "rank": 0, "world_size": 1, "local_rank": 0,
                             "local_world_size": 1, "coordinator": coordinator.address})
        assert welcome["type"] == "welcome", welcome
        token = buffer.hand_over(buffer_socket_path(coordinator.socket), 10.0)
        registered = ask(rank, {"type": "register", "dtype": "float32", "op": "sum",
                                "planner": "wfbp", "buffer_token": token, "layers": LAYERS})
        assert registered["type"] == "registered", registered
        rank.send(msgpack.packb({"type": "ready", "layers": [0] * 1_000_000}))
        status = hostile_client.socket(zmq.DEALER)
        status.setsockopt(zmq.LINGER, 0)
        status.connect(f"ipc://{coordinator.socket}")
        assert ask(status, {"type": "status"})["type"] == "status_reply"
        status.close()
        refused = msgpack.unpackb(rank.recv())
        assert refused["code"] == "invalid" and "ready lists" in refused["message"], refused
    finally:
        rank.close()
        buffer.close()
    # a peer: a report past 2**64 - 1, a join over --max-layers
    peer = peer_dealer(hostile_client, coordinator.port, tmp_path)
    try:
        assert ask(peer, join("spy"))["type"] == "peer_setup"
        aborted = ask(peer, {"type": "peer_profile", "job": "spy", "round": 1,
                             "iteration": 2**64 - 1})
        assert aborted["type"] == "peer_abort" and "report is refused" in aborted["message"]
        over = ask(peer, join("fat", layers=[{"name": f"l{i}", "size": 1}
                                             for i in range(180_000)]))
        assert over["type"] == "peer_abort" and over["code"] == "limit", over
    finally:
        peer.close()
    # a real job over both daemons, exact
    layers = [("conv.weight", 432), ("conv.bias", 16), ("fc.weight", 640), ("fc.bias", 10)]
    spec = JobSpec("after-worst", nodes, 1, layers, iterations=4, timeout=60)
    assert_exact(spec, collect(start_ranks(spec)))
    log = coordinator.log()
    assert "the loop goes on" not in log and "Traceback" not in log, log[-2000:]


@pytest.mark.parametrize(("world", "joined", "missing"), [
    (MAX_RANKS, [], list(range(21))),
    (MAX_RANKS, list(range(1, MAX_LOCAL_RANKS)),
     [0, *range(MAX_LOCAL_RANKS, MAX_LOCAL_RANKS + 20)]),
    (10, [0, 2, 3, 7], [1, 4, 5, 6, 8, 9]),
    (5, [0, 1, 2, 3, 4], []),
])
def test_a_joining_jobs_progress_names_its_missing_ranks_from_the_gaps(
        world: int, joined: list[int], missing: list[int]) -> None:
    """A rank may say world 2**20: its job's progress message, built every tick while it
    joins, looks at the ranks joined, not at every rank of the world."""
    from commd.job.liveness import first_missing

    assert first_missing(world, joined, 21) == missing


@pytest.mark.parametrize(("fields", "words"), [
    ({"parent": "no spaces allowed"}, "parent: invalid job id"),
    ({"parent": "p" * 200}, "parent: invalid job id"),
    ({"parent": "p", "parent_epoch": -1}, "parent: parent_epoch -1 is outside"),
    ({"parent": "p", "parent_epoch": 2**62}, "parent: parent_epoch"),
    ({"parent": "p", "parent_epoch": 2**64 - 1}, ""),
    ({"coordinator": "127.0.0.1:0"}, "coordinator must be HOST:PORT, got port 0"),
    ({"coordinator": "127.0.0.1:70000"}, "coordinator must be HOST:PORT, got port 70000"),
], ids=["bad-id", "long-id", "epoch-negative", "epoch-huge", "epoch-2**64", "port-0",
        "port-70000"])
async def test_a_hellos_parent_and_coordinator_are_checked(connect: Any, fields: dict[str, Any],
                                                          words: str) -> None:
    hello = {"type": "hello", "protocol": PROTOCOL_VERSION, "job": "kid", "rank": 0,
             "world_size": 2, "local_rank": 0, "local_world_size": 1,
             "coordinator": "127.0.0.1:1"}
    reply = await connect().ask({**hello, **fields})
    assert reply["type"] == "error" and reply["code"] == "invalid", reply
    assert words in reply["message"], reply
    ok = await connect().ask({**hello, "parent": "p", "parent_epoch": 7})
    assert ok["type"] == "welcome", ok


async def test_a_helper_of_a_job_whose_membership_moved_on_is_refused_at_hello(
        daemon: Daemon, connect: Any) -> None:
    """A state transfer's job names the tolerant job and epoch it serves (``parent``): one
    for an epoch the job has left on this node is refused at once (RANK_LOST), one for the
    epoch in force, or for a job this node does not run, is welcome."""
    helper = {"type": "hello", "protocol": PROTOCOL_VERSION, "rank": 0, "world_size": 2,
              "local_rank": 0, "local_world_size": 1, "coordinator": "127.0.0.1:1"}
    parent = await connect().ask({**helper, "job": "parent-job"})
    assert parent["type"] == "welcome", parent
    daemon.jobs["parent-job"].epochs.epoch = 3  # as after three membership changes
    helper["parent"] = "parent-job"
    late = await connect().ask({**helper, "job": "parent-job.state2.1", "parent_epoch": 2})
    assert late["type"] == "error" and late["code"] == "rank_lost", late
    assert "changed its membership (epoch 3) before this helper of its epoch 2" in \
        late["message"]
    for job, fields in (("parent-job.state3.1", {"parent_epoch": 3}),
                        ("other.state1.1", {"parent": "other", "parent_epoch": 1})):
        ok = await connect().ask({**helper, "job": job, **fields})
        assert ok["type"] == "welcome", ok
