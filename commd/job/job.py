"""The state of one job on this node: its local ranks, registration, set-up and failure.

The control plane lives here; the data plane is ``Pipeline``. A job never touches another
job's state, so one daemon serves many jobs in isolation.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import msgspec

from commd.compression.topk import SUPPORTED_DTYPES as COMPRESSIBLE_DTYPES
from commd.compression.topk import parse_compression
from commd.engines import Engine, EngineConfig, EngineError, create_engine
from commd.engines.buffer_ops import BufferOps
from commd.job import buffers
from commd.job.agreement import describe_difference
from commd.job.pipeline import Pipeline, ReadyError, make_plan
from commd.job.segments import SharedSegment
from commd.plan.fitting import DECISION_LAG, REPORT_EVERY, IterationRecord, NodeProfiler
from commd_protocol import (
    DTYPES,
    OPS,
    PROTOCOL_VERSION,
    Done,
    Error,
    ErrorCode,
    Hello,
    PeerAbort,
    PeerJoin,
    PeerLeave,
    PeerPlan,
    PeerProfile,
    PeerSetup,
    Register,
    Registered,
)

log = logging.getLogger("commd.jobs")

_JOB_ID = re.compile(r"^[A-Za-z0-9_.:@/+-]{1,128}$")

SendClient = Callable[[bytes, msgspec.Struct], None]
SendPeer = Callable[[str, msgspec.Struct], None]


class JobError(Exception):
    """A request the job refuses; ``code`` goes into the error reply."""

    def __init__(self, message: str, code: ErrorCode = ErrorCode.INVALID) -> None:
        super().__init__(message if message.startswith("commd: ") else "commd: " + message)
        self.code = code


@dataclass
class LocalRank:
    identity: bytes
    rank: int
    local_rank: int
    pid: int
    segment: SharedSegment | None = None
    buffer: Any = None  # numpy array (shared memory) or cupy array (device memory)
    registration: Register | None = None
    waiting: int | None = None  # the iteration this rank waits for
    told_plan: int = 0  # the plan whose groups this rank was last sent (it batches by them)
    left: bool = False


@dataclass(frozen=True)
class JobContext:
    """What every job of this daemon shares."""

    backend: str
    engine_for: Callable[[str], str]  # buffer kind -> engine name; ValueError says why none
    timeout_s: float
    advertise: Callable[[str], str]  # coordinator host -> our engine address
    executor: Executor
    send_client: SendClient
    send_peer: SendPeer
    validate_planner: Callable[[str], None]
    default_planner: str


class Job:
    def __init__(self, hello: Hello, context: JobContext) -> None:
        self.id = hello.job
        self.world_size = hello.world_size
        self.local_world_size = hello.local_world_size
        self.coordinator = hello.coordinator
        self.ctx = context
        self.ranks: dict[int, LocalRank] = {}
        self.state = "forming"  # forming → joining → starting → running → failed / closed
        self.failure: Error | None = None
        self.setup: PeerSetup | None = None
        self.engine: Engine | None = None
        self.pipeline: Pipeline | None = None
        self.ops: BufferOps | None = None  # how the data plane touches this job's buffers
        self.profiler: NodeProfiler | None = None
        self.last_plan: PeerPlan | None = None
        self.measured_comm_s = 0.0
        self.recent_iterations_s: list[float] = []
        self.gain = 1.0  # last compression gain reported
        self.created = time.time()
        self._closed = False

    # --- membership ------------------------------------------------------------------------------

    @staticmethod
    def check_hello(hello: Hello) -> None:
        if hello.protocol != PROTOCOL_VERSION:
            raise JobError(
                f"protocol version {hello.protocol} is not supported (this daemon speaks "
                f"{PROTOCOL_VERSION}); install matching commd and commd_client versions",
                ErrorCode.VERSION,
            )
        if not _JOB_ID.match(hello.job):
            raise JobError(f"invalid job id {hello.job!r}: use 1-128 of A-Z a-z 0-9 _.:@/+-")
        if not 0 <= hello.rank < hello.world_size:
            raise JobError(f"rank {hello.rank} is outside world size {hello.world_size}")
        if not 0 <= hello.local_rank < hello.local_world_size <= hello.world_size:
            raise JobError(
                f"local rank {hello.local_rank} / local world size {hello.local_world_size} "
                f"do not fit world size {hello.world_size}"
            )
        host, _, port = hello.coordinator.rpartition(":")
        if not host or not port.isdigit():
            raise JobError(f"coordinator must be HOST:PORT, got {hello.coordinator!r}")

    def add_rank(self, identity: bytes, hello: Hello) -> LocalRank:
        if self.state != "forming":
            raise JobError(
                f"job {self.id!r} is already {self.state}; use a new job id for a new run",
                ErrorCode.OUT_OF_ORDER,
            )
        for name in ("world_size", "local_world_size", "coordinator"):
            if getattr(hello, name) != getattr(self, name):
                raise JobError(
                    f"rank {hello.rank} says {name}={getattr(hello, name)!r} but job "
                    f"{self.id!r} has {name}={getattr(self, name)!r}",
                    ErrorCode.MISMATCH,
                )
        if hello.local_rank in self.ranks:
            raise JobError(
                f"local rank {hello.local_rank} of job {self.id!r} is already connected "
                f"(rank {self.ranks[hello.local_rank].rank})",
                ErrorCode.MISMATCH,
            )
        member = LocalRank(identity, hello.rank, hello.local_rank, hello.pid)
        self.ranks[hello.local_rank] = member
        return member

    # --- registration ----------------------------------------------------------------------------

    def register(self, member: LocalRank, message: Register) -> None:
        """Attach the rank's buffer; once every local rank is in, ask the coordinator to join."""
        if member.registration is not None:
            raise JobError("register sent twice", ErrorCode.OUT_OF_ORDER)
        if not message.planner:
            message = msgspec.structs.replace(message, planner=self.ctx.default_planner)
        self._check_register(message)
        total = sum(layer.size for layer in message.layers)
        try:
            self._attach(member, message, total)
        except buffers.AttachError as exc:
            raise JobError(str(exc)) from None
        member.registration = message
        self._check_local_agreement(member)
        if len(self.ranks) == self.local_world_size and all(
            r.registration is not None for r in self.ranks.values()
        ):
            self._join()

    def _attach(self, member: LocalRank, message: Register, total: int) -> None:
        if self.ops is not None:
            problem = buffers.same_device(self.ops, message)
            if problem:
                raise buffers.AttachError(f"rank {member.rank} registered {problem}")
        if message.device == "cpu":
            member.segment, member.buffer = buffers.attach_host(message, total)
        if self.ops is None:
            self.ops = buffers.new_ops(message, self.ctx.timeout_s)
        if message.device != "cpu":
            member.buffer = buffers.attach_device(self.ops, member.local_rank, message, total)

    def _check_register(self, message: Register) -> None:
        problem = buffers.check_fields(message)
        if problem:
            raise JobError(problem)
        if self.world_size > self.local_world_size:  # several nodes: an engine must take it
            try:
                self.ctx.engine_for(message.device)
            except ValueError as exc:
                raise JobError(str(exc)) from None
        if message.dtype not in DTYPES:
            raise JobError(f"unsupported dtype {message.dtype!r}; use one of {', '.join(DTYPES)}")
        if message.op not in OPS:
            raise JobError(f"unsupported op {message.op!r}; use one of {', '.join(OPS)}")
        if not message.layers:
            raise JobError("register needs at least one layer")
        for index, layer in enumerate(message.layers):
            if layer.size <= 0:
                raise JobError(f"layer {index} ({layer.name!r}) has size {layer.size}; must be > 0")
        try:
            spec = parse_compression(message.compression)
        except ValueError as exc:
            raise JobError(str(exc)) from None
        if spec is not None and message.dtype not in COMPRESSIBLE_DTYPES:
            raise JobError(
                f"top-k compression needs float32 or float64 gradients, not {message.dtype}"
            )
        try:
            self.ctx.validate_planner(message.planner)
        except ValueError as exc:
            raise JobError(str(exc)) from None

    def _check_local_agreement(self, member: LocalRank) -> None:
        first = next(
            r for r in sorted(self.ranks.values(), key=lambda r: r.rank) if r.registration
        )
        if first is member:
            return
        problem = describe_difference(first.registration, member.registration)  # type: ignore[arg-type]
        if problem:
            self.fail(
                ErrorCode.MISMATCH,
                f"ranks {first.rank} and {member.rank} registered different layers: {problem}",
            )
            raise JobError(self.failure.message if self.failure else problem, ErrorCode.MISMATCH)

    def _join(self) -> None:
        self.state = "joining"
        first = min(self.ranks.values(), key=lambda r: r.rank)
        reg = first.registration
        assert reg is not None
        host = self.coordinator.rpartition(":")[0].strip("[]")
        self.ctx.send_peer(
            self.coordinator,
            PeerJoin(
                protocol=PROTOCOL_VERSION,
                job=self.id,
                ranks=sorted(r.rank for r in self.ranks.values()),
                world_size=self.world_size,
                layers=reg.layers,
                dtype=reg.dtype,
                op=reg.op,
                planner=reg.planner,
                compression=reg.compression,
                profile=reg.profile,
                host=self.ctx.advertise(host),
                device=reg.device,
            ),
        )

    # --- set-up ----------------------------------------------------------------------------------

    async def on_setup(self, setup: PeerSetup) -> None:
        """Join the engine group, probe the network, report, then wait for the first plan."""
        if self.state != "joining":
            log.warning("job %s: ignoring set-up in state %s", self.id, self.state)
            return
        self.state, self.setup = "starting", setup
        assert self.ops is not None
        engine = None
        if setup.nodes > 1:
            try:
                engine = create_engine(self.ctx.engine_for(self.ops.kind))
                engine.bind(self.ops)
            except (ValueError, EngineError) as exc:
                self.fail(ErrorCode.ENGINE, f"engine set-up failed: {exc}")
                return
            host = self.coordinator.rpartition(":")[0].strip("[]")
            config = EngineConfig(
                key=f"{self.id}/{setup.generation}",
                rank=setup.node_index,
                size=setup.nodes,
                store_host=host,
                store_port=setup.store_port,
                host=self.ctx.advertise(host),
                timeout_s=self.ctx.timeout_s,
            )
            try:
                await engine.start(config)
            except EngineError as exc:
                engine.close()
                self.fail(ErrorCode.ENGINE, f"engine set-up failed: {exc}")
                return
        if self.state != "starting":  # failed or closed while the engine was forming
            if engine is not None:
                engine.close()
            return
        self.engine = engine
        try:
            await self.ops.prepare(self._first_registration().dtype)
        except EngineError as exc:
            self.fail(ErrorCode.ENGINE, f"device set-up failed: {exc}")
            return
        if self.state != "starting":
            return
        self.pipeline = self._make_pipeline()
        try:
            probe = await self.pipeline.probe() if self._first_registration().profile else []
        except EngineError as exc:
            self.fail(ErrorCode.ENGINE, f"network probe failed: {exc}")
            return
        self.ctx.send_peer(
            self.coordinator, PeerProfile(job=self.id, round=0, iteration=-1, comm=probe)
        )

    def _make_pipeline(self) -> Pipeline:
        members = sorted(self.ranks.values(), key=lambda r: r.local_rank)
        reg = self._first_registration()
        self.profiler = NodeProfiler(len(reg.layers))
        return Pipeline(
            sizes=[layer.size for layer in reg.layers],
            buffers=[m.buffer for m in members if m.buffer is not None],
            dtype=reg.dtype,
            op=reg.op,
            world_size=self.world_size,
            engine=self.engine,
            executor=self.ctx.executor,
            on_complete=self._iteration_done,
            on_record=self._record,
            on_failure=lambda exc: self.fail(ErrorCode.ENGINE, f"collective failed: {exc}"),
            node_index=self.setup.node_index if self.setup else 0,
            nodes=self.setup.nodes if self.setup else 1,
            compressed=parse_compression(reg.compression) is not None,
            ops=self.ops,
        )

    def _first_registration(self) -> Register:
        reg = min(self.ranks.values(), key=lambda r: r.local_rank).registration
        assert reg is not None
        return reg

    def on_plan(self, decision: PeerPlan) -> None:
        """The coordinator's plan for a round; round 0's starts the job."""
        if self.pipeline is None or self.state not in ("starting", "running"):
            return
        self.last_plan = decision
        self.pipeline.schedule(
            decision.effective_iteration,
            make_plan(decision.version, decision.groups, self.pipeline.sizes,
                      decision.exchanges, decision.ratio),
        )
        if self.state == "starting":
            self._start_running(decision)

    def _start_running(self, decision: PeerPlan) -> None:
        assert self.pipeline is not None and self.setup is not None
        self.pipeline.start()
        self.state = "running"
        reply = Registered(
            nodes=self.setup.nodes, node_index=self.setup.node_index, groups=decision.groups,
            planner=self.setup.planner, plan=decision.version,
            done_event=self.ops.done_event if self.ops else b"",
        )
        for member in self.ranks.values():
            member.told_plan = decision.version
            self.ctx.send_client(member.identity, reply)
        log.info(
            "job %s running: node %d of %d, %d local ranks, %d groups (%s)",
            self.id, self.setup.node_index, self.setup.nodes, len(self.ranks),
            len(decision.groups), self.setup.planner,
        )

    def _record(self, record: IterationRecord) -> None:
        """Every REPORT_EVERY iterations, send this node's profile to the coordinator."""
        assert self.profiler is not None and self.pipeline is not None
        self.profiler.add(record)
        self.measured_comm_s = record.exposed_comm_s
        self.recent_iterations_s = [*self.recent_iterations_s[-99:], record.iteration_s]
        self.gain = record.gain
        if (record.iteration + 1) % REPORT_EVERY or not self._first_registration().profile:
            return
        summary = self.profiler.summary()
        self.pipeline.expect_decision(record.iteration + 1 + DECISION_LAG)
        self.ctx.send_peer(self.coordinator, PeerProfile(
            job=self.id, round=(record.iteration + 1) // REPORT_EVERY,
            iteration=record.iteration, ready_offsets_s=summary.ready_offsets_s,
            comm=summary.comm, measured_comm_s=summary.exposed_comm_s,
            iteration_s=summary.iteration_s, gains=summary.gains,
            plan=summary.plan, step_s=summary.step_s,
        ))

    # --- iterations ------------------------------------------------------------------------------

    def ready(self, member: LocalRank, layers: list[int], sent_at: float = 0.0,
              stamps: list[float] | None = None) -> None:
        if self.state != "running" or self.pipeline is None:
            raise JobError(
                f"ready before the job is formed (job {self.id!r} is {self.state})",
                ErrorCode.OUT_OF_ORDER,
            )
        if any(r.left for r in self.ranks.values()):
            gone = [r.rank for r in self.ranks.values() if r.left]
            self.fail(ErrorCode.RANK_LOST, f"rank(s) {gone} closed; the job cannot go on")
            return
        try:
            self.pipeline.mark(member.local_rank, layers, sent_at, stamps)
        except ReadyError as exc:
            raise JobError(str(exc)) from None

    def wait(self, member: LocalRank, iteration: int) -> None:
        if self.state != "running" or self.pipeline is None:
            raise JobError(
                f"wait before the job is formed (job {self.id!r} is {self.state})",
                ErrorCode.OUT_OF_ORDER,
            )
        if iteration < self.pipeline.iteration:
            version = self.pipeline.plan.version if self.pipeline.plan else 0
            self.ctx.send_client(member.identity, self._done(member, iteration, version))
        elif iteration == self.pipeline.iteration:
            member.waiting = iteration
        else:
            raise JobError(
                f"wait for iteration {iteration} but the job is at {self.pipeline.iteration}",
                ErrorCode.OUT_OF_ORDER,
            )

    def _iteration_done(self, iteration: int, plan_version: int) -> None:
        for member in self.ranks.values():
            if member.waiting == iteration:
                member.waiting = None
                self.ctx.send_client(member.identity,
                                     self._done(member, iteration, plan_version))

    def _done(self, member: LocalRank, iteration: int, plan_version: int) -> Done:
        """The reply to a wait, with the next iteration's groups if this rank lacks them."""
        assert self.pipeline is not None
        upcoming = self.pipeline.upcoming_plan(iteration + 1)
        if upcoming is None:
            return Done(iteration=iteration, plan=plan_version)
        groups = None
        if member.told_plan != upcoming.version:
            member.told_plan, groups = upcoming.version, upcoming.groups
        return Done(iteration=iteration, plan=plan_version, next_plan=upcoming.version,
                    next_groups=groups)

    # --- failure and departure -------------------------------------------------------------------

    def fail(self, code: ErrorCode, message: str, *, tell_coordinator: bool = True) -> None:
        """Latch the failure, tell every local rank and (once) the coordinator."""
        if self.state in ("failed", "closed"):
            return
        previous = self.state
        self.state = "failed"
        text = message if message.startswith("commd: ") else f"commd: job {self.id!r}: {message}"
        self.failure = Error(code=code, message=text, fatal=True)
        log.error("%s", text)
        for member in self.ranks.values():
            if not member.left:
                self.ctx.send_client(member.identity, self.failure)
        if tell_coordinator and previous != "forming":
            self.ctx.send_peer(self.coordinator, PeerAbort(job=self.id, code=code, message=text))
        self._release_engine()

    def leave(self, member: LocalRank, *, lost: bool) -> None:
        """A rank said goodbye (lost=False) or its process vanished (lost=True)."""
        if member.left:
            return
        member.left = True
        if lost and self.state in ("joining", "starting", "running"):
            self.fail(
                ErrorCode.RANK_LOST,
                f"rank {member.rank} (pid {member.pid}) exited without closing its client; "
                "check that rank's log",
            )
        elif self.state == "running" and self._iteration_in_flight():
            self.fail(
                ErrorCode.RANK_LOST, f"rank {member.rank} closed in the middle of an iteration"
            )

    def _iteration_in_flight(self) -> bool:
        marked = self.pipeline is not None and self.pipeline.in_flight
        return marked or any(r.waiting is not None for r in self.ranks.values() if not r.left)

    @property
    def finished(self) -> bool:
        return all(r.left for r in self.ranks.values())

    def close(self) -> None:
        """Stop everything this job started and unlink its segments (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self.state in ("joining", "starting", "running"):
            self.ctx.send_peer(self.coordinator, PeerLeave(job=self.id))
        if self.state != "failed":
            self.state = "closed"
        self._release_engine()
        for member in self.ranks.values():
            member.buffer = None
            if member.segment is not None:
                member.segment.close()
        if self.ops is not None:
            self.ops.close()  # device: unmaps the ranks' buffers once the stream drained

    def _release_engine(self) -> None:
        if self.pipeline is not None:
            self.pipeline.stop()
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    def status(self) -> dict[str, Any]:
        reg = next((r.registration for r in self.ranks.values() if r.registration), None)
        setup, plan, pipeline = self.setup, self.last_plan, self.pipeline
        recent = self.recent_iterations_s
        return {
            "job": self.id,
            "state": self.state,
            "world_size": self.world_size,
            "local_ranks": sorted(r.rank for r in self.ranks.values()),
            "nodes": setup.nodes if setup else None,
            "node_index": setup.node_index if setup else None,
            "iteration": pipeline.iteration if pipeline else 0,
            "planner": setup.planner if setup else (reg.planner if reg else None),
            "plan_version": pipeline.plan.version if pipeline and pipeline.plan else None,
            "groups": pipeline.plan.groups if pipeline and pipeline.plan else [],
            "plan_history": pipeline.plan_history if pipeline else [],
            "ready_messages": pipeline.notifications if pipeline else 0,
            "plan_reason": plan.reason if plan else None,
            "alpha_s": plan.alpha_s if plan else None,
            "beta_s_per_byte": plan.beta_s_per_byte if plan else None,
            "predicted_comm_s": plan.predicted_comm_s if plan else None,
            "plan_overhead_s": plan.overhead_s if plan else None,
            "plan_search": plan.search if plan else None,
            "measured_comm_s": self.measured_comm_s,
            "compression": reg.compression if reg else None,
            "ratio": pipeline.plan.ratio if pipeline and pipeline.plan else None,
            "exchanges": pipeline.plan.exchanges if pipeline and pipeline.plan else [],
            "gain": self.gain,
            "layers": len(reg.layers) if reg else 0,
            "dtype": reg.dtype if reg else None,
            "op": reg.op if reg else None,
            "iteration_s": {"last": recent[-1], "mean": sum(recent) / len(recent)}
            if recent else None,
            "error": self.failure.message if self.failure else None,
            "device": reg.device if reg else None,
            "ready_to_launch": pipeline.ready_to_launch.summary() if pipeline else None,
        }
