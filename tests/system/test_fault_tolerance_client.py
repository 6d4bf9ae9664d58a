"""The client side of per-step fault tolerance (issue 36) against real daemons: the options
reach the Register and the job runs, the DDP wrapper's keywords, one standalone torchrun per
node forming one job. The survivors of a real node loss are the daemon side's tests; the
options' refusals, the membership epochs and the node variables, in-process, are in
tests/unit/test_fault_tolerance_options.py.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from launcher_env import clear_launcher_variables, point_at
from torch import nn

from commd.testing.daemons import LocalDaemon, gloo_daemons
from commd.testing.processes import finish, start_json_worker
from commd_client import Client, CommdError, CommdValueError, env
from commd_client._torch_common import Broadcaster, Endpoint
from commd_client.torch import DistributedDataParallel
from commd_protocol import Register


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    clear_launcher_variables(monkeypatch)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalDaemon]:
    with gloo_daemons(tmp_path_factory.mktemp("tolerance"), ("d0",)) as (started,):
        yield started


@pytest.fixture
def where(daemon: LocalDaemon, monkeypatch: pytest.MonkeyPatch) -> LocalDaemon:
    return point_at(daemon, monkeypatch)


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


# --- one torchrun --standalone per node: COMMD_NODE_RANK and COMMD_NNODES ---------------------

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
