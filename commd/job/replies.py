"""The messages a job sends its local ranks when things go right: ``registered`` once it
runs, ``done`` for every iteration. Failures go out through ``Job.fail``."""

from __future__ import annotations

from commd.engines.buffer_ops import BufferOps
from commd.job.pipeline import Pipeline, Plan
from commd.job.state import LocalRank
from commd_protocol import Done, PeerPlan, PeerSetup, Registered


def registered(setup: PeerSetup, decision: PeerPlan, ops: BufferOps | None) -> Registered:
    """The job runs: the node's place, the first plan's groups, the device's done event."""
    return Registered(
        nodes=setup.nodes, node_index=setup.node_index, groups=decision.groups,
        planner=setup.planner, plan=decision.version,
        done_event=ops.done_event if ops else b"",
    )


def done(pipeline: Pipeline, member: LocalRank, iteration: int, plan: Plan) -> Done:
    """The reply to a wait: the plan ``iteration`` ran with (and whether it ran dense and
    sent nothing top-k had held back, which the DDP wrapper's momentum correction reads), and
    the next iteration's groups if this rank lacks them (it batches its ready marks by them)."""
    carried = pipeline.compression is not None and pipeline.compression.carried
    ran = Done(iteration=iteration, plan=plan.version, dense=plan.dense and not carried)
    upcoming = pipeline.upcoming_plan(iteration + 1)
    if upcoming is None:
        return ran
    ran.next_plan = upcoming.version
    if member.told_plan != upcoming.version:
        member.told_plan, ran.next_groups = upcoming.version, upcoming.groups
    return ran
