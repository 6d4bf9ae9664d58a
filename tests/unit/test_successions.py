"""A job taken over where its coordinator was lost, for what starts later with the old command:
the daemon's record of successions (``Successions``) and the coordinator of a fresh daemon at
the lost address, told who took over (``PeerSuccession``), sending joins there
(``PeerRedirect``). The real ``Coordinator`` with a recording ``send``."""

from __future__ import annotations

import itertools

import msgspec
import pytest
from membership_cases import JOB, A, B, C, Recorder, formed, join

from commd.coordinator.coordinator import Coordinator
from commd.coordinator.tolerance import MAX_REDIRECTS
from commd.job.successions import MAX_CHAIN, Successions
from commd_protocol import PeerRedirect, PeerSetup, PeerSuccession, encode
from commd_protocol.codec import peer_codec

OLD, NEW, NEWER = "10.0.0.1:29600", "10.0.0.2:29600", "10.0.0.3:29600"


# --- the record ----------------------------------------------------------------------------------


def test_a_job_resolves_to_its_last_successor_and_others_are_untouched() -> None:
    record = Successions()
    record.record(JOB, OLD, NEW)
    record.record(JOB, NEW, NEWER)  # the successor was lost too
    assert record.resolve(JOB, OLD) == NEWER
    assert record.resolve(JOB, NEW) == NEWER
    assert record.resolve(JOB, NEWER) == NEWER
    assert record.resolve("other", OLD) == OLD  # per job: another job at OLD is not moved
    assert record.lost_at(OLD) == [(JOB, NEWER)]
    assert record.lost_at(NEWER) == []


def test_coordinating_again_where_it_was_lost_makes_no_loop() -> None:
    record = Successions()
    record.record(JOB, OLD, NEW)
    record.record(JOB, NEW, OLD)  # taken back to a fresh daemon at the first address
    assert record.resolve(JOB, OLD) == OLD
    assert record.resolve(JOB, NEW) == OLD
    record.record(JOB, OLD, OLD)  # a succession to itself is none
    assert record.resolve(JOB, NEW) == OLD


def test_a_chain_is_followed_a_bounded_number_of_steps() -> None:
    record = Successions()
    hops = [f"10.0.1.{i}:1" for i in range(MAX_CHAIN + 5)]
    for lost, successor in itertools.pairwise(hops):
        record.record(JOB, lost, successor)
    assert record.resolve(JOB, hops[0]) == hops[MAX_CHAIN]


def test_the_record_keeps_the_latest_jobs_only() -> None:
    record = Successions(limit=3)
    for index in range(5):
        record.record(f"job{index}", OLD, NEW)
    assert record.resolve("job0", OLD) == OLD and record.resolve("job1", OLD) == OLD
    assert [job for job, _ in record.lost_at(OLD)] == ["job2", "job3", "job4"]


# --- a fresh daemon at the lost address --------------------------------------------------------


def fresh() -> tuple[Coordinator, Recorder]:
    recorder = Recorder()
    return Coordinator(recorder, store_port=lambda host: 29999), recorder


def succession(**changes: object) -> PeerSuccession:
    return msgspec.structs.replace(PeerSuccession(job=JOB, lost=OLD, coordinator=NEW),
                                   **changes)


def test_a_join_waiting_here_is_sent_to_the_successor_and_nothing_forms() -> None:
    """A replacement started with the old command joined the fresh daemon at the lost
    address; a survivor's word moves it, and a later join goes there at once."""
    coordinator, recorder = fresh()
    coordinator.on_message(A, join(0))
    assert recorder.take() == []  # forming: the other ranks never come here
    coordinator.on_message(B, succession())
    assert recorder.take() == [(A, PeerRedirect(job=JOB, coordinator=NEW))]
    assert coordinator.status() == []  # not forming here any more
    coordinator.on_message(C, join(2))
    assert recorder.take() == [(C, PeerRedirect(job=JOB, coordinator=NEW))]
    coordinator.on_message(C, join(2, world_size=4))  # another world size: the same answer
    assert recorder.take() == [(C, PeerRedirect(job=JOB, coordinator=NEW))]


def test_a_job_formed_here_is_not_moved_by_a_succession() -> None:
    coordinator, recorder = formed()
    coordinator.on_message(B, succession())
    assert recorder.take() == []
    (job,) = coordinator.status()
    assert job.formed and job.nodes == 3


def test_other_jobs_form_here_as_ever() -> None:
    coordinator, recorder = fresh()
    coordinator.on_message(B, succession())
    other = msgspec.structs.replace(join(0, world_size=1), job="other")
    coordinator.on_message(A, other)
    ((node, setup),) = recorder.take()
    assert node == A and isinstance(setup, PeerSetup) and setup.job == "other"


@pytest.mark.parametrize("changes", [
    {"coordinator": "nowhere"}, {"coordinator": "10.0.0.2:0"}, {"coordinator": "h:99999"},
    {"coordinator": "x" * 400 + ":1"}, {"lost": ""}, {"job": "bad id!"}, {"job": "j" * 200},
])
def test_a_bad_succession_changes_nothing(changes: dict[str, object]) -> None:
    coordinator, recorder = fresh()
    coordinator.on_message(A, join(0))
    coordinator.on_message(B, succession(**changes))
    assert recorder.take() == []
    (job,) = coordinator.status()
    assert not job.formed  # still forming here: nothing was redirected


def test_the_redirects_kept_are_bounded() -> None:
    coordinator, recorder = fresh()
    for index in range(MAX_REDIRECTS + 10):
        coordinator.on_message(B, succession(job=f"job{index}"))
    coordinator.on_message(A, msgspec.structs.replace(join(0, world_size=1), job="job0"))
    assert isinstance(recorder.take()[0][1], PeerSetup)  # forgotten: forms here
    coordinator.on_message(A, msgspec.structs.replace(join(0), job=f"job{MAX_REDIRECTS + 9}"))
    assert isinstance(recorder.take()[0][1], PeerRedirect)


def test_a_redirect_is_not_for_a_coordinator_and_round_trips() -> None:
    from commd.coordinator.validation import NOT_FOR_A_COORDINATOR

    assert "peer_redirect" in NOT_FOR_A_COORDINATOR
    assert "peer_succession" not in NOT_FOR_A_COORDINATOR
    for message in (succession(), PeerRedirect(job=JOB, coordinator=NEW)):
        assert peer_codec.decode(encode(message)) == message
