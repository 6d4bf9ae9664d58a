"""Overhead of going through commd vs one raw Gloo allreduce of the same bytes.

ResNet-50's 161 gradient tensors (25,557,032 float32 elements, 102.2 MB; ``--model deep_mlp``:
bench/ddp_compare.py's 96 tensors, 12.8 MB) are all-reduced
through two real daemons (two ``commd run`` subprocesses on 127.0.0.1, random peer ports,
one rank each, op=sum) and compared with one ``ProcessGroupGloo.allreduce`` of one
25.6M-element float32 tensor between two plain processes (the group built directly on a
TCPStore, no init_process_group).

The machine this runs on is shared and noisy, so baseline and commd are interleaved
iteration by iteration: all worker processes stay up, and this process tells one pair at a
time to run one iteration (raw, commd, raw, commd, ...), both ranks of a pair at the same
moment. Every repeat starts fresh workers and a fresh job; each repeat's ratio is reported,
plus the ratio over all repeats pooled.

    .venv/bin/python bench/overhead.py                      # syncea, all layers ready at once
    .venv/bin/python bench/overhead.py --ready both         # also one ready() per layer
    .venv/bin/python bench/overhead.py --planner wfbp --json
    .venv/bin/python bench/overhead.py --metrics            # daemons serve /metrics, scraped 1/s
    .venv/bin/python bench/overhead.py --metrics --scrape-rate 200 --model deep_mlp

With ``--scrape-rate R`` the same commd job runs every iteration twice over, once quiet and once
while a scraper process GETs each daemon's /metrics R times a second (a fresh connection
each, as Prometheus does), interleaved like raw and commd; the headline is then the scraped
median over the quiet median (target: at most 5 % slower).

Timed per iteration, in each client process: from just before ``ready()`` to the return of
``wait()``; in each baseline process: ``pg.allreduce([t]).wait()``. Medians, p10 and p90 are
over the measured iterations (after --warmup); the headline ratio is rank 0's commd median
over rank 0's raw median. This is a benchmark, not a timed test.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import signal
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path
from types import FrameType
from typing import IO, Any

import numpy as np

from commd.cli.tables import markdown_table
from commd.testing.harness import DaemonHarness, JsonLineWorker, WorkerError
from commd.testing.results import add_results_option, write_results

ROOT = Path(__file__).resolve().parents[1]
TARGET_RATIO = 1.10
TARGET_SCRAPED = 1.05  # --scrape-rate: the job under a scraper vs the same job quiet
SCRAPED = "+scraped"  # the suffix of a mode's variant that runs under the scraper
WORLD = 2
JOB_PREFIX = "bench-overhead-"  # client segments are /dev/shm/commd-<job>-r<rank>-<hex>


# --- the layers ----------------------------------------------------------------------------------


def resnet50_layers() -> list[tuple[str, int]]:
    from commd.models.sizes import resnet50_layer_sizes

    layers = [(name, int(size)) for name, size in resnet50_layer_sizes()]
    assert len(layers) == 161 and sum(s for _, s in layers) == 25_557_032, "unexpected ResNet-50"
    return layers


def deep_mlp_layers() -> list[tuple[str, int]]:
    """bench/ddp_compare.py's deep_mlp in backward order: 48 x (bias 256, weight 65,536)."""
    layers = []
    for index in reversed(range(48)):
        layers += [(f"{index}.bias", 256), (f"{index}.weight", 256 * 256)]
    return layers


MODELS = {"resnet50": resnet50_layers, "deep_mlp": deep_mlp_layers}


# --- worker processes: this file, re-run with --worker; one line of JSON per command ------------


def _say(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _serve_commands(step: Any) -> None:
    """Run ``step()`` once per "go" line on stdin and report its result; stop at "stop"/EOF."""
    for line in sys.stdin:
        if line.strip() != "go":
            break
        _say(step())


def _raw_worker(spec: dict[str, Any]) -> None:
    """One rank of the baseline: one Gloo allreduce of one tensor per command."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    timeout = timedelta(seconds=spec["timeout"])
    store = dist.TCPStore("127.0.0.1", spec["store_port"], None, False, timeout=timeout)
    gloo: Any = dist.ProcessGroupGloo  # private options API, as design.md shows
    options = gloo._Options()
    options._devices = [gloo.create_device(hostname="127.0.0.1")]
    options._timeout = timeout
    group: Any = gloo(dist.PrefixStore(spec["key"], store), spec["rank"], WORLD, options)
    tensor = torch.zeros(spec["numel"], dtype=torch.float32)  # zeros: sums stay finite
    _say({"ready": True})

    def step() -> dict[str, Any]:
        start = time.perf_counter()
        group.allreduce([tensor]).wait()
        return {"t": time.perf_counter() - start}

    _serve_commands(step)


def _client_worker(spec: dict[str, Any]) -> None:
    """One training rank: mark every layer ready (at once or one by one), then wait()."""
    from commd_client import Client

    layers = [(name, size) for name, size in spec["layers"]]
    everything = list(range(len(layers)))
    backward = everything[::-1]
    with Client(
        job=spec["job"], rank=spec["rank"], world_size=WORLD, local_rank=0, local_world_size=1,
        coordinator=spec["coordinator"], socket=spec["socket"], timeout=spec["timeout"],
    ) as client:
        client.register(layers, dtype="float32", op="sum", planner=spec["planner"],
                        compression="none")
        client.flat[:] = 0.0  # touch every page once; zeros keep the sums finite
        _say({"ready": True, "groups": len(client.groups), "planner": client.planner})

        def step() -> dict[str, Any]:
            start = time.perf_counter()
            if spec["ready"] == "all":
                client.ready(everything)
            else:
                for index in backward:
                    client.ready(index)
            marked = time.perf_counter()
            client.wait()
            return {"t": time.perf_counter() - start, "ready_s": marked - start}

        _serve_commands(step)


def _scrape_once(host: str, port: int, timeout: float) -> bool:
    """One GET /metrics on a fresh connection, read to the server's close; True on a 200."""
    import socket

    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: bench\r\nAccept: */*\r\n\r\n")
        got = bytearray()
        while chunk := sock.recv(1 << 16):
            got += chunk
    return got.startswith(b"HTTP/1.1 200") or got.startswith(b"HTTP/1.0 200")


def _scraper_worker(spec: dict[str, Any]) -> None:
    """Scrapes every daemon ``spec["rate"]`` times a second between an "on" and an "off"
    line (on a thread, so that "off" is heard); "off" answers with the counts."""
    targets = [(host, int(port)) for host, port in spec["targets"]]
    period = 1.0 / spec["rate"]
    stop = threading.Event()
    counts = {"scrapes": 0, "failed": 0, "seconds": 0.0}

    def scrape() -> None:
        start = next_at = time.monotonic()
        while not stop.is_set():
            for host, port in targets:
                try:
                    ok = _scrape_once(host, port, spec["timeout"])
                except OSError:
                    ok = False
                counts["scrapes" if ok else "failed"] += 1
            next_at += period  # a fixed schedule: a slow scrape does not lower the rate
            stop.wait(max(0.0, next_at - time.monotonic()))
        counts["seconds"] += time.monotonic() - start

    thread: threading.Thread | None = None
    _say({"ready": True})
    for line in sys.stdin:
        command = line.strip()
        if command == "on" and thread is None:
            stop.clear()
            thread = threading.Thread(target=scrape, name="scraper")
            thread.start()
            _say({"on": True})
        elif command == "off" and thread is not None:
            stop.set()
            thread.join()
            thread = None
            _say(dict(counts))
        else:
            break


WORKERS = {"raw": _raw_worker, "client": _client_worker, "scraper": _scraper_worker}


def worker_main(kind: str, spec_json: str) -> int:
    spec = json.loads(spec_json)
    with contextlib.suppress(BrokenPipeError, KeyboardInterrupt):
        WORKERS[kind](spec)
    return 0


# --- orchestration -------------------------------------------------------------------------------


class BenchError(RuntimeError):
    pass


def start_worker(kind: str, spec: dict[str, Any], errors: IO[bytes]) -> JsonLineWorker:
    """A worker subprocess driven by lines on stdin, answering with JSON lines on stdout."""
    return JsonLineWorker(
        f"{kind} worker rank {spec['rank']}",
        [sys.executable, str(Path(__file__).resolve()), "--worker", kind, json.dumps(spec)],
        errors, cwd=ROOT)


class Harness(DaemonHarness):
    """Owns everything this benchmark starts; ``close()`` stops it all, in reverse order."""

    def __init__(self, timeout: float, keep_logs: bool, metrics: bool = False,
                 scrape_rate: float = 0.0) -> None:
        super().__init__("commd-bench-overhead-", keep_logs)
        self.timeout = timeout
        self.metrics = metrics  # --metrics: the daemons serve /metrics, scraped every second
        self.scrape_rate = scrape_rate  # --scrape-rate: a scraper process, on per iteration
        self.scraper: JsonLineWorker | None = None
        self.scraped = {"scrapes": 0, "failed": 0, "seconds": 0.0}  # its counts, last "off"
        self._scraper: threading.Thread | None = None
        self._scraping = threading.Event()
        self.scrapes = 0
        self.workers: list[JsonLineWorker] = []
        self._store: Any = None

    def start_daemons(self) -> None:
        for index in range(WORLD):
            try:
                self.start_daemon(f"d{index}", "--backend", "gloo", "--timeout-s",
                                  str(self.timeout),
                                  *(("--metrics-listen", "127.0.0.1:0") if self.metrics else ()))
            except RuntimeError as exc:  # "daemon did not become ready", with its log
                raise BenchError(str(exc)) from None
        if self.metrics:
            urls = []
            for daemon in self.daemons:  # port 0: the READY status line names the port
                notes = " ".join(daemon.notifications)
                match = re.search(r"metrics on (\S+:\d+)", notes)
                if match is None:
                    raise BenchError(f"daemon {daemon.name} serves no metrics: {notes!r}")
                urls.append(f"http://{match.group(1)}/metrics")
            if self.scrape_rate:
                self._start_scraper([url.split("/")[2].rsplit(":", 1) for url in urls])
                return
            self._scraper = threading.Thread(target=self._scrape, args=(urls,),
                                             name="bench-scraper", daemon=True)
            self._scraper.start()

    def _start_scraper(self, targets: list[list[str]]) -> None:
        """The --scrape-rate scraper: a process of its own, so that neither its CPU nor its
        GIL is this process's (which paces the ranks)."""
        path = self.workdir / "scraper.err"
        with open(path, "wb") as errors:
            self.scraper = start_worker("scraper", {"rank": 0, "targets": targets,
                                                    "rate": self.scrape_rate,
                                                    "timeout": self.timeout}, errors)
        self.scraper.receive(time.monotonic() + self.timeout)

    def scraping(self, on: bool) -> None:
        """Turn the scraper on (it is scraping when this returns) or off (it has stopped)."""
        assert self.scraper is not None
        self.scraper.send("on" if on else "off")
        answer = self.scraper.receive(time.monotonic() + self.timeout)
        if not on:
            self.scraped = {key: answer[key] for key in self.scraped}

    def _scrape(self, urls: list[str]) -> None:
        """Every second, GET each daemon's /metrics, like a Prometheus server with a 1 s
        scrape interval (its default is 15 s)."""
        while not self._scraping.wait(1.0):
            for url in urls:
                with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=5) as got:
                    got.read()
                    self.scrapes += 1

    def _store_port(self) -> int:
        """The baseline's TCPStore, hosted here so that neither baseline worker is special."""
        if self._store is None:
            from datetime import timedelta

            import torch.distributed as dist

            self._store = dist.TCPStore(
                "127.0.0.1", 0, None, True, wait_for_workers=False,
                timeout=timedelta(seconds=self.timeout),
            )
        return int(self._store.port)

    def _start_pair(self, kind: str, specs: list[dict[str, Any]]) -> list[JsonLineWorker]:
        pair = []
        for spec in specs:
            path = self.workdir / f"{kind}-{spec['rank']}-{uuid.uuid4().hex[:6]}.err"
            errors = open(path, "wb")  # noqa: SIM115 - closed below, once the child has it
            worker = start_worker(kind, spec, errors)
            errors.close()  # the child holds its own descriptor
            self.workers.append(worker)
            pair.append(worker)
        return pair

    def raw_pair(self, numel: int) -> list[JsonLineWorker]:
        port, key = self._store_port(), f"raw-{uuid.uuid4().hex[:8]}"
        return self._start_pair("raw", [
            {"rank": rank, "store_port": port, "key": key, "numel": numel,
             "timeout": self.timeout} for rank in range(WORLD)
        ])

    def commd_pair(self, layers: list[tuple[str, int]], planner: str, ready: str
                   ) -> list[JsonLineWorker]:
        job = f"{JOB_PREFIX}{ready}-{uuid.uuid4().hex[:8]}"
        self.jobs.append(job)
        return self._start_pair("client", [
            {"job": job, "rank": rank, "coordinator": self.daemons[0].address,
             "socket": self.daemons[rank].socket, "layers": layers, "planner": planner,
             "ready": ready, "timeout": self.timeout} for rank in range(WORLD)
        ])

    def stop_workers(self) -> None:
        for worker in reversed(self.workers):
            # EOF: the worker leaves its loop and closes cleanly; SIGTERM after 10 s,
            # SIGKILL 5 s later.
            worker.stop(timeout=10.0, term_grace_s=5)
        self.workers.clear()

    def close(self) -> list[str]:
        """Stop workers, then daemons; remove (and return) segments our jobs leaked."""
        self.stop_workers()
        if self.scraper is not None:
            self.scraper.stop(timeout=10.0, term_grace_s=5)
        self._scraping.set()
        if self._scraper is not None:
            self._scraper.join()
        self._store = None
        return super().close()


def run_repeat(
    harness: Harness, args: argparse.Namespace, layers: list[tuple[str, int]], modes: list[str]
) -> dict[str, Any]:
    """Fresh workers for every variant, then iterations interleaved variant by variant."""
    pairs: dict[str, list[JsonLineWorker]] = {"raw": harness.raw_pair(sum(s for _, s in layers))}
    for mode in modes:
        pairs[mode] = harness.commd_pair(layers, args.planner, mode)
    deadline = time.monotonic() + args.timeout
    info = {name: [w.receive(deadline) for w in pair] for name, pair in pairs.items()}
    if harness.scrape_rate:  # the same job's workers, each iteration again under the scraper
        for mode in modes:
            pairs[mode + SCRAPED] = pairs[mode]
    times: dict[str, list[list[dict[str, Any]]]] = {name: [[], []] for name in pairs}
    order = list(pairs)
    for iteration in range(args.warmup + args.iterations):
        # Alternate the order every round, so that neither side always runs first.
        for name in order if iteration % 2 == 0 else order[::-1]:
            scraped = name.endswith(SCRAPED)
            if scraped:
                harness.scraping(True)
            for worker in pairs[name]:
                worker.send("go")
            deadline = time.monotonic() + args.timeout
            for rank, worker in enumerate(pairs[name]):
                result = worker.receive(deadline)
                if iteration >= args.warmup:
                    times[name][rank].append(result)
            if scraped:
                harness.scraping(False)
    harness.stop_workers()
    groups = {mode: info[mode][0].get("groups") for mode in modes}
    return {"times": times, "groups": groups}


# --- statistics and reporting --------------------------------------------------------------------


def stats(seconds: list[float]) -> dict[str, float]:
    values = np.asarray(seconds) * 1e3
    p10, p50, p90 = np.percentile(values, [10, 50, 90])
    return {"median_ms": float(p50), "p10_ms": float(p10), "p90_ms": float(p90),
            "n": int(values.size)}


def paired(commd: list[float], raw: list[float]) -> float:
    """Median of per-iteration ratios: iteration i of commd ran right next to iteration i of
    the baseline, so this cancels slow drift in the machine's load."""
    return float(np.median(np.asarray(commd) / np.asarray(raw)))


def summarise(repeats: list[dict[str, Any]], modes: list[str]) -> dict[str, Any]:
    def series(run: dict[str, Any], name: str, rank: int, key: str = "t") -> list[float]:
        return [r[key] for r in run["times"][name][rank]]

    per_repeat = []
    for index, run in enumerate(repeats, 1):
        raw = [stats(series(run, "raw", rank)) for rank in range(WORLD)]
        entry: dict[str, Any] = {"repeat": index, "raw": raw, "commd": {}}
        for mode in modes:
            ranks = [stats(series(run, mode, rank)) for rank in range(WORLD)]
            entry["commd"][mode] = {
                "ranks": ranks,
                "ratio": [c["median_ms"] / r["median_ms"] for c, r in zip(ranks, raw, strict=True)],
                "paired_ratio": paired(series(run, mode, 0), series(run, "raw", 0)),
                "ready_call_ms": stats(series(run, mode, 0, "ready_s"))["median_ms"],
                "groups": run["groups"][mode.removesuffix(SCRAPED)],
            }
        per_repeat.append(entry)
    pooled: dict[str, Any] = {"raw": stats([t for run in repeats for t in series(run, "raw", 0)])}
    for mode in modes:
        pooled[mode] = stats([t for run in repeats for t in series(run, mode, 0)])
        pooled[mode]["ratio"] = pooled[mode]["median_ms"] / pooled["raw"]["median_ms"]
        pooled[mode]["paired_ratio"] = paired(
            [t for run in repeats for t in series(run, mode, 0)],
            [t for run in repeats for t in series(run, "raw", 0)],
        )
    summary = {"repeats": per_repeat, "pooled_rank0": pooled}
    scraped = {}  # --scrape-rate: each mode's scraped iterations over its quiet ones
    for mode in (m for m in modes if m + SCRAPED in modes):
        def both(name: str, rank: int) -> list[float]:
            return [t for run in repeats for t in series(run, name, rank)]

        scraped[mode] = {
            "ratio": [stats(both(mode + SCRAPED, rank))["median_ms"]
                      / stats(both(mode, rank))["median_ms"] for rank in range(WORLD)],
            "paired_ratio": [paired(both(mode + SCRAPED, rank), both(mode, rank))
                             for rank in range(WORLD)],
            "per_repeat": [stats(series(run, mode + SCRAPED, 0))["median_ms"]
                           / stats(series(run, mode, 0))["median_ms"] for run in repeats],
        }
    if scraped:
        summary["scraped_vs_quiet"] = scraped
    return summary


def print_report(summary: dict[str, Any], args: argparse.Namespace, modes: list[str],
                 info: dict[str, Any]) -> None:
    layers = MODELS[args.model]()
    elements = sum(size for _, size in layers)
    print(f"{args.model}: {len(layers)} tensors, {elements:,} float32 ({elements * 4 / 1e6:.1f} "
          f"MB); 2 daemons x 1 rank, op=sum, planner={args.planner}; {args.warmup} warm-up + "
          f"{args.iterations} measured iterations per repeat, raw and commd interleaved")
    print("ms on rank 0 (rank 1's median in its own column); ratio = commd median / raw median, "
          "rank 0 / rank 1; paired = median of per-iteration ratios, rank 0")
    header = (f"{'repeat':>6}  {'what':<23} {'median':>8} {'p10':>8} {'p90':>8} {'rank1':>8}"
              f"  {'ratio':<13}  notes")
    print(header)
    print("-" * (len(header) + 40))
    for entry in summary["repeats"]:
        raw = entry["raw"]
        print(f"{entry['repeat']:>6}  {'raw gloo':<23} {raw[0]['median_ms']:8.1f} "
              f"{raw[0]['p10_ms']:8.1f} {raw[0]['p90_ms']:8.1f} {raw[1]['median_ms']:8.1f}")
        for mode in modes:
            m = entry["commd"][mode]
            c = m["ranks"]
            ratio = f"{m['ratio'][0]:.3f} / {m['ratio'][1]:.3f}"
            print(f"{'':>6}  {'commd ready=' + mode:<23} {c[0]['median_ms']:8.1f} "
                  f"{c[0]['p10_ms']:8.1f} {c[0]['p90_ms']:8.1f} {c[1]['median_ms']:8.1f}  "
                  f"{ratio:<13}  paired {m['paired_ratio']:.3f}, {m['groups']} group(s), "
                  f"ready() {m['ready_call_ms']:.2f} ms")
    print("-" * (len(header) + 40))
    pooled = summary["pooled_rank0"]
    raw = pooled["raw"]
    print(f"{'pooled':>6}  {'raw gloo':<23} {raw['median_ms']:8.1f} {raw['p10_ms']:8.1f} "
          f"{raw['p90_ms']:8.1f}")
    for mode in modes:
        c = pooled[mode]
        verdict = "within" if c["ratio"] <= TARGET_RATIO else "ABOVE"
        print(f"{'':>6}  {'commd ready=' + mode:<23} {c['median_ms']:8.1f} {c['p10_ms']:8.1f} "
              f"{c['p90_ms']:8.1f} {'':>8}  {c['ratio']:<13.3f}  paired {c['paired_ratio']:.3f}; "
              f"{verdict} the {TARGET_RATIO:.2f} target")
    for mode, m in summary.get("scraped_vs_quiet", {}).items():
        verdict = "within" if max(m["ratio"]) <= TARGET_SCRAPED else "ABOVE"
        print(f"scraped at {args.scrape_rate:g}/s per daemon vs quiet, ready={mode}: median ratio "
              f"{m['ratio'][0]:.3f} / {m['ratio'][1]:.3f} (rank 0 / rank 1), paired "
              f"{m['paired_ratio'][0]:.3f} / {m['paired_ratio'][1]:.3f}, per repeat "
              f"{', '.join(f'{r:.3f}' for r in m['per_repeat'])}; {verdict} the "
              f"{TARGET_SCRAPED:.2f} target")
    print(f"machine: {info['cpus']} CPUs, torch {info['torch']}, Python {info['python']}, "
          f"loopback; load average {info['loadavg_start'][0]:.2f} at start, "
          f"{info['loadavg_end'][0]:.2f} at end")


def table(results: dict[str, Any]) -> str:
    """Rank 0's milliseconds per repeat and pooled: raw Gloo, then commd per ready mode with
    its ratio to raw (and the paired ratio)."""
    modes = results["ready"]
    headers = ["repeat", "raw Gloo median [p10, p90]"]
    for mode in modes:
        headers += [f"commd, ready={mode}", "ratio (paired)"]

    def spread(s: dict[str, Any]) -> str:
        return f"{s['median_ms']:.1f} [{s['p10_ms']:.1f}, {s['p90_ms']:.1f}]"

    rows = []
    for entry in results["summary"]["repeats"]:
        row = [str(entry["repeat"]), spread(entry["raw"][0])]
        for mode in modes:
            m = entry["commd"][mode]
            row += [spread(m["ranks"][0]), f"{m['ratio'][0]:.3f} ({m['paired_ratio']:.3f})"]
        rows.append(row)
    pooled = results["summary"]["pooled_rank0"]
    row = ["pooled", spread(pooled["raw"])]
    for mode in modes:
        row += [spread(pooled[mode]),
                f"**{pooled[mode]['ratio']:.3f} ({pooled[mode]['paired_ratio']:.3f})**"]
    return markdown_table(headers, [*rows, row], "l" + "r" * (len(headers) - 1))


def machine() -> dict[str, Any]:
    import torch

    return {"cpus": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "platform": platform.platform(),
            "loadavg_start": list(os.getloadavg())}


# --- main ----------------------------------------------------------------------------------------


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="commd vs raw Gloo: a model's gradients through two daemons "
                    "vs one allreduce of the same bytes (see the module docstring)"
    )
    parser.add_argument("--model", choices=sorted(MODELS), default="resnet50",
                        help="whose gradient tensors: resnet50 (161, 102 MB) or deep_mlp "
                             "(48 x Linear(256, 256): 96 tensors, 12.8 MB)")
    parser.add_argument("--iterations", type=int, default=30, help="measured iterations")
    parser.add_argument("--warmup", type=int, default=5, help="warm-up iterations, not timed")
    parser.add_argument("--repeats", type=int, default=3,
                        help="repeats, each with fresh workers and a fresh job")
    parser.add_argument("--planner", default="syncea",
                        help="merge planner for the job: syncea, wfbp, optimal, mgwfbp, ...")
    parser.add_argument("--ready", choices=("all", "each", "both"), default="all",
                        help="one ready() call for all 161 layers, one call per layer in "
                             "backward order, or both")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds before a hang becomes an error")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--keep-logs", action="store_true", help="keep the daemons' logs")
    parser.add_argument("--metrics", action="store_true",
                        help="daemons serve Prometheus metrics (--metrics-listen 127.0.0.1:0), "
                             "scraped every second (docs/metrics.md)")
    parser.add_argument("--scrape-rate", type=float, default=0.0, metavar="R",
                        help="with --metrics: run every iteration of the job twice, quiet and "
                             "while a scraper GETs each daemon's /metrics R times a second; "
                             "reports the scraped/quiet ratio")
    add_results_option(parser, "overhead")
    parser.add_argument("--worker", nargs=2, metavar=("KIND", "SPEC"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.iterations < 1 or args.warmup < 0 or args.repeats < 1:
        parser.error("--iterations and --repeats must be >= 1, --warmup >= 0")
    if args.scrape_rate < 0 or (args.scrape_rate and not args.metrics):
        parser.error("--scrape-rate needs --metrics and a rate > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(*args.worker)
    layers = MODELS[args.model]()
    modes = ["all", "each"] if args.ready == "both" else [args.ready]
    measured = [*modes, *(mode + SCRAPED for mode in modes if args.scrape_rate)]
    signal.signal(signal.SIGTERM, _interrupt)
    info = machine()
    harness = Harness(args.timeout, args.keep_logs, args.metrics, args.scrape_rate)
    repeats: list[dict[str, Any]] = []
    try:
        harness.start_daemons()
        for index in range(args.repeats):
            repeats.append(run_repeat(harness, args, layers, modes))
            if not args.json:
                print(f"  repeat {index + 1}/{args.repeats} done", file=sys.stderr, flush=True)
    except (BenchError, WorkerError) as exc:
        harness.failed = True
        print(f"overhead benchmark failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; stopping everything", file=sys.stderr)
        return 130
    finally:
        leaked = harness.close()
        if leaked:
            print(f"removed leaked shared-memory segments: {leaked}", file=sys.stderr)
    info["loadavg_end"] = list(os.getloadavg())
    summary = summarise(repeats, measured)
    run = {
        "benchmark": "overhead", "model": args.model, "layers": len(layers),
        "elements": sum(s for _, s in layers), "dtype": "float32", "op": "sum",
        "planner": args.planner, "ready": modes, "iterations": args.iterations,
        "warmup": args.warmup, "target_ratio": TARGET_RATIO,
        "metrics": args.metrics, "scrapes": harness.scrapes,
        "scrape_rate": args.scrape_rate, "scraper": harness.scraped,
        "summary": summary,
        "times_s": [{name: [[r["t"] for r in rank] for rank in ranks]
                     for name, ranks in run["times"].items()} for run in repeats],
    }
    # the provenance's machine is the results file's; torch and the load at both ends beside it
    write_results("overhead", {**run, "torch": info["torch"],
                               "loadavg_start": info["loadavg_start"],
                               "loadavg_end": info["loadavg_end"]}, args.results)
    if args.json:
        print(json.dumps({**run, "machine": info}, indent=1))
    else:
        print_report(summary, args, measured, info)
        if args.scrape_rate:
            done = harness.scraped
            rate = done["scrapes"] / done["seconds"] if done["seconds"] else 0.0
            print(f"scraper: {done['scrapes']} scrapes answered 200 ({done['failed']} not) in "
                  f"{done['seconds']:.1f} s of scraping: {rate:.0f}/s over both daemons")
        elif args.metrics:
            print(f"metrics on: both daemons served /metrics, scraped {harness.scrapes} times")
    return 0


if __name__ == "__main__":
    sys.exit(main())
