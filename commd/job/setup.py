"""Setting up a formed job on this node, step by step, with one error path.

Once the coordinator has sent ``peer_setup``: the engine joins the job's group (several nodes
only), the device gets ready for the dtype and the pipeline is made (``set_up`` returns them,
the job takes them); then the job probes the network (``probe_network``) and the probe's
samples go to the coordinator, whose first plan starts the job. Each step's failure is a
``SetupError`` naming the step and the cause; the job fails once with it. A job that stops
starting meanwhile (failed or closed) is left alone.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from commd.compression.topk import parse_compression
from commd.engines import Engine, EngineConfig, EngineError, create_engine
from commd.engines.buffer_ops import BufferOps
from commd.job.measurements import PROBE_ELEMENTS, PROBE_REPEATS
from commd.job.members import Members
from commd.job.pipeline import Pipeline, Plan
from commd.job.reporting import Reporter
from commd.job.state import JobContext, Liveness
from commd.job.tolerant import TolerantPipeline
from commd_protocol import PeerSetup


class SetupError(Exception):
    """A set-up step failed; the message names the step and the cause."""


class Starting(Protocol):
    """What the set-up reads of the job it sets up (``Job``): its identity, its ranks and
    buffers, and where the data plane reports. It writes nothing into the job: it returns
    what it built, and the job takes it (``Built``)."""

    @property
    def id(self) -> str: ...

    @property
    def ctx(self) -> JobContext: ...

    @property
    def world_size(self) -> int: ...

    @property
    def coordinator(self) -> str: ...

    @property
    def members(self) -> Members: ...

    @property
    def ops(self) -> BufferOps | None: ...

    @property
    def liveness(self) -> Liveness: ...

    @property
    def starting(self) -> bool: ...

    @property
    def coordinator_host(self) -> str: ...

    def iteration_done(self, iteration: int, plan: Plan) -> None: ...

    def on_collective_failure(self, problem: BaseException) -> None: ...


@dataclass(frozen=True)
class Built:
    """What the set-up made for the job: its engine (None on one node), its data plane and
    the reporter the data plane's records go to."""

    engine: Engine | None
    pipeline: Pipeline
    reporter: Reporter


@contextlib.contextmanager
def _step(what: str, *failures: type[Exception]) -> Iterator[None]:
    try:
        yield
    except failures as exc:
        raise SetupError(f"{what} failed: {exc}") from None


async def set_up(job: Starting, setup: PeerSetup) -> Built | None:
    """Engine (several nodes), device, pipeline for ``setup``'s place (a formed job, or a
    node joining a running tolerant job); None when the job stopped starting meanwhile
    (failed or closed), whatever was made closed again. Raises SetupError."""
    assert job.ops is not None
    engine = (await start_engine(job.ctx, job.coordinator_host, job.id, job.ops, setup)
              if setup.nodes > 1 else None)
    try:
        if job.starting:
            with _step("device set-up", EngineError):
                await job.ops.prepare(job.members.first_registration().dtype)
    except SetupError:
        if engine is not None:
            engine.close()
        raise
    if not job.starting:  # failed or closed while the engine formed or the device prepared
        if engine is not None:
            engine.close()
        return None
    pipeline, reporter = make_pipeline(job, engine, setup)
    return Built(engine, pipeline, reporter)


def make_pipeline(job: Starting, engine: Engine | None,
                  setup: PeerSetup) -> tuple[Pipeline, Reporter]:
    """The job's data plane, and the reporter its records go to."""
    reg = job.members.first_registration()
    reporter: Reporter | None = None
    kind = TolerantPipeline if reg.fault_tolerance == "continue" else Pipeline
    pipeline = kind(
        sizes=[layer.size for layer in reg.layers],
        buffers=[m.buffer for m in job.members.in_order() if m.buffer is not None],
        dtype=reg.dtype,
        op=reg.op,
        world_size=job.world_size,
        engine=engine,
        executor=job.ctx.executor,
        on_complete=job.iteration_done,
        on_record=lambda record: reporter.add(record) if reporter else None,
        on_failure=job.on_collective_failure,
        node_index=setup.node_index,
        nodes=setup.nodes,
        compression=parse_compression(reg.compression),
        rows=[layer.rows for layer in reg.layers],
        ops=job.ops,
        watchdog=job.ctx.watchdog,
        patient=lambda: job.liveness.marks_pending,
    )
    reporter = Reporter(
        job.id, len(reg.layers), profile=reg.profile,
        send=lambda profile: job.ctx.send_peer(job.coordinator, profile),
        expect_decision=pipeline.expect_decision, observe=job.ctx.observe,
    )
    return pipeline, reporter


async def start_engine(ctx: JobContext, host: str, job: str, ops: BufferOps,
                       setup: PeerSetup) -> Engine:
    """The job's engine for ``setup``'s place, its group formed through the store on the
    coordinator's ``host`` (also a tolerant job's new group in each epoch)."""
    with _step("engine set-up", ValueError, EngineError):
        engine = create_engine(ctx.engine_for(ops.kind))
        engine.bind(ops)
    config = EngineConfig(
        key=setup.store_prefix or f"{job}/{setup.generation}",
        name=f"{job}/{setup.generation}",
        rank=setup.node_index,
        size=setup.nodes,
        store_host=host,
        store_port=setup.store_port,
        host=ctx.advertise(host),
        timeout_s=ctx.timeout_s,
    )
    try:
        with _step("engine set-up", EngineError):
            await engine.start(config)
    except SetupError:
        engine.close()
        raise
    return engine


async def probe_network(engine: Engine | None, ops: BufferOps) -> list[list[float]]:
    """All-reduce scratch buffers over a range of sizes: samples for the first fit of a, b.

    Costs PROBE_REPEATS × 5.3 MB on the wire: ~40 ms on loopback, ~0.1 s on 1 Gbit/s.
    Runs before the first iteration, in the same order on every node. Raises SetupError.
    """
    if engine is None:
        return []
    samples: list[list[float]] = []
    with _step("network probe", EngineError):
        for repeat in range(PROBE_REPEATS):
            for index, elements in enumerate(PROBE_ELEMENTS):
                scratch = ops.zeros(elements, "float32")
                begin = time.perf_counter()
                await engine.allreduce(scratch, "float32")
                if repeat > 0:  # the first round is the warm-up
                    samples.append([-repeat, index, scratch.nbytes,
                                    time.perf_counter() - begin])
    return samples
