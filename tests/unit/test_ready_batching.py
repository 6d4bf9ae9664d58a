"""Ready marks are batched per group of the plan, with per-layer stamps, and the daemon
keeps the per-layer profile from the stamps."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from commd.job.measurements import IterationRecord
from commd.job.pipeline import Pipeline, make_plan
from commd_client.batching import ReadyBatcher


def test_marks_are_sent_when_they_complete_a_group() -> None:
    batch = ReadyBatcher(5)
    batch.announce(3, [[3, 4], [0, 1, 2]])
    assert batch.plan == 3
    assert not batch.add([4])
    assert batch.add([3])  # group [3, 4] complete
    layers, stamps = batch.take()
    assert layers == [4, 3] and len(stamps) == 2 and stamps[0] <= stamps[1]
    assert not batch.add([2]) and not batch.add([1])
    assert batch.add([0])
    assert batch.take()[0] == [2, 1, 0]
    assert batch.take() == ([], [])
    batch.next_iteration()
    assert not batch.add([4])  # the counts start again
    assert batch.add([0, 1, 2, 3])  # one call may complete a group


def test_without_a_known_plan_every_mark_is_sent() -> None:
    batch = ReadyBatcher(3)
    assert batch.add([2])  # nothing announced yet
    batch.announce(1, [[0, 1]])  # does not cover layer 2: not a plan of ours
    assert batch.plan == 0 and batch.add([1])
    batch.announce(2, [[0, 1], [1, 2]])  # overlapping groups: refused too
    assert batch.plan == 0


def test_undecided_next_plan_then_the_known_one_again() -> None:
    batch = ReadyBatcher(2)
    batch.announce(4, [[0], [1]])
    batch.announce(0, None)  # next iteration's plan not decided: send every mark
    assert batch.plan == 0 and batch.add([1])
    batch.take()
    batch.announce(4, None)  # the daemon does not resend groups we were told
    assert batch.plan == 4
    batch.next_iteration()
    assert batch.add([1])  # group [1] complete on its own
    batch.announce(5, None)  # a version whose groups we never got: unbatched, never stuck
    assert batch.plan == 0


@pytest.fixture
def executor():
    with ThreadPoolExecutor(1) as pool:
        yield pool


async def test_pipeline_profiles_from_the_stamps_not_the_arrival(executor) -> None:
    records: list[IterationRecord] = []
    pipeline = Pipeline(
        sizes=[4, 4, 4], buffers=[np.zeros(12, np.float32)], dtype="float32", op="sum",
        world_size=1, engine=None, executor=executor, on_complete=lambda i, v: None,
        on_record=records.append, on_failure=lambda exc: None,
    )
    pipeline.schedule(0, make_plan(1, [[0, 1, 2]], [4, 4, 4]))
    pipeline.start()
    try:
        now = time.monotonic()
        # One message, three layers stamped 30 ms apart (backward order: 2, 1, 0).
        pipeline.mark(0, [2, 1, 0], sent_at=now, stamps=[now - 0.06, now - 0.03, now])
        for _ in range(500):
            if records:
                break
            await asyncio.sleep(0.002)
        (record,) = records
        assert np.allclose(record.ready_offsets_s, [0.06, 0.03, 0.0], atol=1e-9)
    finally:
        pipeline.stop()


async def test_pipeline_refuses_stamps_that_do_not_match(executor) -> None:
    from commd.job.pipeline import ReadyError

    pipeline = Pipeline(
        sizes=[4, 4], buffers=[np.zeros(8, np.float32)], dtype="float32", op="sum",
        world_size=1, engine=None, executor=executor, on_complete=lambda i, v: None,
        on_record=lambda r: None, on_failure=lambda exc: None,
    )
    with pytest.raises(ReadyError, match="1 stamps for 2 layers"):
        pipeline.mark(0, [1, 0], stamps=[1.0])
    pipeline.mark(0, [1, 0])  # nothing was marked by the refused call
