"""The client side of per-step fault tolerance (issue 36): the options, the membership
epochs, the DDP wrapper's keywords and the global identity of one standalone torchrun per node.

Bad values of every option are refused with a typed error naming the argument or the
variable, before anything connects (the socket in those tests does not exist: a client that
tried to connect would fail differently). Real daemons serve the rest; the survivors of a real
node loss are the daemon side's tests.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from commd.testing.daemons import LocalDaemon
from commd.testing.processes import finish, start_json_worker
from commd_client import Client, CommdError, CommdTypeError, CommdValueError, env
from commd_client._framework_options import commd_keywords
from commd_client._torch_common import Broadcaster, Endpoint
from commd_client.membership import Membership
from commd_client.torch import DistributedDataParallel
from commd_protocol import Done, Register

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "COMMD_JOB",
                      "COMMD_COORDINATOR", "COMMD_SOCKET", "TORCHELASTIC_RUN_ID",
                      "MASTER_ADDR", "MASTER_PORT", "COMMD_FAULT_TOLERANCE",
                      "COMMD_MIN_WORLD_SIZE", "COMMD_NODE_RANK", "COMMD_NNODES")


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """No torchrun or commd variable of the shell running the tests leaks in."""
    for name in TORCHRUN_VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalDaemon]:
    started = LocalDaemon(tmp_path_factory.mktemp("tolerance"), "d0", "--backend", "gloo")
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture
def where(daemon: LocalDaemon, monkeypatch: pytest.MonkeyPatch) -> LocalDaemon:
    """A one-rank environment pointing at the daemon."""
    monkeypatch.setenv("COMMD_SOCKET", daemon.socket)
    monkeypatch.setenv("COMMD_COORDINATOR", daemon.address)
    monkeypatch.setenv("COMMD_TIMEOUT", "20")
    return daemon


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


def test_continue_on_a_device_buffer_is_refused_at_register(where: LocalDaemon) -> None:
    """The daemon serves "continue" for host buffers only: said before any allocation."""
    with Client(job="ft-device", rank=0, world_size=1, local_rank=0, local_world_size=1,
                fault_tolerance="continue") as client, \
            pytest.raises(CommdValueError, match=r"register\(device='cuda'\).*host \(CPU\)"):
        client.register([("w", 4)], device="cuda")


# --- a real daemon: the options reach the Register, and the job runs ---------------------------

def _sent_registers(client: Client) -> list[Register]:
    """Records what the client sends (still sent to the real daemon)."""
    sent: list[Register] = []
    send = client._connection.send

    def recording(message: Any) -> None:
        if isinstance(message, Register):
            sent.append(message)
        send(message)

    client._connection.send = recording  # type: ignore[method-assign]
    return sent


@pytest.mark.parametrize("through", ["keywords", "environment"])
def test_a_fault_tolerant_job_forms_and_runs(where: LocalDaemon, monkeypatch: pytest.MonkeyPatch,
                                             through: str) -> None:
    keywords: dict[str, Any] = {"fault_tolerance": "continue", "min_world_size": 1}
    if through == "environment":
        monkeypatch.setenv("COMMD_FAULT_TOLERANCE", "continue")
        monkeypatch.setenv("COMMD_MIN_WORLD_SIZE", "1")
        keywords = {}
    with Client(job=f"ft-{through}", rank=0, world_size=1, local_rank=0, local_world_size=1,
                **keywords) as client:
        sent = _sent_registers(client)
        grads = client.register([("w", 4), ("b", 2)], op="avg")
        for step in range(3):
            grads[0][:] = step
            grads[1][:] = -step
            client.ready([1, 0])
            client.wait()
            assert grads[0].tolist() == [step] * 4 and grads[1].tolist() == [-step] * 2
        assert [(r.fault_tolerance, r.min_world_size) for r in sent] == [("continue", 1)]
        assert (client.epoch, client.members, client.world_size) == (0, [0], 1)
        assert client.initial_world_size == 1


def test_the_default_is_fail(where: LocalDaemon) -> None:
    with Client(job="ft-default", rank=0, world_size=1, local_rank=0, local_world_size=1) as client:
        sent = _sent_registers(client)
        client.register([("w", 4)])
        assert [(r.fault_tolerance, r.min_world_size) for r in sent] == [("fail", 1)]


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


# --- the DDP wrapper ----------------------------------------------------------------------------

def _train(fault_tolerance: str | None) -> tuple[list[torch.Tensor], Any]:
    torch.manual_seed(7)
    module = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    keywords = {} if fault_tolerance is None else {"fault_tolerance": fault_tolerance}
    with DistributedDataParallel(module, **keywords) as model:
        for step in range(4):
            x = torch.randn(16, 5, generator=torch.Generator().manual_seed(step))
            optimizer.zero_grad()
            model(x).pow(2).mean().backward()
            optimizer.step()
        gradient_client = model._reducer._slots.buckets[0].client
        seen = (model.world_size, model.members, gradient_client.fault_tolerance)
    return [p.detach().clone() for p in module.parameters()], seen


def test_one_rank_trains_alike_with_continue_and_fail(where: LocalDaemon) -> None:
    tolerant, seen = _train("continue")
    strict, default = _train(None)
    assert seen == (1, [0], "continue") and default == (1, [0], "fail")
    assert all(torch.equal(a, b) for a, b in zip(tolerant, strict, strict=True))


@pytest.mark.parametrize(("keywords", "variables", "names"), [
    ({"fault_tolerance": "sometimes"}, {}, "fault_tolerance"),
    ({"fault_tolerance": 0}, {}, "fault_tolerance"),
    ({"min_world_size": 2}, {}, "min_world_size"),
    ({}, {"COMMD_FAULT_TOLERANCE": "yes"}, "COMMD_FAULT_TOLERANCE"),
    ({}, {"COMMD_MIN_WORLD_SIZE": "many"}, "COMMD_MIN_WORLD_SIZE"),
], ids=["unknown", "int", "above-world", "bad-variable", "bad-min-variable"])
def test_the_wrapper_refuses_bad_options(where: LocalDaemon, monkeypatch: pytest.MonkeyPatch,
                                         keywords: dict[str, Any], variables: dict[str, str],
                                         names: str) -> None:
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(CommdError, match=f"^commd: {names}"):
        DistributedDataParallel(nn.Linear(3, 2), **keywords)


def test_only_the_per_step_broadcast_takes_the_tolerance(where: LocalDaemon) -> None:
    """The constructor's jobs keep failing as torch's; the buffer broadcast and the gradient
    jobs continue, and a broadcast source that is not a member gives way to the lowest live
    rank (here the only one)."""
    endpoint = Endpoint(**env.resolve(job="ft-broadcast").__dict__, timeout=20.0,
                        fault_tolerance="continue", min_world_size=1)
    values = torch.arange(4, dtype=torch.float32)
    construction = Broadcaster(endpoint, ".order", [("v", values)])
    per_step = Broadcaster(endpoint, ".buffers", [("v", values)], tolerant=True)
    try:
        assert construction.client.fault_tolerance == "fail"
        assert per_step.client.fault_tolerance == "continue"
        # only the gradient job's client warns of a change: once per rank, not per job
        assert not per_step.client.membership.log
        with endpoint.open() as gradients, endpoint.open(".grads-float64") as other_dtype:
            assert gradients.membership.log and not other_dtype.membership.log
            assert other_dtype.fault_tolerance == "continue"
        per_step.run([("v", values)], source=3)  # rank 3 is no member: rank 0 is the source
        assert values.tolist() == [0.0, 1.0, 2.0, 3.0]
    finally:
        construction.close()
        per_step.close()


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


_NODE_WORKER = """
import json, sys
from commd_client import Client
with Client() as client:
    grads = client.register([("w", 3)], op="sum")
    grads[0][:] = client.rank + 1
    client.ready(0)
    client.wait()
    print(json.dumps({"rank": client.rank, "world_size": client.world_size,
                      "sum": grads[0].tolist()}))
"""


def test_one_standalone_launch_per_node_forms_one_job(start_daemon: Any, tmp_path: Path) -> None:
    """Each node's process sees torchrun --standalone's node-local RANK=0, WORLD_SIZE=1 (and
    its own run id); with COMMD_NODE_RANK and COMMD_NNODES they form one two-rank job."""
    nodes = [start_daemon(), start_daemon()]
    processes = []
    try:
        for node, daemon in enumerate(nodes):
            variables = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                         "LOCAL_WORLD_SIZE": "1", "TORCHELASTIC_RUN_ID": f"run-{node}",
                         "COMMD_NODE_RANK": str(node), "COMMD_NNODES": "2",
                         "COMMD_JOB": "ft-standalone", "COMMD_COORDINATOR": nodes[0].address,
                         "COMMD_SOCKET": daemon.socket, "COMMD_TIMEOUT": "60"}
            processes.append(start_json_worker([sys.executable, "-c", _NODE_WORKER], {},
                                               env=variables))
        finished = finish(processes, 90)
    finally:
        for process in processes:
            process.kill()
            process.wait()
    results = [done.last_json() for done in finished]
    assert [(r["rank"], r["world_size"]) for r in results] == [(0, 2), (1, 2)], \
        [done.stderr for done in finished]
    assert all(r["sum"] == [3.0, 3.0, 3.0] for r in results)


def test_a_process_group_under_one_torchrun_per_node_is_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Under one torchrun --standalone per node a process group is the node's own: taking
    the job from it would train each node alone, so the wrapper refuses, naming why."""
    import torch.distributed as dist

    from commd.testing.ports import free_port

    monkeypatch.setenv("COMMD_NNODES", "2")
    monkeypatch.setenv("COMMD_NODE_RANK", "0")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        with pytest.raises(CommdError, match=r"COMMD_NNODES is set .* init_process_group"):
            DistributedDataParallel(torch.nn.Linear(2, 2))
    finally:
        dist.destroy_process_group()
