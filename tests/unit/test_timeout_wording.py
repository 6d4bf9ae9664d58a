"""The words a timed-out ``wait()`` gets, and their bounds, from the messages the daemons
exchange: who is named, when no one is, how long the text may be. The real daemons and ranks
that carry them are in tests/daemon/test_timeout_names_culprit.py."""

from __future__ import annotations

import msgspec

from commd.coordinator.watch import JobWatch
from commd.job.liveness import culprit_text
from commd_protocol import Layer, PeerHeartbeat, PeerJoin, PeerStatus, Progress, encode
from commd_protocol.codec import daemon_codec
from commd_protocol.peer import MAX_WAITING_FOR_CHARS

LAYERS = [("conv.weight", 27), ("conv.bias", 3), ("fc.weight", 130), ("fc.bias", 10)]


def join(ranks: list[int], host: str) -> PeerJoin:
    return PeerJoin(protocol=1, job="j", ranks=ranks, world_size=4,
                    layers=[Layer(name=n, size=s) for n, s in LAYERS], dtype="float32",
                    op="sum", planner="wfbp", host=host)


def test_the_coordinator_names_unmarked_ranks_below_the_stall_warning() -> None:
    joins = {b"a": join([0, 1], "10.0.0.1"), b"b": join([2, 3], "10.0.0.2")}
    watch = JobWatch()
    watch.heard(b"a", 0.0, PeerHeartbeat(job="j", iteration=7))
    watch.heard(b"b", 0.0, PeerHeartbeat(job="j", iteration=7, waiting_s=4.25,
                                         missing=[[3, 2]]))
    assert watch.update_stall(joins, warn_s=60.0) is None  # the stall inspector is silent
    assert watch.waiting_for(joins) == (
        "rank 3 (node 1, 10.0.0.2) has not marked layer 2 ('fc.weight') for 4.2s; check that "
        "process (stopped? stuck in data loading?)")


def test_a_node_that_barely_waits_names_no_one() -> None:
    joins = {b"a": join([0, 1], "10.0.0.1"), b"b": join([2, 3], "10.0.0.2")}
    watch = JobWatch()  # marks a moment late are every iteration's normal
    watch.heard(b"b", 0.0, PeerHeartbeat(job="j", waiting_s=0.01, missing=[[3, 0]]))
    assert watch.waiting_for(joins) == ""


def test_many_unmarked_ranks_are_named_in_bounded_words() -> None:
    ranks = list(range(4000))
    big = PeerJoin(protocol=1, job="j", ranks=ranks, world_size=4000,
                   layers=[Layer(name="x" * 200, size=1)], dtype="float32", op="sum",
                   planner="wfbp", host="h")
    watch = JobWatch()
    watch.heard(b"a", 0.0, PeerHeartbeat(job="j", waiting_s=9.0,
                                         missing=[[r, 0] for r in ranks[1:]]))
    text = watch.waiting_for({b"a": big})
    assert "rank 1 (node 0, h)" in text and "and 3989 more" in text, text[:300]
    assert "check those processes" in text
    assert len(text) <= MAX_WAITING_FOR_CHARS


def test_a_hostile_status_is_passed_on_bounded() -> None:
    # A coordinator's words reach every waiting rank: the node keeps only a bounded prefix.
    status = msgspec.msgpack.decode(encode(PeerStatus(job="j", waiting_for="y" * 1_000_000)),
                                    type=PeerStatus)
    assert len(culprit_text(status.waiting_for)) == MAX_WAITING_FOR_CHARS


def test_a_progress_from_an_older_daemon_still_decodes() -> None:
    old = msgspec.msgpack.encode({"type": "progress", "message": "commd: job 'j' runs"})
    progress = daemon_codec.decode(old)
    assert isinstance(progress, Progress) and progress.waiting_for == ""
    status = msgspec.msgpack.decode(msgspec.msgpack.encode({"type": "peer_status", "job": "j"}),
                                    type=PeerStatus)
    assert status.waiting_for == ""
