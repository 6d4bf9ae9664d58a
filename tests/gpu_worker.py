"""One training rank on a GPU: device buffers through the node's daemon (CUDA IPC and events).

Writes integer-valued gradients on CUDA streams (alternating between ``streams`` of them, so
the event chain across streams is exercised), marks each layer ready on the stream that wrote
it, waits on the GPU, then checks every layer against the exact expected sum/avg and prints
one JSON line: the largest absolute and relative error per iteration, or the error it got.

Usage: python gpu_worker.py '<json spec>' (the keys of commd.testing.ranks' specs,
plus ``device``, ``streams`` and ``die_at``).
"""

from __future__ import annotations

import json
import os
import sys
import time

import cupy
import numpy as np

from commd.testing.rank_worker import client_for, reported


def value(rank: int, iteration: int, layer: int, size: int) -> np.ndarray:
    """Small integers: exact in every dtype, also after summing a few ranks (as
    commd.testing.ranks.value, without its pattern by rank)."""
    return (rank + 1) * (iteration + 1) + layer + (np.arange(size) % 5)


def expected(world: int, op: str, iteration: int, layer: int, size: int) -> np.ndarray:
    total = sum(value(r, iteration, layer, size).astype(np.float64) for r in range(world))
    return total / world if op == "avg" else total


def to_device(values: np.ndarray, dtype: str) -> cupy.ndarray:
    if dtype == "bfloat16":  # small integers are exact in bfloat16: keep the top 16 bits
        return cupy.asarray((values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16))
    return cupy.asarray(values.astype(dtype))


def to_float(array: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return (array.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return array.astype(np.float64)


def main() -> None:
    spec = json.loads(sys.argv[1])
    device = int(spec.get("device", "cuda:0").partition(":")[2] or 0)
    cupy.cuda.Device(device).use()
    dtype, op, world = spec["dtype"], spec["op"], spec["world_size"]
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(spec.get("streams", 1))]
    main_stream = streams[0]
    out: dict[str, object] = {"rank": spec["rank"], "errors": [], "relative": []}
    with reported(out), client_for(spec) as client:
        layers = [(name, size) for name, size in spec["layers"]]
        grads = client.register(layers, dtype=dtype, op=op, planner=spec.get("planner",
                                "wfbp"), device=f"cuda:{device}")
        began = time.perf_counter()
        for iteration in range(spec["iterations"]):
            if iteration == spec.get("die_at"):
                os._exit(17)  # vanish without goodbye, like a crashed trainer
            for position, index in enumerate(reversed(range(len(layers)))):
                stream = streams[position % len(streams)]
                with stream:
                    grads[index][...] = to_device(
                        value(spec["rank"], iteration, index, layers[index][1]), dtype)
                client.ready(index, stream=stream)
            client.wait(stream=main_stream)
            with main_stream:
                host = [cupy.asnumpy(g, stream=main_stream) for g in grads]
            main_stream.synchronize()
            worst = relative = 0.0
            for i, (h, (_, n)) in enumerate(zip(host, layers, strict=True)):
                want = expected(world, op, iteration, i, n)
                error = np.abs(to_float(h, dtype) - want)
                worst = max(worst, float(error.max()))
                relative = max(relative, float((error / np.maximum(np.abs(want), 1)).max()))
            out["errors"].append(worst)  # type: ignore[union-attr]
            out["relative"].append(relative)  # type: ignore[union-attr]
            ready = main_stream.record()
            for stream in streams[1:]:  # the next writes follow the reduced values
                stream.wait_event(ready)
        out["seconds"] = time.perf_counter() - began


if __name__ == "__main__":
    main()
