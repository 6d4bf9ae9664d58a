"""What a node tells about a job: its measurements to the coordinator, its state to status.

The pipeline hands over one ``IterationRecord`` per iteration; every REPORT_EVERY iterations
the round's summary goes to the coordinator as a ``PeerProfile``, and the next decision is
awaited before iteration last + 1 + DECISION_LAG. The latest figures stay here for status.
"""

from __future__ import annotations

from collections.abc import Callable

from commd.job.measurements import IterationRecord, NodeProfiler
from commd.job.members import Members
from commd.job.pipeline import PipelineSnapshot
from commd.job.state import Epochs, JobState
from commd_protocol import PROTOCOL_VERSION, PeerJoin, PeerPlan, PeerProfile, PeerSetup, Register
from commd_protocol.peer import DECISION_LAG, REPORT_EVERY
from commd_protocol.status import CandidateTiming, IterationTiming, JobStatus

RECENT = 100  # iteration times kept for status


class Reporter:
    """One job's reports on this node: to the coordinator, round 0's probe and every
    REPORT_EVERY iterations the round's summary (a later iteration awaits the decision on it);
    for status, the latest figures."""

    def __init__(self, job: str, layers: int, *, profile: bool,
                 send: Callable[[PeerProfile], None],
                 expect_decision: Callable[[int], None],
                 observe: Callable[[str, IterationRecord], None] | None = None) -> None:
        self.job = job
        self._observe = observe  # JobContext.observe: the daemon's metrics (None: off)
        self.profile = profile  # False: short helper jobs send no report rounds
        self._send = send
        self._expect_decision = expect_decision
        self._profiler = NodeProfiler(layers)
        self.measured_comm_s = 0.0
        self.recent_iterations_s: list[float] = []
        self.gain = 1.0  # last compression gain reported

    def probe(self, samples: list[list[float]]) -> None:
        """Round 0: the start-up probe's samples (none on one node or without profiling)."""
        self._send(PeerProfile(job=self.job, round=0, iteration=-1, comm=samples))

    def add(self, record: IterationRecord) -> None:
        """One finished iteration; every REPORT_EVERY of them, report the round."""
        self._profiler.add(record)
        if self._observe is not None:
            self._observe(self.job, record)
        self.measured_comm_s = record.exposed_comm_s
        self.recent_iterations_s = [*self.recent_iterations_s[1 - RECENT:], record.iteration_s]
        self.gain = record.gain
        if (record.iteration + 1) % REPORT_EVERY or not self.profile:
            return
        summary = self._profiler.summary()
        self._expect_decision(record.iteration + 1 + DECISION_LAG)
        self._send(PeerProfile(
            job=self.job, round=(record.iteration + 1) // REPORT_EVERY,
            iteration=record.iteration, ready_offsets_s=summary.ready_offsets_s,
            comm=summary.comm, measured_comm_s=summary.exposed_comm_s,
            iteration_s=summary.iteration_s, gains=summary.gains,
            plan=summary.plan, step_s=summary.step_s,
            cpu_s_per_element=summary.cpu_s_per_element,
        ))

    def timing(self) -> IterationTiming | None:
        recent = self.recent_iterations_s
        if not recent:
            return None
        return IterationTiming(last=recent[-1], mean=sum(recent) / len(recent))


def join_request(job: str, world_size: int, members: Members, host: str,
                 peer: str = "", *, replacements: bool = False) -> PeerJoin:
    """Every local rank registered: ask the coordinator to let this node join (``host``: the
    address our engine listens on). Its ranks are the live ones; with ``replacements``, also
    the registered replacements for lost ones (a running node asking to take them in)."""
    reg = members.first_registration()
    ranks = sorted(r.rank for r in members.ranks.values() if not r.left and (
        not r.rejoining or (replacements and r.registration is not None)))
    return PeerJoin(
        protocol=PROTOCOL_VERSION, job=job, ranks=ranks,
        world_size=world_size, layers=reg.layers, dtype=reg.dtype, op=reg.op,
        planner=reg.planner, compression=reg.compression, profile=reg.profile, host=host,
        device=reg.device, fault_tolerance=reg.fault_tolerance,
        min_world_size=reg.min_world_size, peer=peer,
    )


def job_status(*, job: str, state: JobState, world_size: int, local_ranks: list[int],
               registration: Register | None, setup: PeerSetup | None,
               decision: PeerPlan | None, run: PipelineSnapshot, reporter: Reporter | None,
               error: str | None, stall: tuple[str, float] = ("", 0.0),
               epochs: Epochs | None = None) -> JobStatus:
    """One job's status, from the parts that own each figure."""
    reg, plan = registration, run.plan
    return JobStatus(
        job=job, state=state, world_size=world_size, local_ranks=local_ranks,
        nodes=setup.nodes if setup else None,
        node_index=setup.node_index if setup else None,
        iteration=run.iteration,
        planner=setup.planner if setup else (reg.planner if reg else None),
        plan_version=plan.version if plan else None,
        groups=plan.groups if plan else [],
        plan_history=run.history,
        ready_messages=run.ready_messages,
        plan_reason=decision.reason if decision else None,
        alpha_s=decision.alpha_s if decision else None,
        beta_s_per_byte=decision.beta_s_per_byte if decision else None,
        predicted_comm_s=decision.predicted_comm_s if decision else None,
        plan_overhead_s=decision.overhead_s if decision else None,
        plan_search=decision.search if decision else None,
        measured_comm_s=reporter.measured_comm_s if reporter else 0.0,
        compression=reg.compression if reg else None,
        ratio=plan.ratio if plan else None,
        exchanges=plan.exchanges if plan else [],
        gain=reporter.gain if reporter else 1.0,
        selection=decision.selection or None if decision else None,
        candidates=[CandidateTiming(name=name, predicted_s=predicted,
                                    measured_s=measured if measured >= 0 else None)
                    for name, predicted, measured in decision.candidates] if decision else [],
        choice=decision.choice or None if decision else None,
        layers=len(reg.layers) if reg else 0,
        dtype=reg.dtype if reg else None,
        op=reg.op if reg else None,
        iteration_s=reporter.timing() if reporter else None,
        error=error,
        device=reg.device if reg else None,
        ready_to_launch=run.ready_to_launch,
        stall=stall[0] or None,
        stall_s=stall[1],
        fault_tolerance=reg.fault_tolerance if reg else "fail",
        epoch=epochs.epoch if epochs else 0,
        members=epochs.members if epochs else [],
        membership_changes=epochs.history() if epochs else [],
    )
