"""A job's state machine: the table of edges, the one writer, and the error for an edge the
table does not hold."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest

from commd.job.lifecycle import EDGES, IllegalTransition, Lifecycle
from commd.job.state import JobError
from commd_protocol import ErrorCode
from commd_protocol.status import JobState

ROOT = Path(__file__).resolve().parents[2]

# The life of a job as docs/architecture.md draws it: forming → joining → starting →
# running ⇄ reforming, any of them → failed / closed, which are final.
ALLOWED = {
    (JobState.FORMING, JobState.JOINING), (JobState.JOINING, JobState.STARTING),
    (JobState.STARTING, JobState.RUNNING), (JobState.RUNNING, JobState.REFORMING),
    (JobState.REFORMING, JobState.RUNNING),
    *((state, end) for state in (JobState.FORMING, JobState.JOINING, JobState.STARTING,
                                 JobState.RUNNING, JobState.REFORMING)
      for end in (JobState.FAILED, JobState.CLOSED)),
}


def at(state: JobState) -> Lifecycle:
    """A lifecycle brought to ``state`` along allowed edges."""
    path = {JobState.FORMING: [], JobState.JOINING: [JobState.JOINING],
            JobState.STARTING: [JobState.JOINING, JobState.STARTING],
            JobState.RUNNING: [JobState.JOINING, JobState.STARTING, JobState.RUNNING],
            JobState.REFORMING: [JobState.JOINING, JobState.STARTING, JobState.RUNNING,
                                 JobState.REFORMING],
            JobState.FAILED: [JobState.FAILED], JobState.CLOSED: [JobState.CLOSED]}[state]
    life = Lifecycle("demo")
    for step in path:
        life.move(step)
    assert life.state is state
    return life


def test_the_table_holds_exactly_the_documented_edges() -> None:
    table = {(state, to) for state, targets in EDGES.items() for to in targets}
    assert table == ALLOWED
    assert set(EDGES) == set(JobState)


def test_a_job_starts_forming_and_moves_along_allowed_edges() -> None:
    life = Lifecycle("demo")
    assert life.state is JobState.FORMING
    assert life.move(JobState.JOINING) is JobState.FORMING  # returns the state left
    assert life.state is JobState.JOINING


@pytest.mark.parametrize(("state", "to"), [
    pair for pair in itertools.product(JobState, JobState) if pair not in ALLOWED])
def test_every_other_edge_is_refused_naming_both_states(state: JobState, to: JobState) -> None:
    life = at(state)
    with pytest.raises(IllegalTransition) as caught:
        life.move(to)
    assert str(caught.value) == f"commd: job 'demo' cannot go from {state} to {to}"
    assert (caught.value.state, caught.value.to) == (state, to)
    assert isinstance(caught.value, JobError) and caught.value.code is ErrorCode.OUT_OF_ORDER
    assert life.state is state  # nothing carried out


def test_failed_and_closed_are_final() -> None:
    for end in (JobState.FAILED, JobState.CLOSED):
        assert EDGES[end] == frozenset()


def test_the_lifecycle_is_the_only_writer_of_a_jobs_state() -> None:
    """No module of a job assigns a ``state`` but the lifecycle: every change goes through
    the table (the job moves it with ``Job._move``)."""
    writers = []
    for path in sorted((ROOT / "commd" / "job").glob("*.py")):
        if path.name == "lifecycle.py":  # the owner
            continue
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            targets = (node.targets if isinstance(node, ast.Assign)
                       else [node.target] if isinstance(node, ast.AnnAssign | ast.AugAssign)
                       else [])
            for target in targets:
                for leaf in ast.walk(target):
                    if isinstance(leaf, ast.Attribute) and leaf.attr in ("state", "_state"):
                        writers.append(f"{path.relative_to(ROOT)}:{leaf.lineno}")
    assert writers == []
