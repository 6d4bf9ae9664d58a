"""The daemon in-process, spoken to over its real ipc socket with raw MessagePack frames, as a
client in another language would. Bad input gets a typed error; the daemon keeps serving."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import pytest

from commd.daemon.server import Daemon
from commd_protocol import PROTOCOL_VERSION

from inprocess import coordinator_of, hello, still_serving


@pytest.mark.parametrize(
    ("frame", "code", "words"),
    [
        (b"\xc1\xc1garbage", "malformed", "not a MessagePack message"),
        (msgpack.packb([1, 2, 3]), "malformed", "must be a map"),
        (msgpack.packb({"type": "launch_missiles"}), "unknown_type", "known types"),
        (msgpack.packb({"type": "hello", "rank": "zero"}), "malformed", "$.rank"),
        (msgpack.packb({"type": "ready", "layers": [0]}), "out_of_order", "before hello"),
        (msgpack.packb({"type": "wait", "iteration": 0}), "out_of_order", "before hello"),
        (msgpack.packb({"type": "register", "layers": [], "dtype": "float32", "op": "sum",
                        "shm_name": "x"}), "out_of_order", "before hello"),
        (msgpack.packb({"type": "status", "pad": "x" * (5 << 20)}), "too_large", "over the limit"),
    ],
)
async def test_bad_frames_get_typed_errors(connect: Any, frame: bytes, code: str,
                                           words: str) -> None:
    client = connect()
    reply = await client.ask(frame)
    assert reply["type"] == "error" and reply["code"] == code, reply
    assert reply["message"].startswith("commd: ") and words in reply["message"], reply
    await still_serving(client)


async def test_multipart_frame_is_refused(connect: Any) -> None:
    client = connect()
    await client.socket.send_multipart([b"a", b"b"])
    reply = await client.receive()
    assert reply["code"] == "malformed"
    await still_serving(client)


async def test_hello_errors(daemon: Daemon, connect: Any) -> None:
    client = connect()
    reply = await client.ask(hello(protocol=PROTOCOL_VERSION + 1))
    assert reply["code"] == "version" and "protocol version" in reply["message"]
    reply = await client.ask(hello(rank=3, world=2))
    assert reply["code"] == "invalid" and "rank 3" in reply["message"]
    reply = await client.ask(hello(job="bad job id!"))
    assert reply["code"] == "invalid" and "job id" in reply["message"]
    assert (await client.ask(hello()))["type"] == "welcome"
    assert (await client.ask(hello()))["code"] == "out_of_order"  # twice on one connection
    other = connect()
    reply = await other.ask(hello())  # same job, same local rank
    assert reply["code"] == "mismatch" and "already connected" in reply["message"]
    reply = await connect().ask(hello(world=2, rank=1))  # disagrees with the job's world size
    assert reply["code"] == "mismatch" and "world_size" in reply["message"]
    assert [job.job for job in daemon.status().jobs] == ["j"]


async def test_register_errors_change_nothing(daemon: Daemon, connect: Any,
                                              segments: Any) -> None:
    client = connect()
    await client.ask(hello(coordinator=coordinator_of(daemon)))
    small = await segments(16)
    base = {"type": "register", "dtype": "float32", "op": "sum", "planner": "wfbp"}
    reply = await client.ask({**base, "layers": [{"name": "w", "size": 8}],
                              "buffer_token": small.token})
    assert reply["code"] == "invalid" and "need 32 bytes" in reply["message"]
    reply = await client.ask({**base, "layers": [{"name": "w", "size": 1}],
                              "buffer_token": "commd-no-such-segment"})
    assert reply["code"] == "invalid" and "commd-no-such-segment" in reply["message"]
    reply = await client.ask({**base, "layers": [{"name": "w", "size": 1}], "dtype": "int8",
                              "buffer_token": small.token})
    assert reply["code"] == "invalid" and "dtype" in reply["message"]
    reply = await client.ask({**base, "layers": [{"name": "w", "size": 1}], "planner": "magic",
                              "buffer_token": small.token})
    assert reply["code"] == "invalid" and "optimal" in reply["message"]
    for compression, words in (("topk:0.1:momentum=1", "momentum must be in [0, 1)"),
                               ("topk:0.1:momentum=" + "9" * 10_000, "not understood"),
                               ("powersgd:0", "rank must be in 1..64"),
                               ("powersgd:4:start=1", "start must be ≥ 2"),
                               ("powersgd:4:warm=yes", "not understood"),
                               ("powersgd:4" + ":seed=1" * 5_000, "not understood"),
                               ("auto:fast", "not understood")):
        reply = await client.ask({**base, "layers": [{"name": "w", "size": 1}],
                                  "compression": compression, "buffer_token": small.token})
        assert reply["code"] == "invalid" and words in reply["message"], reply
        assert len(reply["message"]) < 1000  # the oversized value is not echoed whole
    reply = await client.ask({**base, "layers": [{"name": "w", "size": 2}], "dtype": "float16",
                              "compression": "powersgd:4", "buffer_token": small.token})
    assert reply["code"] == "invalid" and "low-rank compression needs float32" in reply["message"]
    reply = await client.ask({"type": "wait", "iteration": 0})
    assert reply["code"] == "out_of_order" and "wait before register" in reply["message"]
    # After all that, a correct register still works.
    reply = await client.ask({**base, "layers": [{"name": "w", "size": 4}],
                              "buffer_token": small.token})
    assert reply["type"] == "registered" and reply["nodes"] == 1, reply


async def test_a_job_in_another_language_with_bad_readies(daemon: Daemon, connect: Any,
                                                          segments: Any) -> None:
    """Two local ranks, raw msgpack: bad readies are refused and the iteration still sums."""
    sizes = [3, 5]
    ranks = [connect(), connect()]
    buffers = []
    for local, client in enumerate(ranks):
        welcome = await client.ask(hello(job="raw", rank=local, world=2, local=local,
                                         local_world=2, coordinator=coordinator_of(daemon)))
        assert welcome["type"] == "welcome"
        segment = await segments(4 * sum(sizes))
        buffers.append(np.frombuffer(segment.buf, dtype=np.float32, count=sum(sizes)))
        await client.send({"type": "register", "dtype": "float32", "op": "sum",
                           "planner": "wfbp", "buffer_token": segment.token,
                           "layers": [{"name": f"l{i}", "size": n} for i, n in enumerate(sizes)]})
    for client in ranks:
        reply = await client.receive()
        assert reply["type"] == "registered" and reply["groups"] == [[1], [0]], reply
    for iteration in range(3):
        for local, client in enumerate(ranks):
            buffers[local][:] = np.arange(8) + 10 * local + iteration
            await client.send({"type": "ready", "layers": [1]})
        if iteration == 0:
            reply = await ranks[0].ask({"type": "ready", "layers": [1]})
            assert reply["code"] == "invalid" and "twice" in reply["message"]
            reply = await ranks[0].ask({"type": "ready", "layers": [7]})
            assert reply["code"] == "invalid" and "unknown layer 7" in reply["message"]
            for ahead_or_before_any in (5, -1):
                reply = await ranks[0].ask({"type": "wait", "iteration": ahead_or_before_any})
                assert reply["code"] == "out_of_order", reply
        if iteration == 2:  # two iterations done: the last one is answered, an older refused
            reply = await ranks[0].ask({"type": "wait", "iteration": 0})
            assert reply["code"] == "out_of_order" and "the job is at 2" in reply["message"]
            reply = await ranks[0].ask({"type": "wait", "iteration": 1})
            assert reply["type"] == "done" and reply["iteration"] == 1 and reply["dense"], reply
        for client in ranks:
            await client.send({"type": "ready", "layers": [0]})
            await client.send({"type": "wait", "iteration": iteration})
        for local, client in enumerate(ranks):
            done = await client.receive()
            assert done["type"] == "done" and done["iteration"] == iteration, done
            expected = 2 * (np.arange(8) + iteration) + 10
            np.testing.assert_array_equal(buffers[local], expected)
    status = daemon.status().jobs[0]
    assert status.iteration == 3 and status.state == "running"
    for client in ranks:
        await client.send({"type": "goodbye"})
    await still_serving(connect())
