"""One training rank of a ``commd.testing.ranks`` job: fills integer-valued gradients
(``commd.testing.ranks.value``), reduces them through the node's daemon, and prints what it
got back as one JSON line.

    python -m commd.testing.rank_worker '<json spec>'

Other workers that run as ranks build on its pieces (``client_for``, ``reported``). It is a
client, the one part of ``commd`` that imports ``commd_client``: it runs as a rank, in a
process of its own, and nothing in ``commd`` imports it."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from commd.cli.status import query
from commd.testing.ranks import numel, value
from commd_client import Client, CommdError


def to_float(array: np.ndarray, dtype: str) -> list[float]:
    if dtype == "bfloat16":  # raw words → float32
        array = (array.astype(np.uint32) << 16).view(np.float32)
    floats: list[float] = array.astype(np.float64).tolist()
    return floats


def from_float(values: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return values


def await_others(spec: dict[str, Any], iteration: int) -> None:
    """With ``progress_dir``: until every other rank has finished ``iteration``, so that a rank
    that then dies fails the others' next iteration, whatever the machine's load (a node's
    iteration may otherwise still be finishing when the failure reaches it)."""
    folder = spec.get("progress_dir")
    if not folder or iteration < 0:
        return
    others = [r for r in range(spec["world_size"]) if r != spec["rank"]]
    deadline = time.monotonic() + spec["timeout"]
    while not all(Path(folder, f"{r}.{iteration}").exists() for r in others):
        if time.monotonic() > deadline:
            raise SystemExit(f"rank {spec['rank']}: the others never finished {iteration}")
        time.sleep(0.01)  # polling a condition, with a deadline


_IDENTITY = ("job", "rank", "world_size", "local_rank", "local_world_size", "coordinator",
             "socket", "timeout")


def client_for(spec: dict[str, Any], **options: Any) -> Client:
    """A client with the spec's identity and timeout; ``options`` add to or replace them."""
    given = {key: spec[key] for key in _IDENTITY if key not in options}
    return Client(**given, **options)


@contextmanager
def reported(out: dict[str, Any]) -> Iterator[None]:
    """Print ``out`` as the last JSON line, with the error where a CommdError ended the body
    (the first one recorded stays: one raised on closing does not replace it; any other
    exception propagates, printing nothing)."""
    try:
        yield
    except CommdError as exc:
        if "error" not in out:
            record_error(out, exc)
    print(json.dumps(out), flush=True)


def record_error(out: dict[str, Any], exc: CommdError) -> None:
    """The error's message, type and code in ``out``."""
    out["error"] = str(exc)
    out["error_type"] = type(exc).__name__
    out["code"] = str(exc.code)


def hold_until_the_others_failed(spec: dict[str, Any]) -> None:
    """With ``failed_dir`` and ``hold_for``: stay connected (and alive) until every rank of
    ``hold_for`` has failed too, so that this rank's own timeout or exit never becomes the
    others' error: each must meet its own timeout, whatever the machine's load."""
    folder = spec.get("failed_dir")
    if not folder:
        return
    Path(folder, str(spec["rank"])).touch()
    deadline = time.monotonic() + spec["timeout"]
    while not all(Path(folder, str(r)).exists() for r in spec["hold_for"]):
        if time.monotonic() > deadline:
            return  # the result is printed; the test judges the others'
        time.sleep(0.01)  # polling a condition, with a deadline


def train(client: Client, spec: dict[str, Any], out: dict[str, Any]) -> None:
    sleeps = spec.get("backward_sleep_s")  # replay a profile: sleep before each layer's ready
    # a layer is (name, size) or (name, shape): a JSON list, registered as a tuple
    layers = [(name, tuple(size) if isinstance(size, list) else size)
              for name, size in spec["layers"]]
    sizes = [numel(size) for _, size in spec["layers"]]
    grads = client.register(
        layers, dtype=spec["dtype"], op=spec["op"], planner=spec.get("planner", "wfbp"),
        compression=spec.get("compression", "none"),
    )
    print(json.dumps({"registered": True, "groups": client.groups,
                      "nodes": client.nodes}), flush=True)
    for iteration in range(spec["iterations"]):
        if iteration == spec.get("die_at"):
            await_others(spec, iteration - 1)
            os._exit(17)  # vanish without goodbye, like a crashed trainer
        for index, size in enumerate(sizes):
            grads[index][:] = from_float(
                value(spec["rank"], iteration, index, size), spec["dtype"]
            )
        for index in reversed(range(len(layers))):
            if sleeps:
                time.sleep(sleeps[index])
            client.ready(index)
        client.wait()
        out["plans"].append(client.plan_version)
        out["dense"].append(client.ran_dense)
        if not spec.get("skip_results"):
            out["iterations"].append(
                [to_float(g, spec["dtype"]) for g in grads]
            )
        if spec.get("progress_dir"):  # tell a rank that waits in await_others
            Path(spec["progress_dir"], f"{spec['rank']}.{iteration}").touch()
    if spec.get("status_at_end"):  # the job as the daemon shows it, still running
        out["status"] = next(j for j in query(spec["socket"])["jobs"]
                             if j["job"] == spec["job"])


def main() -> None:
    spec = json.loads(sys.argv[1])
    out: dict[str, Any] = {"rank": spec["rank"], "iterations": [], "plans": [], "dense": []}
    # an error before the job formed (nothing to hold) or on closing is reported's to record
    with reported(out), client_for(spec) as client:
        try:
            train(client, spec, out)
        except CommdError as exc:
            record_error(out, exc)
            hold_until_the_others_failed(spec)


if __name__ == "__main__":
    main()
