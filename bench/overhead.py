"""Overhead of going through commd vs one raw Gloo allreduce of the same bytes.

ResNet-50's 161 gradient tensors (25,557,032 float32 elements, ~102 MB) are all-reduced
through two real daemons (two ``commd run`` subprocesses on 127.0.0.1, one rank each,
op=sum) and compared with one ``ProcessGroupGloo.allreduce`` of one 25.6M-element float32
tensor between two plain processes (the group built directly on a TCPStore, no
init_process_group). Baseline and commd runs alternate within one command, because the
machine is shared and noisy; each pair is reported, plus the pooled ratio.

    .venv/bin/python bench/overhead.py                      # syncea, ready all at once
    .venv/bin/python bench/overhead.py --ready both --repeats 3
    .venv/bin/python bench/overhead.py --planner wfbp --json

Timed per iteration, in each client process: from just before ``ready()`` to the return of
``wait()``; in each baseline process: ``pg.allreduce([t]).wait()``. Medians, p10 and p90 are
over the measured iterations (after --warmup). This is a benchmark, not a timed test.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from types import FrameType, ModuleType
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
TARGET_RATIO = 1.10
WORLD = 2


# --- the layers ----------------------------------------------------------------------------------


def resnet50_layers() -> list[tuple[str, int]]:
    from commd.models.sizes import resnet50_layer_sizes

    layers = [(name, int(size)) for name, size in resnet50_layer_sizes()]
    assert len(layers) == 161 and sum(s for _, s in layers) == 25_557_032, "unexpected ResNet-50"
    return layers


# --- worker processes (this file, re-run with --worker) ------------------------------------------


def _raw_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One rank of the baseline: one Gloo allreduce of one tensor per iteration."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    timeout = timedelta(seconds=spec["timeout"])
    store = dist.TCPStore("127.0.0.1", spec["store_port"], None, False, timeout=timeout)
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    options._timeout = timeout
    group = dist.ProcessGroupGloo(
        dist.PrefixStore(spec["key"], store), spec["rank"], WORLD, options
    )
    tensor = torch.zeros(spec["numel"], dtype=torch.float32)  # zeros: sums stay finite
    times = []
    for _ in range(spec["warmup"] + spec["iterations"]):
        start = time.perf_counter()
        group.allreduce([tensor]).wait()
        times.append(time.perf_counter() - start)
    del group
    return {"rank": spec["rank"], "times": times[spec["warmup"]:]}


def _client_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One training rank: mark every layer ready (at once or one by one), then wait()."""
    from commd_client import Client

    layers = [(name, size) for name, size in spec["layers"]]
    everything = list(range(len(layers)))
    backward = everything[::-1]
    with Client(
        job=spec["job"], rank=spec["rank"], world_size=WORLD, local_rank=0, local_world_size=1,
        coordinator=spec["coordinator"], socket=spec["socket"], timeout=spec["timeout"],
    ) as client:
        client.register(layers, dtype="float32", op="sum", planner=spec["planner"])
        client.flat[:] = 0.0  # touch every page once; zeros keep the sums finite
        times, marking = [], []
        for _ in range(spec["warmup"] + spec["iterations"]):
            start = time.perf_counter()
            if spec["ready"] == "all":
                client.ready(everything)
            else:
                for index in backward:
                    client.ready(index)
            marked = time.perf_counter()
            client.wait()
            end = time.perf_counter()
            times.append(end - start)
            marking.append(marked - start)
        groups = len(client.groups)
    skip = spec["warmup"]
    return {"rank": spec["rank"], "times": times[skip:], "ready_s": marking[skip:],
            "groups": groups}


def worker_main(kind: str, spec_json: str) -> int:
    spec = json.loads(spec_json)
    result = _raw_worker(spec) if kind == "raw" else _client_worker(spec)
    print(json.dumps(result), flush=True)
    return 0


# --- orchestration -------------------------------------------------------------------------------


def _load_daemons_module() -> ModuleType:
    """tests/daemons.py, imported by path: the same starter the end-to-end tests use."""
    path = ROOT / "tests" / "daemons.py"
    spec = importlib.util.spec_from_file_location("_commd_test_daemons", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BenchError(RuntimeError):
    pass


class Harness:
    """Owns every process this benchmark starts; ``close()`` stops them all, in reverse."""

    def __init__(self, timeout: float, keep_logs: bool) -> None:
        self.timeout = timeout
        self.keep_logs = keep_logs
        self.workdir = Path(tempfile.mkdtemp(prefix="commd-bench-"))
        self._daemons_module = _load_daemons_module()
        self.segments_before: set[str] = self._daemons_module.commd_segments()
        self.daemons: list[Any] = []
        self.workers: list[subprocess.Popen[str]] = []
        self._store: Any = None
        self.failed = False

    # daemons
    def start_daemons(self) -> None:
        for index in range(WORLD):
            self.daemons.append(self._daemons_module.DaemonProcess(
                self.workdir, f"d{index}", "--backend", "gloo",
                "--timeout-s", str(self.timeout),
            ))

    # the baseline's store, hosted here so that neither worker is special
    def store_port(self) -> int:
        if self._store is None:
            from datetime import timedelta

            import torch.distributed as dist

            self._store = dist.TCPStore(
                "127.0.0.1", 0, None, True, wait_for_workers=False,
                timeout=timedelta(seconds=self.timeout),
            )
        return int(self._store.port)

    def run_workers(self, kind: str, specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        processes = []
        for spec in specs:
            process = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "--worker", kind,
                 json.dumps(spec)],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
            )
            processes.append(process)
            self.workers.append(process)
        results = []
        deadline = time.monotonic() + self.timeout + 60
        try:
            for process in processes:
                left = max(1.0, deadline - time.monotonic())
                stdout, stderr = process.communicate(timeout=left)
                lines = [line for line in stdout.splitlines() if line.startswith("{")]
                if process.returncode != 0 or not lines:
                    raise BenchError(
                        f"{kind} worker exited with {process.returncode}:\n{stderr[-3000:]}"
                    )
                results.append(json.loads(lines[-1]))
        except subprocess.TimeoutExpired:
            raise BenchError(f"{kind} workers did not finish within {self.timeout + 60:.0f}s")
        finally:
            self._reap(processes)
        return results

    def _reap(self, processes: list[subprocess.Popen[str]]) -> None:
        for process in processes:
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(5)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
            with contextlib.suppress(ValueError):
                self.workers.remove(process)

    def close(self) -> list[str]:
        """Stop workers, then daemons; return (and remove) any leaked /dev/shm segments."""
        self._reap(list(self.workers))
        for daemon in reversed(self.daemons):
            code = daemon.stop()
            if code not in (0, -signal.SIGTERM):
                self.failed = True
                print(f"daemon {daemon.socket} exited with {code}:\n{daemon.log()[-2000:]}",
                      file=sys.stderr)
        self.daemons.clear()
        self._store = None
        leaked = sorted(self._daemons_module.commd_segments() - self.segments_before)
        for name in leaked:
            Path("/dev/shm", name).unlink(missing_ok=True)
        if self.keep_logs or self.failed:
            print(f"daemon logs kept in {self.workdir}", file=sys.stderr)
        else:
            shutil.rmtree(self.workdir, ignore_errors=True)
        return leaked


def run_raw(harness: Harness, args: argparse.Namespace, numel: int) -> list[dict[str, Any]]:
    port = harness.store_port()
    key = f"raw-{uuid.uuid4().hex[:8]}"
    specs = [
        {"rank": rank, "store_port": port, "key": key, "numel": numel,
         "iterations": args.iterations, "warmup": args.warmup, "timeout": args.timeout}
        for rank in range(WORLD)
    ]
    return harness.run_workers("raw", specs)


def run_commd(
    harness: Harness, args: argparse.Namespace, layers: list[tuple[str, int]], ready: str
) -> list[dict[str, Any]]:
    job = f"bench-{ready}-{uuid.uuid4().hex[:8]}"
    coordinator = harness.daemons[0].address
    specs = [
        {"job": job, "rank": rank, "coordinator": coordinator,
         "socket": harness.daemons[rank].socket, "layers": layers, "planner": args.planner,
         "ready": ready, "iterations": args.iterations, "warmup": args.warmup,
         "timeout": args.timeout}
        for rank in range(WORLD)
    ]
    return harness.run_workers("client", specs)


# --- statistics and reporting --------------------------------------------------------------------


def stats(times: list[float]) -> dict[str, float]:
    values = np.asarray(times) * 1e3
    p10, p50, p90 = np.percentile(values, [10, 50, 90])
    return {"median_ms": float(p50), "p10_ms": float(p10), "p90_ms": float(p90),
            "min_ms": float(values.min()), "n": int(values.size)}


def summarise(runs: list[dict[str, Any]], modes: list[str]) -> dict[str, Any]:
    """Per repeat: each mode's median over its raw pair; pooled: over all repeats."""
    pairs = []
    for run in runs:
        raw = [stats(r["times"]) for r in run["raw"]]
        entry: dict[str, Any] = {"repeat": run["repeat"], "raw": raw, "commd": {}}
        for mode in modes:
            commd = [stats(r["times"]) for r in run["commd"][mode]]
            entry["commd"][mode] = {
                "ranks": commd,
                "ready_call_ms": stats(run["commd"][mode][0]["ready_s"])["median_ms"],
                "ratio": [c["median_ms"] / r["median_ms"] for c, r in zip(commd, raw, strict=True)],
                "groups": run["commd"][mode][0]["groups"],
            }
        pairs.append(entry)
    pooled: dict[str, Any] = {}
    raw_all = [t for run in runs for t in run["raw"][0]["times"]]
    pooled["raw"] = stats(raw_all)
    for mode in modes:
        commd_all = [t for run in runs for t in run["commd"][mode][0]["times"]]
        pooled[mode] = stats(commd_all)
        pooled[mode]["ratio"] = pooled[mode]["median_ms"] / pooled["raw"]["median_ms"]
    return {"pairs": pairs, "pooled_rank0": pooled}


def print_report(summary: dict[str, Any], args: argparse.Namespace, modes: list[str]) -> None:
    print(f"ResNet-50, 161 tensors, 25,557,032 float32 ({25_557_032 * 4 / 1e6:.1f} MB), "
          f"2 daemons x 1 rank, op=sum, planner={args.planner}, "
          f"{args.warmup} warm-up + {args.iterations} measured iterations")
    print("times in ms: median [p10, p90] on rank 0; rank 1's median after the slash")
    header = f"{'repeat':>6}  {'what':<16} {'median':>8} {'p10':>8} {'p90':>8} {'rank1':>8}  ratio"
    print(header)
    print("-" * len(header))
    for pair in summary["pairs"]:
        raw = pair["raw"]
        print(f"{pair['repeat']:>6}  {'raw gloo':<16} {raw[0]['median_ms']:8.2f} "
              f"{raw[0]['p10_ms']:8.2f} {raw[0]['p90_ms']:8.2f} {raw[1]['median_ms']:8.2f}")
        for mode in modes:
            entry = pair["commd"][mode]
            c = entry["ranks"]
            what = f"commd ready={mode}"
            print(f"{'':>6}  {what:<16} {c[0]['median_ms']:8.2f} {c[0]['p10_ms']:8.2f} "
                  f"{c[0]['p90_ms']:8.2f} {c[1]['median_ms']:8.2f}  "
                  f"{entry['ratio'][0]:.3f} / {entry['ratio'][1]:.3f}"
                  f"   ({entry['groups']} groups, ready() {entry['ready_call_ms']:.2f} ms)")
    pooled = summary["pooled_rank0"]
    print("-" * len(header))
    raw = pooled["raw"]
    print(f"{'all':>6}  {'raw gloo':<16} {raw['median_ms']:8.2f} {raw['p10_ms']:8.2f} "
          f"{raw['p90_ms']:8.2f}")
    for mode in modes:
        c = pooled[mode]
        verdict = "ok" if c["ratio"] <= TARGET_RATIO else f"ABOVE target {TARGET_RATIO:.2f}"
        print(f"{'':>6}  {'commd ready=' + mode:<16} {c['median_ms']:8.2f} {c['p10_ms']:8.2f} "
              f"{c['p90_ms']:8.2f}           {c['ratio']:.3f}  {verdict}")


def machine() -> dict[str, Any]:
    import torch

    return {"cpus": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "platform": platform.platform(),
            "loadavg_at_start": list(os.getloadavg())}


# --- main ----------------------------------------------------------------------------------------


def _raise_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=30, help="measured iterations")
    parser.add_argument("--warmup", type=int, default=5, help="warm-up iterations, not timed")
    parser.add_argument("--repeats", type=int, default=3, help="baseline/commd pairs to run")
    parser.add_argument("--planner", default="syncea",
                        help="merge planner for the job (syncea, wfbp, optimal, mgwfbp, ...)")
    parser.add_argument("--ready", choices=("all", "each", "both"), default="all",
                        help="mark all 161 layers in one ready() call, one call per layer "
                             "(backward order), or measure both")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds before a hang becomes an error")
    parser.add_argument("--json", action="store_true", help="print results as JSON")
    parser.add_argument("--keep-logs", action="store_true", help="keep the daemons' logs")
    parser.add_argument("--worker", nargs=2, metavar=("KIND", "SPEC"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.iterations < 1 or args.warmup < 0 or args.repeats < 1:
        parser.error("--iterations and --repeats must be >= 1, --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(*args.worker)
    layers = resnet50_layers()
    numel = sum(size for _, size in layers)
    modes = ["all", "each"] if args.ready == "both" else [args.ready]
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    harness = Harness(args.timeout, args.keep_logs)
    runs: list[dict[str, Any]] = []
    info = machine()
    try:
        harness.start_daemons()
        for repeat in range(args.repeats):
            run: dict[str, Any] = {"repeat": repeat + 1, "commd": {}}
            # Alternate the order so that drift on a shared machine does not favour one side.
            order = ["raw", *modes] if repeat % 2 == 0 else [*modes, "raw"]
            for what in order:
                if what == "raw":
                    run["raw"] = run_raw(harness, args, numel)
                else:
                    run["commd"][what] = run_commd(harness, args, layers, what)
                if not args.json:
                    print(f"  repeat {repeat + 1}: {what} done", file=sys.stderr, flush=True)
            runs.append(run)
    except BenchError as exc:
        harness.failed = True
        print(f"overhead benchmark failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        harness.failed = True
        print("interrupted; stopping everything", file=sys.stderr)
        return 130
    finally:
        leaked = harness.close()
        if leaked:
            print(f"removed leaked shared-memory segments: {leaked}", file=sys.stderr)
    summary = summarise(runs, modes)
    info["loadavg_at_end"] = list(os.getloadavg())
    if args.json:
        print(json.dumps({
            "benchmark": "overhead", "model": "resnet50", "layers": len(layers), "elements": numel,
            "dtype": "float32", "op": "sum", "planner": args.planner, "ready": modes,
            "iterations": args.iterations, "warmup": args.warmup, "target_ratio": TARGET_RATIO,
            "machine": info, "summary": summary,
            "raw_times_s": [run["raw"] for run in runs],
            "commd_times_s": [run["commd"] for run in runs],
        }, indent=1))
    else:
        print_report(summary, args, modes)
        print(f"machine: {info['cpus']} CPUs, torch {info['torch']}, Python {info['python']}, "
              f"load average {info['loadavg_at_start'][0]:.2f} at start, "
              f"{info['loadavg_at_end'][0]:.2f} at end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
