"""The client side of per-step fault tolerance (issue 36), in-process: the options, the
membership epochs, the frameworks' refusal of "continue" and the global identity of one
standalone torchrun per node.

Bad values of every option are refused with a typed error naming the argument or the
variable, before anything connects (the socket in those tests does not exist: a client that
tried to connect would fail differently). The same options against real daemons are in
tests/system/test_fault_tolerance_client.py.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from launcher_env import clear_launcher_variables

from commd_client import Client, CommdTypeError, CommdValueError, env
from commd_client._framework_options import commd_keywords
from commd_client.membership import Membership
from commd_protocol import Done


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    clear_launcher_variables(monkeypatch)


def _nowhere(tmp_path: Path, **keywords: Any) -> Client:
    """A one-rank client whose socket does not exist."""
    given = {"job": "ft", "rank": 0, "world_size": 1, "local_rank": 0, "local_world_size": 1,
             "coordinator": "127.0.0.1:1", "socket": str(tmp_path / "absent.sock"),
             "timeout": 5, **keywords}
    return Client(**given)


# --- options: refused before anything connects ---------------------------------------------------

@pytest.mark.parametrize(("value", "kind"), [
    (1, CommdTypeError), (b"continue", CommdTypeError), (["continue"], CommdTypeError),
    (True, CommdTypeError), ("", CommdValueError), ("CONTINUE", CommdValueError),
    ("restart", CommdValueError), ("x" * 100_000, CommdValueError),
], ids=lambda value: repr(value)[:20])
def test_a_bad_fault_tolerance_argument_is_named(tmp_path: Path, value: Any,
                                                 kind: type[Exception]) -> None:
    with pytest.raises(kind, match=r"^commd: fault_tolerance.*'fail' or 'continue'"):
        _nowhere(tmp_path, fault_tolerance=value)


@pytest.mark.parametrize("raw", ["", "restart", "Continue", " fail", "x" * 10_000])
def test_a_bad_fault_tolerance_variable_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 raw: str) -> None:
    monkeypatch.setenv("COMMD_FAULT_TOLERANCE", raw)
    with pytest.raises(CommdValueError,
                       match=r"^commd: COMMD_FAULT_TOLERANCE=.*'fail' or 'continue'"):
        _nowhere(tmp_path)


@pytest.mark.parametrize(("value", "world", "kind"), [
    (0, 1, CommdValueError), (-1, 4, CommdValueError), (2, 1, CommdValueError),
    (5, 4, CommdValueError), (2**70, 4, CommdValueError), (True, 4, CommdTypeError),
    (1.0, 4, CommdTypeError), ("1", 4, CommdTypeError), ([1], 4, CommdTypeError),
], ids=repr)
def test_a_bad_min_world_size_argument_is_named(tmp_path: Path, value: Any, world: int,
                                                kind: type[Exception]) -> None:
    with pytest.raises(kind, match=r"^commd: min_world_size"):
        _nowhere(tmp_path, world_size=world, min_world_size=value)


@pytest.mark.parametrize("raw", ["0", "-3", "5", "two", "", "1.5", "9" * 5000])
def test_a_bad_min_world_size_variable_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                raw: str) -> None:
    monkeypatch.setenv("COMMD_MIN_WORLD_SIZE", raw)
    with pytest.raises(CommdValueError, match=r"^commd: COMMD_MIN_WORLD_SIZE="):
        _nowhere(tmp_path, world_size=4)


def test_the_defaults_and_the_keywords_over_the_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    assert (env.fault_tolerance(), env.min_world_size(None, 3)) == ("fail", 1)
    monkeypatch.setenv("COMMD_FAULT_TOLERANCE", "continue")
    monkeypatch.setenv("COMMD_MIN_WORLD_SIZE", "2")
    assert (env.fault_tolerance(), env.min_world_size(None, 3)) == ("continue", 2)
    assert (env.fault_tolerance("fail"), env.min_world_size(np.int64(3), 3)) == ("fail", 3)


# --- membership epochs ---------------------------------------------------------------------------

def test_each_change_is_taken_once_and_warned_once(caplog: pytest.LogCaptureFixture) -> None:
    membership = Membership("x", 3)
    assert (membership.epoch, membership.members, membership.world_size) == (0, [0, 1, 2], 3)
    lost = "node 127.0.0.1:41001 (ranks [2]) lost: rank 2 exited"
    with caplog.at_level(logging.WARNING, logger="commd_client"):
        assert not membership.observe(Done(iteration=4))  # no membership: nothing changes
        assert membership.observe(Done(iteration=5, epoch=1, members=[1, 0], change=lost))
        assert not membership.observe(Done(iteration=6, epoch=1))  # told once; later ones bare
        assert not membership.observe(Done(iteration=6, epoch=1, members=[0, 1, 2]))  # repeat
        assert not membership.observe(Done(iteration=7, epoch=0, members=[0, 1, 2]))  # older
    assert (membership.epoch, membership.members, membership.world_size) == (1, [0, 1], 2)
    warnings = [record.getMessage() for record in caplog.records]
    assert warnings == [f"commd: job 'x': membership epoch 1: {lost}; world size 3 -> 2"]


def test_a_quiet_membership_follows_without_warning(caplog: pytest.LogCaptureFixture) -> None:
    membership = Membership("x.buffers", 2)
    membership.log = False
    with caplog.at_level(logging.WARNING, logger="commd_client"):
        assert membership.observe(Done(iteration=1, epoch=1, members=[1]))
    assert membership.members == [1] and not caplog.records


# --- the framework integrations -----------------------------------------------------------------

def test_frameworks_refuse_continue(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning's and Accelerate's own collectives run on torch.distributed's process group,
    which a lost rank stops: "continue" is refused there, from a keyword or the variable."""
    common: dict[str, Any] = {"compression": None, "planner": None, "socket": None,
                              "coordinator": None, "job": None, "commd_timeout": None}
    with pytest.raises(CommdValueError, match=r"^commd: Accelerator: fault_tolerance="):
        commd_keywords("Accelerator", **common, fault_tolerance="continue")
    monkeypatch.setenv("COMMD_FAULT_TOLERANCE", "continue")
    with pytest.raises(CommdValueError, match=r"process group, which a lost rank stops"):
        commd_keywords("CommdDDPStrategy", **common)
    monkeypatch.delenv("COMMD_FAULT_TOLERANCE")
    assert commd_keywords("Accelerator", **common, fault_tolerance="fail",
                          min_world_size=2) == {"min_world_size": 2}
    assert commd_keywords("Accelerator", **common) == {}
    with pytest.raises(CommdValueError, match=r"^commd: Accelerator: fault_tolerance='x'"):
        commd_keywords("Accelerator", **common, fault_tolerance="x")
    with pytest.raises(CommdValueError, match=r"^commd: CommdDDPStrategy: min_world_size=0"):
        commd_keywords("CommdDDPStrategy", **common, min_world_size=0)
    with pytest.raises(CommdTypeError, match=r"^commd: Accelerator: min_world_size must be"):
        commd_keywords("Accelerator", **common, min_world_size="2")


# --- one torchrun --standalone per node: COMMD_NODE_RANK and COMMD_NNODES ---------------------

def _standalone(monkeypatch: pytest.MonkeyPatch, **variables: str) -> None:
    """What torchrun --standalone sets (node-local ranks), plus the given variables."""
    base = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
            "TORCHELASTIC_RUN_ID": "node-own", "COMMD_JOB": "ft-nodes",
            "COMMD_COORDINATOR": "127.0.0.1:1"}
    for name, value in {**base, **variables}.items():
        monkeypatch.setenv(name, value)


def test_the_node_rank_gives_the_global_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    _standalone(monkeypatch, COMMD_NODE_RANK="2", COMMD_NNODES="3")
    who = env.resolve()
    assert (who.rank, who.world_size, who.local_rank, who.local_world_size) == (5, 6, 1, 2)
    assert who.job == "ft-nodes"
    explicit = env.resolve(rank=0, world_size=2)  # keywords still win
    assert (explicit.rank, explicit.world_size) == (0, 2)
    assert env.resolve(rank=0).world_size == 6


@pytest.mark.parametrize(("variables", "says"), [
    ({"COMMD_NODE_RANK": "0"}, "COMMD_NODE_RANK is set but COMMD_NNODES is not"),
    ({"COMMD_NNODES": "2"}, "COMMD_NNODES is set but COMMD_NODE_RANK is not"),
    ({"COMMD_NODE_RANK": "-1", "COMMD_NNODES": "2"}, "COMMD_NODE_RANK=-1 must be between"),
    ({"COMMD_NODE_RANK": "2", "COMMD_NNODES": "2"}, "COMMD_NODE_RANK=2 must be between"),
    ({"COMMD_NODE_RANK": "0", "COMMD_NNODES": "0"}, "COMMD_NNODES 0 is outside"),
    ({"COMMD_NODE_RANK": "0", "COMMD_NNODES": str(2**40)}, "COMMD_NNODES .* is outside"),
    ({"COMMD_NODE_RANK": "one", "COMMD_NNODES": "2"}, "COMMD_NODE_RANK='one' is not an int"),
    ({"COMMD_NODE_RANK": "0", "COMMD_NNODES": ""}, "COMMD_NNODES='' is not an int"),
    ({"COMMD_NODE_RANK": "0", "COMMD_NNODES": "1.5"}, "COMMD_NNODES='1.5' is not an int"),
    ({"COMMD_NODE_RANK": "0", "COMMD_NNODES": "2", "LOCAL_RANK": "2"},
     "LOCAL_RANK=2 must be between 0 and LOCAL_WORLD_SIZE-1"),
    ({"COMMD_NODE_RANK": "0", "COMMD_NNODES": "2", "COMMD_JOB": ""},
     r"COMMD_NNODES is above 1 \(one torchrun.*COMMD_JOB is not set"),
    ({"COMMD_NODE_RANK": "0", "COMMD_NNODES": "2", "COMMD_COORDINATOR": ""},
     r"COMMD_NNODES is above 1 .*COMMD_COORDINATOR is not set"),
], ids=lambda value: str(value)[:50])
def test_bad_node_variables_are_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      variables: dict[str, str], says: str) -> None:
    _standalone(monkeypatch, **variables)
    with pytest.raises(CommdValueError, match=f"^commd: {says}"):
        Client(socket=str(tmp_path / "absent.sock"), timeout=5)


def test_one_node_needs_no_job_or_coordinator(monkeypatch: pytest.MonkeyPatch) -> None:
    _standalone(monkeypatch, COMMD_NODE_RANK="0", COMMD_NNODES="1", COMMD_JOB="",
                COMMD_COORDINATOR="")
    who = env.resolve()
    assert (who.rank, who.world_size, who.job) == (1, 2, "node-own")
