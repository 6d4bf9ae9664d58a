"""Worker processes of bench/gpu_check.py, one per rank; each prints one JSON line.

Modes (``python bench/gpu_ranks.py MODE '<json spec>'``):

* ``daemon``: a rank with device buffers; for each size, a job of one layer that is reduced
  ``iterations`` times back to back (ready → wait, the stream waits on the GPU); the time per
  iteration is measured on the host around the whole loop, after a final synchronize.
* ``raw``: one rank of a plain 2-rank cupy NCCL communicator (no daemon); the same sizes and
  iteration counts, ``ncclAllReduce`` in place back to back on one stream.
* ``local``: one process doing the node-local device work of 2 ranks without a daemon (the
  daemon's own kernels: sum into the first buffer, copy back into the second).
* ``latency``: a rank marking ``layers`` one-KiB layers one by one (``gap_us`` apart, busy-
  waiting), planner wfbp (one group per layer); rank 0 reads the daemon's ready-to-launch
  percentiles from ``commd status`` before leaving.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import cupy

from commd.cli.status import query
from commd.engines.cuda import kernels as cuda_kernels
from commd_client import Client


def iterations_for(nbytes: int) -> int:
    """Enough repeats to average out noise, few for the big sizes (both sides agree)."""
    return max(5, min(300, (256 << 20) // max(nbytes, 1)))


def client(spec: dict[str, Any], job: str) -> Client:
    return Client(job=job, rank=spec["rank"], world_size=spec["world_size"],
                  local_rank=spec["local_rank"], local_world_size=spec["local_world_size"],
                  coordinator=spec["coordinator"], socket=spec["socket"], timeout=180)


def daemon_sweep(spec: dict[str, Any]) -> dict[str, Any]:
    stream = cupy.cuda.Stream(non_blocking=True)
    rows = []
    for nbytes in spec["sizes"]:
        count = nbytes // 4
        with client(spec, f"{spec['job']}-{nbytes}") as rank:
            (grad,) = rank.register([("g", count)], dtype="float32", op="sum",
                                    planner="wfbp", profile=False, device="cuda:0")
            for _ in range(3):  # warm-up: kernels, first contact
                rank.ready(0, stream=stream)
                rank.wait(stream=stream)
            stream.synchronize()
            repeats = iterations_for(nbytes)
            began = time.perf_counter()
            for _ in range(repeats):
                rank.ready(0, stream=stream)
                rank.wait(stream=stream)
            stream.synchronize()
            seconds = (time.perf_counter() - began) / repeats
            assert float(cupy.abs(grad).max()) == 0.0  # zeros stay zeros: nothing corrupted
        rows.append({"bytes": nbytes, "iterations": repeats, "seconds": seconds})
    return {"rank": spec["rank"], "rows": rows}


def raw_sweep(spec: dict[str, Any]) -> dict[str, Any]:
    from cupy.cuda import nccl

    id_path = Path(spec["id_file"])
    if spec["rank"] == 0:
        unique_id = nccl.get_unique_id()
        raw = bytes(unique_id) if isinstance(unique_id, bytes) else \
            bytes(v & 0xFF for v in unique_id)
        id_path.with_suffix(".tmp").write_bytes(raw)
        id_path.with_suffix(".tmp").rename(id_path)
    deadline = time.monotonic() + 60
    while not id_path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError("no NCCL unique id from rank 0")
        time.sleep(0.01)
    raw = id_path.read_bytes()
    unique_id: Any = raw if int(cupy.__version__.split(".")[0]) >= 14 else \
        tuple(b - 256 if b > 127 else b for b in raw)
    comm = nccl.NcclCommunicator(2, unique_id, spec["rank"])
    stream = cupy.cuda.Stream(non_blocking=True)
    rows = []
    for nbytes in spec["sizes"]:
        with stream:
            buffer = cupy.zeros(nbytes // 4, dtype=cupy.float32)
        ptr, count = buffer.data.ptr, buffer.size

        def once(ptr: int = ptr, count: int = count) -> None:
            comm.allReduce(ptr, ptr, count, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, stream.ptr)

        for _ in range(3):
            once()
        stream.synchronize()
        repeats = iterations_for(nbytes)
        began = time.perf_counter()
        for _ in range(repeats):
            once()
        stream.synchronize()
        rows.append({"bytes": nbytes, "iterations": repeats,
                     "seconds": (time.perf_counter() - began) / repeats})
        del buffer
    comm.destroy()
    return {"rank": spec["rank"], "rows": rows}


def local_sweep(spec: dict[str, Any]) -> dict[str, Any]:
    stream = cupy.cuda.Stream(non_blocking=True)
    rows = []
    for nbytes in spec["sizes"]:
        with stream:
            pair = [cupy.zeros(nbytes // 4, dtype=cupy.float32) for _ in range(2)]
            for _ in range(3):
                _local_once(pair)
            stream.synchronize()
            repeats = iterations_for(nbytes)
            began = time.perf_counter()
            for _ in range(repeats):
                _local_once(pair)
            stream.synchronize()
        rows.append({"bytes": nbytes, "iterations": repeats,
                     "seconds": (time.perf_counter() - began) / repeats})
        pair.clear()
    return {"rows": rows}


def _local_once(pair: list[Any]) -> None:
    """What the daemon's device does for 2 local ranks: sum into the first, copy back."""
    cuda_kernels.sum_into(cupy, pair[0], pair[1:], "float32")
    cuda_kernels.finish(cupy, pair[0], pair[1:], 1.0, "float32")


def latency(spec: dict[str, Any]) -> dict[str, Any]:
    stream = cupy.cuda.Stream(non_blocking=True)
    layers = [(f"l{i}", 256) for i in range(spec["layers"])]
    gap = spec["gap_us"] / 1e6
    result: dict[str, Any] = {"rank": spec["rank"]}
    with client(spec, spec["job"]) as rank:
        rank.register(layers, dtype="float32", op="sum", planner="wfbp", profile=False,
                      device="cuda:0")
        ready_calls = []
        for _ in range(spec["iterations"]):
            for index in reversed(range(len(layers))):
                if spec.get("sleep"):  # where cores are few: leave them to the daemon
                    time.sleep(gap)
                else:
                    until = time.perf_counter() + gap
                    while time.perf_counter() < until:
                        pass
                began = time.perf_counter()
                rank.ready(index, stream=stream)
                ready_calls.append(time.perf_counter() - began)
            rank.wait(stream=stream)
        stream.synchronize()
        ready_calls.sort()
        result["ready_call_p50_us"] = ready_calls[len(ready_calls) // 2] * 1e6
        if spec["rank"] == 0:
            time.sleep(0.2)  # the other rank's last notifications
            jobs = [j for j in query(spec["socket"])["jobs"] if j["job"] == spec["job"]]
            result["ready_to_launch"] = jobs[0]["ready_to_launch"] if jobs else None
    return result


MODES = {"daemon": daemon_sweep, "raw": raw_sweep, "local": local_sweep, "latency": latency}


def main() -> None:
    mode, spec = sys.argv[1], json.loads(sys.argv[2])
    cupy.cuda.Device(0).use()
    try:
        out = MODES[mode](spec)
    except Exception as exc:  # reported, not raised: the orchestrator shows it
        out = {"error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(out), flush=True)
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown with CUDA contexts alive


if __name__ == "__main__":
    main()
