"""Registering device buffers with a daemon on a machine without a usable GPU: bad fields get
typed errors naming the field, a well-formed device registration fails with the library's
reason and the daemon keeps serving; the new optional protocol fields round-trip."""


from __future__ import annotations

import time
from typing import Any

import msgspec
import numpy as np
import pytest

from commd.daemon.server import Daemon
from commd_protocol import Ready, Register, Registered, encode
from commd_protocol.codec import client_codec, daemon_codec

from gpu_jobs import gpu_present
from inprocess import coordinator_of, hello, still_serving

HANDLE = bytes(range(64))
DEVICE = {"type": "register", "dtype": "float32", "op": "sum", "planner": "wfbp",
          "layers": [{"name": "w", "size": 4}], "shm_name": "", "device": "cuda",
          "device_bus_id": "0000:01:00.0", "device_index": 0, "ipc_handle": HANDLE,
          "ipc_offset": 0, "event_handle": HANDLE}


def test_device_fields_round_trip_and_default() -> None:
    message = Register(layers=[], dtype="float32", op="sum", shm_name="", device="cuda",
                       device_bus_id="0000:3b:00.0", device_index=2, ipc_handle=HANDLE,
                       ipc_offset=512, event_handle=HANDLE[::-1])
    assert client_codec.decode(encode(message)) == message
    old = msgspec.msgpack.encode({"type": "register", "layers": [], "dtype": "float32",
                                  "op": "sum", "shm_name": "seg"})
    decoded = client_codec.decode(old)  # an old client: host memory, no handles
    assert isinstance(decoded, Register)
    assert (decoded.device, decoded.ipc_handle, decoded.ipc_offset) == ("cpu", b"", 0)
    ready = client_codec.decode(encode(Ready(layers=[1], sent_at=12.5)))
    assert isinstance(ready, Ready) and ready.sent_at == 12.5
    assert client_codec.decode(msgspec.msgpack.encode({"type": "ready", "layers": [0]})) == \
        Ready(layers=[0])
    reply = Registered(nodes=1, node_index=0, groups=[[0]], planner="wfbp", done_event=HANDLE)
    assert daemon_codec.decode(encode(reply)) == reply


async def test_bad_device_fields_are_named(daemon: Daemon, connect: Any) -> None:
    client = connect()
    await client.ask(hello(coordinator=coordinator_of(daemon)))
    cases = [
        ({"device": "tpu"}, "unsupported device 'tpu'; use one of cpu, cuda"),
        ({"ipc_handle": b"short"}, "ipc_handle must be 64 bytes (cudaIpcMemHandle_t), got 5"),
        ({"event_handle": b""}, "event_handle must be 64 bytes"),
        ({"ipc_offset": -8}, "ipc_offset -8 is outside 0..2**48"),
        ({"device_bus_id": ""}, "needs device_bus_id"),
        ({"compression": "topk:0.01"}, "compression 'topk:0.01' needs host buffers"),
        ({"compression": "powersgd:4"}, "compression 'powersgd:4' needs host buffers"),
        ({"device": "cpu"}, "a host buffer needs buffer_token"),
        ({"ipc_handle": "not bytes"}, "$.ipc_handle"),
    ]
    for change, words in cases:
        reply = await client.ask({**DEVICE, **change})
        assert reply["type"] == "error" and words in reply["message"], (change, reply)
    await still_serving(client)


async def test_a_device_buffer_without_a_usable_gpu(daemon: Daemon, connect: Any) -> None:
    if gpu_present():
        pytest.skip("this machine has a GPU: tests/daemon/test_gpu.py covers it")
    client = connect()
    await client.ask(hello(coordinator=coordinator_of(daemon)))
    reply = await client.ask(DEVICE)
    assert reply["type"] == "error" and reply["code"] == "invalid", reply
    assert reply["message"].startswith("commd: cannot use GPU 0000:01:00.0: commd: "), reply
    assert "cupy" in reply["message"] or "cuda" in reply["message"], reply
    await still_serving(client)
    assert daemon.status().jobs[0].state == "forming"


async def test_a_multi_node_device_job_needs_an_engine_that_takes_it(daemon: Daemon,
                                                                     connect: Any) -> None:
    client = connect()
    await client.ask(hello(job="two", world=2, coordinator=coordinator_of(daemon)))
    reply = await client.ask(DEVICE)
    assert reply["type"] == "error", reply
    assert "runs the gloo engine, which cannot reduce cuda buffers across nodes; run the " \
           "daemons with --backend nccl" in reply["message"], reply


async def test_ready_to_launch_is_measured_from_sent_at(daemon: Daemon, connect: Any,
                                                        segments: Any) -> None:
    client = connect()
    await client.ask(hello(coordinator=coordinator_of(daemon)))
    segment = await segments(16)
    reply = await client.ask({"type": "register", "dtype": "float32", "op": "sum",
                              "planner": "wfbp", "layers": [{"name": "w", "size": 4}],
                              "buffer_token": segment.token})
    assert reply["type"] == "registered" and reply["done_event"] == b"", reply
    buffer = np.frombuffer(segment.buf, dtype=np.float32, count=4)
    for iteration in range(3):
        buffer[:] = iteration
        await client.send({"type": "ready", "layers": [0], "sent_at": time.monotonic()})
        done = await client.ask({"type": "wait", "iteration": iteration})
        assert done["type"] == "done", done
    job = daemon.status().jobs[0]
    assert job.device == "cpu"
    latency = job.ready_to_launch
    assert latency is not None
    assert latency.samples == 3.0 and 0 <= latency.p50_us <= latency.p99_us < 1e6
    await client.send({"type": "goodbye"})
