"""A fault_tolerance="continue" job of three one-rank nodes A, B and C and the real
``Coordinator`` that forms it, with a recording ``send``: what the membership tests of tests/unit
and tests/daemon build on."""

from __future__ import annotations

import msgspec

from commd.coordinator.coordinator import Coordinator
from commd_protocol import (
    PROTOCOL_VERSION,
    ErrorCode,
    Layer,
    PeerAbort,
    PeerJoin,
    PeerReform,
    PeerReformState,
    PeerStatus,
)

JOB = "tol"
A, B, C, STRANGER = b"node-a", b"node-b", b"node-c", b"stranger"


def state(delivered: int, committing: bool = False, epoch: int = 1) -> PeerReformState:
    return PeerReformState(job=JOB, epoch=epoch, delivered=delivered, committing=committing)


class Recorder:
    """The coordinator's ``send``: every message but the periodic PeerStatus, in order."""

    def __init__(self) -> None:
        self.sent: list[tuple[bytes, msgspec.Struct]] = []

    def __call__(self, node: bytes, message: msgspec.Struct) -> None:
        if not isinstance(message, PeerStatus):
            self.sent.append((node, message))

    def take(self) -> list[tuple[bytes, msgspec.Struct]]:
        sent, self.sent = self.sent, []
        return sent


def join(rank: int, world_size: int = 3, min_world_size: int = 1) -> PeerJoin:
    return PeerJoin(protocol=PROTOCOL_VERSION, job=JOB, ranks=[rank], world_size=world_size,
                    layers=[Layer(name="w", size=4)], dtype="float32", op="sum",
                    planner="wfbp", host=f"127.0.0.{rank + 1}", fault_tolerance="continue",
                    min_world_size=min_world_size)


def formed(min_world_size: int = 1) -> tuple[Coordinator, Recorder]:
    """A tolerant job of three one-rank nodes A, B, C (ranks 0, 1, 2), formed."""
    recorder = Recorder()
    coordinator = Coordinator(recorder, store_port=lambda host: 29999)
    for rank, node in enumerate((A, B, C)):
        coordinator.on_message(node, join(rank, min_world_size=min_world_size))
    assert len(recorder.take()) == 3  # a PeerSetup each
    return coordinator, recorder


def lose_c(coordinator: Coordinator, recorder: Recorder) -> None:
    coordinator.on_message(C, PeerAbort(job=JOB, code=ErrorCode.RANK_LOST,
                                        message="rank 2 exited"))
    sent = recorder.take()
    assert [(node, type(m)) for node, m in sent] == [(A, PeerReform), (B, PeerReform)], sent
    for _, reform in sent:
        assert isinstance(reform, PeerReform) and reform.epoch == 1
        assert "(ranks [2]) lost: rank 2 exited" in reform.change
