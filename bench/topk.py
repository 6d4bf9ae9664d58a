"""The compressed path of one group, new kernels against the previous code, in dense passes.

For each size and ratio, one run times, in interleaved repeats (so that the load of a shared
machine hits every case alike), medians over the repeats:

* ``pass``: one dense memory pass over the same buffer, ``np.multiply(buf, 1.0, out=buf)``
  (reads and writes every element once, in place);
* ``new allreduce``: add_and_select (E = S + R, zeroing the sum's buffer, and the top-k of E
  with a TopkScratch, as exchange.py runs them: in one pass where the compiled loops are
  built), take_and_clear (into a preallocated values buffer), put (the k values into the
  zeroed buffer);
* ``new allgather``: the same up to take_and_clear, then accumulate_pairs of 3 nodes' blocks
  (values and int32 indices: what float64 groups send);
* ``new compact``: the allgather of float32 groups (wire.py): add_and_select, pack_take
  (take, round to bfloat16, keep the remainder, write the node's buffer), unpack_add of 3
  nodes' buffers (decoded as they are added);
* ``numpy allreduce`` / ``numpy allgather`` / ``numpy compact``: the new paths on numpy's
  loops (as where the compiled ones are not built, or with COMMD_NATIVE=0);
* ``old allreduce`` / ``old allgather``: np.add, select_topk_reference, the previous
  exchange.py ``_take`` (gather, np.dot energy, clear) and ``_scatter`` (zero, set) /
  zero and np.add.at.

The allgather's other two nodes' blocks are prepared once, untimed; copying this node's own
block into the receive buffers is timed in every path. Before every timed call the residual
and the gradient are restored from copies (untimed). The first repeat checks that new, numpy
and old agree exactly (the compact wire rounds: new and numpy agree, old is its time only).

    .venv/bin/python bench/topk.py
    .venv/bin/python bench/topk.py --elements 2555623 --ratios 0.01 --repeats 15
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from commd.compression import kernels, native, wire
from commd.compression.fused import add_and_select
from commd.compression.kernels import (
    WORKERS,
    accumulate_pairs,
    put,
    take_and_clear,
)
from commd.compression.topk import TopkScratch, select_topk, select_topk_reference
from commd.testing.results import add_results_option, write_results
from commd.testing.tables import markdown_table

NODES = 3  # the allgather rows: this node plus two others


@dataclass
class Case:
    """One size and ratio: the buffers every path works on."""

    gradient: np.ndarray  # S, this node's summed gradient (restored before each call)
    start: np.ndarray  # R at the start of the iteration (restored before each call)
    residual: np.ndarray
    target: np.ndarray
    k: int
    scratch: TopkScratch
    values: np.ndarray  # k values out of take_and_clear
    all_indices: np.ndarray  # the allgather's receive buffers, others' blocks filled in
    all_values: np.ndarray
    packed: np.ndarray  # the compact allgather's receive buffer, others' buffers filled in


def make_case(elements: int, ratio: float, seed: int) -> Case:
    rng = np.random.default_rng(seed)
    k = max(1, int(ratio * elements))
    gradient = rng.standard_normal(elements, dtype=np.float32)
    start = (rng.standard_normal(elements, dtype=np.float32) * 0.5).astype(np.float32)
    all_indices = np.empty(NODES * k, np.int32)
    all_values = np.empty(NODES * k, np.float32)
    per = wire.packed_bytes(elements, k)
    packed = np.zeros(NODES * per, np.uint8)
    for node in range(1, NODES):  # the others' top-k: k ascending unique indices each
        other = rng.standard_normal(elements, dtype=np.float32)
        chosen = select_topk(other, k)
        all_indices[node * k:(node + 1) * k] = chosen
        all_values[node * k:(node + 1) * k] = other[chosen]
        wire.pack_take(other, chosen, packed[node * per:(node + 1) * per])
    return Case(gradient, start, start.copy(), gradient.copy(), k,
                TopkScratch(elements, np.float32), np.empty(k, np.float32), all_indices,
                all_values, packed)


def restore(case: Case) -> None:
    np.copyto(case.residual, case.start)
    np.copyto(case.target, case.gradient)


def one_pass(case: Case) -> None:
    np.multiply(case.target, 1.0, out=case.target)


def new_selection(case: Case) -> tuple[np.ndarray, np.ndarray]:
    energy, indices, _select_s = add_and_select(case.residual, case.target, case.k,
                                                case.scratch, clear=True)  # as exchange.py
    values, sent = take_and_clear(case.residual, indices, case.values)
    _gain = 1.0 if energy == 0 else sent / energy
    return indices, values


def new_allreduce(case: Case) -> None:
    indices, values = new_selection(case)
    put(case.target, indices, values)


def new_allgather(case: Case) -> None:
    indices, values = new_selection(case)
    case.all_indices[:case.k] = indices
    case.all_values[:case.k] = values
    accumulate_pairs(case.target, case.all_indices, case.all_values, zeroed=True)


def new_compact(case: Case) -> None:
    _energy, indices, _select_s = add_and_select(case.residual, case.target, case.k,
                                                 case.scratch, clear=True)
    elements = case.residual.size
    wire.pack_take(case.residual, indices, case.packed[:wire.packed_bytes(elements, case.k)])
    wire.unpack_add(case.target, case.packed, NODES, case.k, zeroed=True)


def old_selection(case: Case) -> tuple[np.ndarray, np.ndarray]:
    residual = case.residual
    np.add(residual, case.target, residual)
    indices = select_topk_reference(residual, case.k)
    values = residual[indices]  # the previous exchange._take
    total = float(np.dot(residual, residual))
    _gain = 1.0 if total == 0 else float(np.dot(values, values)) / total
    residual[indices] = 0
    return indices, values


def old_allreduce(case: Case) -> None:
    indices, values = old_selection(case)
    case.target[...] = 0  # the previous exchange._scatter
    case.target[indices] = values


def old_allgather(case: Case) -> None:
    indices, values = old_selection(case)
    case.all_indices[:case.k] = indices
    case.all_values[:case.k] = values
    case.target[...] = 0  # the previous topk.accumulate_pairs
    np.add.at(case.target, case.all_indices.astype(np.intp), case.all_values)


def on_numpy(path: Callable[[Case], None]) -> Callable[[Case], None]:
    """``path`` with numpy's loops, compiled ones built or not."""
    def run(case: Case) -> None:
        was, native.enabled = native.enabled, False
        try:
            path(case)
        finally:
            native.enabled = was
    return run


PATHS: dict[str, Callable[[Case], None]] = {
    "pass": one_pass,
    "new allreduce": new_allreduce,
    "new allgather": new_allgather,
    "numpy allreduce": on_numpy(new_allreduce),
    "numpy allgather": on_numpy(new_allgather),
    "new compact": new_compact,
    "numpy compact": on_numpy(new_compact),
    "old allreduce": old_allreduce,
    "old allgather": old_allgather,
}


def check(case: Case) -> None:
    """New and old agree exactly on the result and the residual."""
    results = {}
    for name, path in PATHS.items():
        restore(case)
        path(case)
        results[name] = (case.target.copy(), case.residual.copy())
    for exchange in ("allreduce", "allgather"):
        for kind in ("new", "numpy"):
            for new, old in zip(results[f"{kind} {exchange}"], results[f"old {exchange}"],
                                strict=True):
                np.testing.assert_array_equal(new, old)
    for new, numpy in zip(results["new compact"], results["numpy compact"], strict=True):
        np.testing.assert_array_equal(new, numpy)


def measure(case: Case, repeats: int) -> dict[str, list[float]]:
    check(case)
    for path in PATHS.values():  # warm up: the scratch grows, the pool starts
        restore(case)
        path(case)
    times: dict[str, list[float]] = {name: [] for name in PATHS}
    for _ in range(repeats):
        for name, path in PATHS.items():
            restore(case)
            began = time.perf_counter()
            path(case)
            times[name].append(time.perf_counter() - began)
    return times


def spread(samples: list[float]) -> float:
    """Half the interquartile range over the median: the noise of one row."""
    if len(samples) < 4:
        return float("nan")
    quartiles = statistics.quantiles(samples, n=4)
    return (quartiles[2] - quartiles[0]) / 2 / statistics.median(samples)


def summary(rows: list[tuple[int, float, dict[str, list[float]]]]) -> list[dict[str, Any]]:
    """Per buffer size, ratio and exchange: the medians in ms of one dense pass and of the new
    path, the new path on numpy and the previous code, with the noise of each."""
    out = []
    for elements, ratio, times in rows:
        # (row name, the paths' name, the previous code's name)
        for label, exchange, before in (("allreduce", "allreduce", "allreduce"),
                                        ("allgather", "allgather", "allgather"),
                                        ("allgather, compact", "compact", "allgather")):
            names = {"pass": "pass", "new": f"new {exchange}", "numpy": f"numpy {exchange}",
                     "old": f"old {before}"}
            out.append({"elements": elements, "ratio": ratio, "exchange": label,
                        **{f"{kind}_ms": statistics.median(times[name]) * 1e3
                           for kind, name in names.items()},
                        "noise": {kind: spread(times[name]) for kind, name in names.items()}})
    return out


def table(results: dict[str, Any]) -> str:
    cells = []
    for row in results["rows"]:
        dense = row["pass_ms"]
        cells.append([
            f"{row['elements']:,}", f"{row['ratio']:g}", row["exchange"], f"{dense:.1f}",
            *(f"{row[f'{kind}_ms']:.1f} ({row[f'{kind}_ms'] / dense:.1f})"
              for kind in ("new", "numpy", "old")),
            f"{row['old_ms'] / row['new_ms']:.1f}×",
            " / ".join(f"±{row['noise'][kind]:.0%}" for kind in ("pass", "new", "numpy", "old"))])
    return markdown_table(["elements", "ratio", "exchange", "one pass ms", "new ms (passes)",
                           "new on numpy ms (passes)", "old ms (passes)", "speed-up",
                           "noise pass / new / numpy / old"], cells, "rrlrrrrrl")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Time the compressed path of one group (new kernels vs the previous code) "
                    "in units of one dense memory pass over the same buffer.")
    parser.add_argument("--elements", default="2555623,25557032",
                        help="comma-separated float32 buffer sizes (default: ResNet-50/10 and "
                             "ResNet-50)")
    parser.add_argument("--ratios", default="0.1,0.01,0.001",
                        help="comma-separated k / elements ratios")
    parser.add_argument("--repeats", type=int, default=7,
                        help="interleaved timed repeats per case (medians are reported)")
    parser.add_argument("--seed", type=int, default=0)
    add_results_option(parser, "topk")
    parser.add_argument("--parallel-min", type=int, default=None,
                        help="split kernels over the pool from this many elements (default: "
                             "kernels.PARALLEL_MIN, off on 2 cores)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = [int(text) for text in args.elements.split(",")]
    ratios = [float(text) for text in args.ratios.split(",")]
    if args.repeats < 1 or any(s < 1 for s in sizes) or any(not 0 < r <= 1 for r in ratios):
        print("--repeats and --elements must be >= 1, --ratios in (0, 1]", file=sys.stderr)
        return 2
    if args.parallel_min is not None:
        kernels.PARALLEL_MIN = args.parallel_min
    threshold = kernels.PARALLEL_MIN
    split = (f"split from {threshold:,} elements over {WORKERS} threads"
             if threshold < sys.maxsize else "no split")
    print(f"# {datetime.date.today()} · {platform.machine()} · {os.cpu_count()} CPUs · "
          f"kernels: {split} · loops: {native.describe()} · numpy {np.__version__}")
    print(f"# {' '.join(sys.argv)}\n")
    rows = []
    for elements in sizes:
        for ratio in ratios:
            case = make_case(elements, ratio, args.seed)
            rows.append((elements, ratio, measure(case, args.repeats)))
            del case
    results = {"kernels_split": split, "loops": native.describe(), "numpy": np.__version__,
               "repeats": args.repeats, "seed": args.seed, "rows": summary(rows)}
    write_results("topk", results, args.results)
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
