"""Prometheus metrics: ``commd run --metrics-listen HOST:PORT`` serves ``/metrics`` over HTTP.

One idea: one collector, in a registry of its own (never the process-wide default one), served
on the daemon's event loop by the bounded server of ``metrics_http`` (a cap on connections, a
deadline, a size cap, the rendered text cached for a second: a scraper cannot hold a thread or
make the loop render more than once a second). What status already keeps is read at render
time from ``Daemon.status()`` and a few counts. What status does not keep, each collective's
bytes and wire time and the plan changes, is observed on the event loop once per finished
iteration (``JobContext.observe`` → ``observe_iteration``, counted just after the iteration's
``done`` replies went out), the errors sent to clients as they leave (``error_sent``), and
the membership changes of fault-tolerant jobs as this node's job resumes in a new epoch
(``JobContext.on_membership_change`` → ``membership_changed``). Everything runs on the
loop, so nothing here is locked. A job gone from the daemon's job table leaves every per-job
series at the next render, so the ``job`` label stays bounded.
docs/metrics.md lists every metric.
"""

from __future__ import annotations

import asyncio
import bisect
import functools
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from commd.daemon.metrics_http import MetricsServer
from commd.daemon.sockets import StartupError
from commd_protocol.address import split_host_port
from commd_protocol.peer import ALLGATHER
from commd_protocol.status import DaemonStatus, JobState, JobStatus

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

    from commd.job.job import Job
    from commd.job.measurements import IterationRecord

__all__ = ["Counts", "Metrics"]

log = logging.getLogger("commd.metrics")

BYTES_BUCKETS = tuple(float(1024 * 4**k) for k in range(11))  # 1 KiB … 1 GiB
SECONDS_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                   1.0, 2.5, 5.0, 10.0)
# A plan's exchange of a group → the ``exchange`` label of its collective.
EXCHANGES = {"dense": "allreduce", "allreduce": "allreduce_topk", "allgather": "allgather"}
# The ``kind`` label of commd_membership_changes_total: a fixed set, so that a caller's word
# can never add a series ("joined" comes with rejoin); anything else counts as "other".
MEMBERSHIP_KINDS = ("lost", "joined")


@dataclass(frozen=True)
class Counts:
    """What the daemon counts beside its status, read at render time."""

    clients: int = 0  # client sessions: connections that said hello
    peer_links: int = 0  # links open to the coordinators of our jobs
    refused: dict[tuple[str, str], int] = field(default_factory=dict)  # (loop, kind): Guard.counts
    handovers_refused: int = 0  # buffers the buffer socket refused


class _Histogram:
    """Cumulative bucket counts and a sum: what one Prometheus histogram series needs."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one: above every bound (+Inf)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # le: inclusive
        self.total += value

    def buckets(self) -> list[tuple[str, float]]:
        cumulative, rows = 0, []
        for bound, count in zip(_le_labels(tuple(self.bounds)), self.counts, strict=True):
            cumulative += count
            rows.append((bound, float(cumulative)))
        return rows


@functools.cache
def _le_labels(bounds: tuple[float, ...]) -> tuple[str, ...]:
    """The ``le`` label of each bucket, +Inf last: formatted once, not at every render."""
    return tuple(floatToGoString(bound) for bound in (*bounds, float("inf")))


@dataclass
class _JobSeries:
    """A job's series observed on the data path."""

    # exchange -> (bytes, seconds) of its collectives
    wire: dict[str, tuple[_Histogram, _Histogram]] = field(default_factory=dict)
    replans: int = 0
    version: int | None = None  # the plan version of the last iteration observed
    labels: tuple[int, list[str]] | None = None  # (plan version, exchange label per group)


class Metrics(Collector):
    """The daemon's metrics: ``serve`` them, feed ``observe_iteration`` and ``error_sent``."""

    def __init__(self, status: Callable[[], DaemonStatus], counts: Callable[[], Counts],
                 jobs: Mapping[str, Job]) -> None:
        self._status = status
        self._counts = counts
        self._jobs = jobs  # the daemon's job table: read on the event loop only
        self._series: dict[str, _JobSeries] = {}
        self._errors: dict[str, int] = {}  # by code
        self._membership: dict[str, int] = dict.fromkeys((*MEMBERSHIP_KINDS, "other"), 0)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        self.address = ""  # HOST:PORT served, once serving
        self.server = MetricsServer(self.render, CONTENT_TYPE_LATEST)

    # --- serving ---------------------------------------------------------------------------------

    async def serve(self, listen: str) -> str:
        """Serve /metrics on ``listen`` (HOST:PORT; port 0: a free one) on this event loop;
        the address served. StartupError, in one line, when it cannot bind."""
        host, port = split_host_port(listen)
        try:
            bound = await self.server.start(host, port)
        except OSError as exc:
            why = exc.strerror or str(exc)
            raise StartupError(f"commd: cannot serve metrics on {listen}: {why}; pass another "
                               "--metrics-listen") from None
        self.address = f"[{host}]:{bound}" if ":" in host else f"{host}:{bound}"
        log.info("serving Prometheus metrics on http://%s/metrics", self.address)
        return self.address

    async def close(self) -> None:
        """Stop serving; open scrape connections are dropped."""
        await self.server.close()

    def render(self) -> bytes:
        """The exposition text of every metric (the server caches it)."""
        return generate_latest(self.registry)

    # --- the data path (the event loop) -----------------------------------------------------------

    def observe_iteration(self, job: str, record: IterationRecord) -> None:
        """One finished iteration of ``job`` (``JobContext.observe``): counted right after
        the loop's current callback, so that the iteration's ``done`` replies go out first."""
        asyncio.get_running_loop().call_soon(self._observe, job, record)

    def _observe(self, job: str, record: IterationRecord) -> None:
        series = self._series.get(job)
        if series is None:
            series = self._series[job] = _JobSeries()
        if series.version is not None and series.version != record.plan:
            series.replans += 1
        series.version = record.plan
        if series.labels is not None and series.labels[0] == record.plan:
            labels: list[str] | None = series.labels[1]
        else:
            labels = self._labels(job, record.plan)
            if labels is not None:
                series.labels = (record.plan, labels)
        wire = series.wire
        for sample in record.comm:
            group = sample.key[1]
            if labels is not None and 0 <= group < len(labels):
                exchange = labels[group]
            else:  # the plan is no longer the running one: told from the collective
                exchange = "allgather" if sample.kind == ALLGATHER else (
                    "allreduce" if record.ratio >= 1.0 else "allreduce_topk")
            pair = wire.get(exchange)
            if pair is None:
                pair = wire[exchange] = (_Histogram(BYTES_BUCKETS),
                                         _Histogram(SECONDS_BUCKETS))
            pair[0].observe(sample.nbytes)
            pair[1].observe(sample.seconds)

    def _labels(self, job: str, version: int) -> list[str] | None:
        """The ``exchange`` label of each group of plan ``version``, if it is still the job's
        running plan (a device job's records may trail its plan by an iteration)."""
        running = self._jobs.get(job)
        plan = running.pipeline.plan if running is not None and running.pipeline else None
        if plan is None or plan.version != version:
            return None
        return [EXCHANGES.get(exchange, exchange) for exchange in plan.exchanges]

    def error_sent(self, code: str) -> None:
        """An ``Error`` went to a client."""
        self._errors[str(code)] = self._errors.get(str(code), 0) + 1

    def membership_changed(self, job: str, kind: str) -> None:
        """A fault-tolerant ``job`` resumed on this node in a new epoch (``kind``: "lost" or
        "joined"); counted per daemon, not per job, so that a job's end loses no count."""
        del job  # the job's current epoch is its gauge, read from status
        label = kind if kind in MEMBERSHIP_KINDS else "other"
        self._membership[label] += 1

    # --- a render (on the event loop, at most once per the server's cache interval) -------------

    def collect(self) -> Iterator[Metric]:
        status = self._status()
        counts = self._counts()
        live = {job.job for job in status.jobs}
        for gone in [job for job in self._series if job not in live]:
            del self._series[gone]  # bounded cardinality: a forgotten job's series go
        observed = {job: (series.replans,
                          {e: (b.buckets(), b.total) for e, (b, _) in series.wire.items()},
                          {e: (t.buckets(), t.total) for e, (_, t) in series.wire.items()})
                    for job, series in self._series.items()}
        yield from _daemon_families(status, counts, dict(self._errors))
        changes = CounterMetricFamily("commd_membership_changes", "Membership changes of "
                                      "fault-tolerant jobs on this node (a new epoch resumed), "
                                      "by kind: lost, joined, other", labels=["kind"])
        for kind, number in self._membership.items():
            changes.add_metric([kind], number)
        yield changes
        yield from _job_families(status.jobs, observed)


def _daemon_families(status: DaemonStatus | None, counts: Counts,
                     errors: dict[str, int]) -> Iterator[Metric]:
    if status is not None:
        info = GaugeMetricFamily("commd_daemon_info", "This daemon: 1, labelled with its "
                                 "version, protocol and backend",
                                 labels=["version", "protocol", "backend"])
        info.add_metric([status.version, str(status.protocol), status.backend], 1)
        yield info
        yield GaugeMetricFamily("commd_uptime_seconds", "Seconds since the daemon started",
                                value=status.uptime_s)
        by_state = {state.value: 0 for state in JobState}
        for job in status.jobs:
            by_state[str(job.state)] = by_state.get(str(job.state), 0) + 1
        jobs = GaugeMetricFamily("commd_jobs", "Jobs in the daemon's job table, by state",
                                 labels=["state"])
        for state, number in by_state.items():
            jobs.add_metric([state], number)
        yield jobs
        yield GaugeMetricFamily("commd_jobs_coordinated", "Jobs this daemon coordinates "
                                "(it is on rank 0's node)", value=len(status.coordinating))
        yield GaugeMetricFamily("commd_nodes_coordinated", "Nodes that joined the jobs this "
                                "daemon coordinates",
                                value=sum(job.nodes for job in status.coordinating))
        yield CounterMetricFamily("commd_peer_handshakes_refused", "Handshakes refused on the "
                                  "peer port, every reason",
                                  value=status.peer_handshakes_refused)
        by_reason = CounterMetricFamily("commd_peer_handshakes_refused_by_reason", "The same by "
                                        "reason: no_key, wrong_server_key, wrong_client_key, "
                                        "garbage", labels=["reason"])
        for reason, number in sorted(status.peer_handshakes_refused_by.items()):
            by_reason.add_metric([reason], number)
        yield by_reason
    yield GaugeMetricFamily("commd_clients_connected", "Client connections (ranks) that said "
                            "hello", value=counts.clients)
    yield GaugeMetricFamily("commd_peer_links_open", "Links open to the coordinators of this "
                            "node's jobs", value=counts.peer_links)
    sent = CounterMetricFamily("commd_errors_sent", "Error replies sent to clients, by code",
                               labels=["code"])
    for code, number in sorted(errors.items()):
        sent.add_metric([code], number)
    yield sent
    refused = CounterMetricFamily("commd_frames_refused", "Frames a message loop refused or "
                                  "failed on, by loop and kind (the loops' guards)",
                                  labels=["loop", "kind"])
    for (loop, kind), number in sorted(counts.refused.items()):
        refused.add_metric([loop, kind], number)
    yield refused
    yield CounterMetricFamily("commd_buffer_handovers_refused", "Buffers refused on the "
                              "buffer socket (not a sealed memfd, bad token, limits)",
                              value=counts.handovers_refused)


Observed = dict[str, tuple[int, dict[str, tuple[list[tuple[str, float]], float]],
                           dict[str, tuple[list[tuple[str, float]], float]]]]


def _job_families(jobs: Sequence[JobStatus], observed: Observed) -> Iterator[Metric]:
    def family(kind: type[Metric], name: str, help: str, *labels: str) -> Any:
        return kind(name, help, labels=["job", *labels])  # type: ignore[call-arg]

    iterations = family(CounterMetricFamily, "commd_job_iterations", "Iterations finished")
    groups = family(GaugeMetricFamily, "commd_job_plan_groups", "Groups in the running plan")
    version = family(GaugeMetricFamily, "commd_job_plan_version", "Version of the running plan")
    replans = family(CounterMetricFamily, "commd_job_replans",
                     "Plan version changes between iterations")
    predicted = family(GaugeMetricFamily, "commd_job_exposed_comm_predicted_seconds",
                       "Exposed communication per iteration the running plan predicts")
    measured = family(GaugeMetricFamily, "commd_job_exposed_comm_measured_seconds",
                      "Exposed communication of the last iteration, measured on this node")
    stall = family(GaugeMetricFamily, "commd_job_stall_seconds",
                   "How long the job has stalled (0: not stalled)")
    launch = family(GaugeMetricFamily, "commd_job_ready_to_launch_seconds",
                    "Last ready of a group to its collective's launch, over the last 4096 "
                    "launches", "quantile")
    wire_bytes = family(HistogramMetricFamily, "commd_job_wire_bytes",
                        "Bytes of each collective on the wire, by exchange", "exchange")
    wire_seconds = family(HistogramMetricFamily, "commd_job_wire_seconds",
                          "Wire time of each collective, by exchange", "exchange")
    epoch = family(GaugeMetricFamily, "commd_job_membership_epoch",
                   "Membership epoch of a fault_tolerance=\"continue\" job (0: the first)")
    members = family(GaugeMetricFamily, "commd_job_membership_ranks",
                     "Ranks in that epoch (a fault_tolerance=\"continue\" job)")
    for job in jobs:
        name = job.job
        iterations.add_metric([name], job.iteration)
        groups.add_metric([name], len(job.groups))
        if job.plan_version is not None:
            version.add_metric([name], job.plan_version)
        if job.predicted_comm_s is not None:
            predicted.add_metric([name], job.predicted_comm_s)
        measured.add_metric([name], job.measured_comm_s)
        stall.add_metric([name], _stall_seconds(job))
        latency = job.ready_to_launch
        if latency is not None:
            for quantile, micros in (("0.5", latency.p50_us), ("0.99", latency.p99_us),
                                     ("1", latency.max_us)):
                launch.add_metric([name, quantile], micros / 1e6)
        if job.fault_tolerance == "continue":
            epoch.add_metric([name], job.epoch)
            members.add_metric([name], len(job.members) or job.world_size)
        changes, sizes, times = observed.get(name, (0, {}, {}))
        replans.add_metric([name], changes)
        for exchange, (buckets, total) in sorted(sizes.items()):
            wire_bytes.add_metric([name, exchange], buckets, total)
        for exchange, (buckets, total) in sorted(times.items()):
            wire_seconds.add_metric([name, exchange], buckets, total)
    yield from (iterations, groups, version, replans, predicted, measured, stall, launch,
                wire_bytes, wire_seconds, epoch, members)


def _stall_seconds(job: JobStatus) -> float:
    """The job's stall in seconds, when its status says (``stall_s``, or a numeric ``stall``);
    0 until ``JobStatus`` has such a field."""
    for name in ("stall_s", "stall"):
        value = getattr(job, name, None)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    return 0.0
