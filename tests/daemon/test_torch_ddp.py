"""commd_client.torch.DistributedDataParallel end to end: real daemons, ranks as processes.

Two daemons serve every test of this file (jobs are isolated by id): starting and stopping
a daemon costs seconds on two cores, and the whole file must stay well under 90 s.

The reference is single-process full-batch training on the union of every rank's data:
averaging the gradients of equal-size batches equals the gradient of the mean loss over the
union, which is what torch DDP computes too.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from ddp_worker import batch, build_model, loss_of, sgd_step
from torch import nn

from commd.testing.daemons import LocalDaemon, gloo_daemons
from commd.testing.processes import finish, start_json_worker
from commd_client import Client, CommdError
from commd_client._torch_common import check_cpu
from commd_client.torch import DistributedDataParallel

WORKER = str(Path(__file__).parents[1] / "ddp_worker.py")
EXAMPLE = str(Path(__file__).parents[2] / "examples" / "train.py")


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[LocalDaemon]]:
    """Two real `commd run` daemons on 127.0.0.1, stopped after the last test."""
    with gloo_daemons(tmp_path_factory.mktemp("ddp-daemons")) as started:
        yield started


def run_ranks(
    tmp_path: Path, nodes: list[Any], ranks_per_node: int, job: str, model: str, *,
    steps: int = 3, accumulate: int = 1, batch_size: int = 4, lr: float = 0.1,
    same_init: bool = False, timeout: float = 60.0, models: dict[int, str] | None = None,
    expect_error: bool = False,
) -> list[dict[str, Any]]:
    world = len(nodes) * ranks_per_node
    processes, outputs = [], []
    for rank in range(world):
        out = tmp_path / f"{job}-rank{rank}.pt"
        spec = {
            "job": job, "rank": rank, "world_size": world,
            "local_rank": rank % ranks_per_node, "local_world_size": ranks_per_node,
            "coordinator": nodes[0].address, "socket": nodes[rank // ranks_per_node].socket,
            "timeout": timeout, "model": (models or {}).get(rank, model), "steps": steps,
            "accumulate": accumulate,
            "batch": batch_size, "lr": lr, "init_seed": 0 if same_init else 100 + rank,
            "out": str(out),
        }
        outputs.append(out)
        processes.append(start_json_worker([sys.executable, WORKER], spec))
    errors = [done.stderr for done in finish(processes, timeout + 30)]
    results = []
    for rank, (process, out) in enumerate(zip(processes, outputs, strict=True)):
        assert process.returncode == 0 and out.exists(), f"rank {rank}: {errors[rank]}"
        result = torch.load(out)
        assert ("error" in result) == expect_error, result.get("traceback")
        results.append(result)
    return results


def reference(model: str, world: int, *, steps: int = 3, accumulate: int = 1,
              batch_size: int = 4, lr: float = 0.1) -> dict[str, torch.Tensor]:
    """Full-batch training from rank 0's initial weights (seed 100) on every rank's data."""
    net = build_model(model, 100)
    for step in range(steps):
        total = sum(
            loss_of(net, model, rank, *batch(model, rank, step, micro, batch_size))
            for rank in range(world) for micro in range(accumulate)
        )
        (total / world).backward()
        sgd_step(list(net.parameters()), lr)
    return {f"module.{k}": v for k, v in net.state_dict().items()}


def assert_identical(results: list[dict[str, Any]]) -> None:
    first = results[0]["state"]
    for result in results[1:]:
        assert first.keys() == result["state"].keys()
        for key, value in first.items():
            assert torch.equal(value, result["state"][key]), f"rank {result['rank']}: {key}"


def assert_matches(state: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert state.keys() == want.keys()
    for key, value in want.items():
        torch.testing.assert_close(state[key], value, atol=1e-5, rtol=0, msg=key)


def test_matches_full_batch_training_and_ranks_are_identical(nodes, tmp_path) -> None:
    """2 daemons x 2 ranks, different data and different initial weights per rank."""
    results = run_ranks(tmp_path, nodes, 2, "ddp-equiv", "small_cnn", steps=4, lr=0.05)
    assert_identical(results)
    assert_matches(results[0]["state"], reference("small_cnn", 4, steps=4, lr=0.05))
    for result in results:  # construction broadcast rank 0's weights (seed 100)
        for key, value in build_model("small_cnn", 100).state_dict().items():
            assert torch.equal(result["initial"][key], value), key


def test_different_initial_weights_and_buffers_end_equal(nodes, tmp_path) -> None:
    """BatchNorm's running statistics are broadcast from rank 0 before each forward."""
    results = run_ranks(tmp_path, nodes, 1, "ddp-bn", "bn", steps=3)
    assert_identical(results)
    assert any(k.endswith("running_mean") for k in results[0]["state"])
    rank0_init = build_model("bn", 100).state_dict()["conv.weight"]
    assert not torch.equal(results[0]["state"]["module.conv.weight"], rank0_init)  # it trained


def test_no_sync_accumulation_matches_ddp(nodes, tmp_path) -> None:
    """Two micro-batches under no_sync, the third synchronises the sum of all three."""
    results = run_ranks(tmp_path, nodes, 1, "ddp-nosync", "mlp", steps=3, accumulate=3)
    assert_identical(results)
    assert_matches(results[0]["state"], reference("mlp", 2, steps=3, accumulate=3))


def test_unused_parameters_do_not_hang(nodes, tmp_path) -> None:
    """``extra`` is used on rank 0 only, ``never`` on no rank: its .grad stays None."""
    results = run_ranks(tmp_path, nodes, 1, "ddp-unused", "branchy", steps=3)
    assert_identical(results)
    assert_matches(results[0]["state"], reference("branchy", 2, steps=3))
    for result in results:
        assert result["grad_none"] == ["never.weight", "never.bias"]


def test_train_example_under_torchrun_environment(nodes) -> None:
    """examples/train.py configured only through the environment torchrun sets."""
    node = nodes[0]
    processes = []
    for rank in range(2):
        env = {
            **os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "COMMD_JOB": "ddp-example",
            "COMMD_SOCKET": node.socket, "COMMD_COORDINATOR": node.address,
        }
        processes.append(subprocess.Popen(
            [sys.executable, EXAMPLE, "--steps", "3", "--batch-size", "4"], env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        ))
    outputs = [done.stdout for done in finish(processes, 50)]
    done = []
    for process, output in zip(processes, outputs, strict=True):
        assert process.returncode == 0, output
        assert "step 3/3 loss" in output, output
        done.append(next(line for line in output.splitlines() if " done: 3 steps" in line))
    checksums = {line.rsplit("params checksum ", 1)[1] for line in done}
    assert len(checksums) == 1, done


class _FakeTensor:
    def __init__(self, device: str) -> None:
        self.device = torch.device(device)


def test_gpu_models_get_a_clear_error() -> None:
    with pytest.raises(CommdError, match="the GPU path is not available yet"):
        check_cpu([("fc.weight", _FakeTensor("cpu")), ("fc.bias", _FakeTensor("cuda:0"))])
    with pytest.raises(CommdError, match=r"'weight' is on meta; the GPU path"):
        DistributedDataParallel(nn.Linear(2, 2, device="meta"), world_size=1)
    with pytest.raises(CommdError, match="device_ids"):
        DistributedDataParallel(nn.Linear(2, 2), device_ids=[0], world_size=1)
    if torch.cuda.is_available():
        with pytest.raises(CommdError, match="'weight' is on cuda:0; the GPU path"):
            DistributedDataParallel(nn.Linear(2, 2).cuda(), world_size=1)


def test_different_models_get_an_error_naming_the_first_differing_layer(nodes, tmp_path) -> None:
    results = run_ranks(tmp_path, nodes, 1, "ddp-mismatch", "mlp", models={1: "branchy"},
                        expect_error=True)
    for result in results:
        assert result["error"].startswith("CommdError: commd: "), result["error"]
        assert "first differing layer is 0: '0.weight'" in result["error"], result["error"]
        assert "'body.weight'" in result["error"]


def test_one_rank_in_process_grads_are_shared_views(nodes) -> None:
    """world size 1 in this process: zero copy, zero_grad(set_to_none), no_sync, state_dict."""
    model = build_model("mlp", 100)
    reference_model = build_model("mlp", 100)
    with DistributedDataParallel(
        model, job="ddp-inproc", rank=0, world_size=1, local_rank=0, local_world_size=1,
        coordinator=nodes[0].address, socket=nodes[0].socket, timeout=20,
    ) as ddp:
        assert list(ddp.state_dict()) == [f"module.{k}" for k in model.state_dict()]
        for step in range(3):
            for micro in range(2):
                x, y = batch("mlp", 0, step, micro, 4)
                context = ddp.no_sync() if micro == 0 else contextlib.nullcontext()
                with context:
                    loss = loss_of(ddp, "mlp", 0, x, y)
                    if micro == 0:  # the forward re-attaches no zeroed views (a pass)
                        assert all(param.grad is None for param in model.parameters())
                    loss.backward()
                loss_of(reference_model, "mlp", 0, x, y).backward()
            flat = ddp._reducer._slots.buckets[0].client.flat
            start, stop = flat.ctypes.data, flat.ctypes.data + flat.nbytes
            for param, want in zip(model.parameters(), reference_model.parameters(), strict=True):
                assert param.grad is not None
                assert start <= param.grad.data_ptr() < stop  # a view of the shared buffer
                torch.testing.assert_close(param.grad, want.grad, atol=1e-6, rtol=0)
            sgd_step(list(model.parameters()), 0.1)  # sets .grad = None, like zero_grad()
            sgd_step(list(reference_model.parameters()), 0.1)
        state = ddp.state_dict()
        ddp.load_state_dict(state)
        assert ddp.module is model
    for param, want in zip(model.parameters(), reference_model.parameters(), strict=True):
        torch.testing.assert_close(param, want, atol=1e-6, rtol=0)


class _Shapes(nn.Module):
    """A conv (4-D weight), a linear (2-D), their biases and a 0-dim parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3)
        self.fc = nn.Linear(4, 3)
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.conv(x).mean(dim=(2, 3))) * self.scale


def test_the_wrapper_registers_each_parameter_by_its_shape(nodes, monkeypatch) -> None:
    """Low-rank compression needs each gradient's matrix view: the wrapper registers every
    parameter by its shape (a 0-dim one by its size, 1), and the gradients are as before."""
    registered: list[list[tuple[str, Any]]] = []
    original = Client.register

    def spy(self: Client, layers: Any, *args: Any, **kwargs: Any) -> Any:
        registered.append(list(layers))
        return original(self, layers, *args, **kwargs)

    monkeypatch.setattr(Client, "register", spy)
    torch.manual_seed(0)
    model, reference_model = _Shapes(), _Shapes()
    reference_model.load_state_dict(model.state_dict())
    x = torch.randn(5, 2, 6, 6)
    with DistributedDataParallel(
        model, job="ddp-shapes", rank=0, world_size=1, local_rank=0, local_world_size=1,
        coordinator=nodes[0].address, socket=nodes[0].socket, timeout=20,
    ) as ddp:
        ddp(x).sum().backward()
        reference_model(x).sum().backward()
        for param, want in zip(model.parameters(), reference_model.parameters(), strict=True):
            assert param.grad is not None
            torch.testing.assert_close(param.grad, want.grad, atol=1e-6, rtol=0)
    (layers,) = registered
    assert layers[0] == ("commd:used", 5)
    assert dict(layers[1:]) == {"conv.weight": (4, 2, 3, 3), "conv.bias": (4,),
                                "fc.weight": (3, 4), "fc.bias": (3,), "scale": 1}


class _MixedDtypes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wide = nn.Linear(3, 4).double()
        self.narrow = nn.Linear(4, 2).to(torch.bfloat16)
        self.frozen = nn.Linear(2, 2)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.frozen(self.narrow(self.wide(x).to(torch.bfloat16)).float())


def test_one_rank_in_process_mixed_dtypes_and_frozen_parameters(nodes) -> None:
    """One job per gradient dtype; parameters that require no gradient are left out."""
    model, reference_model = _MixedDtypes(), _MixedDtypes()
    reference_model.load_state_dict(model.state_dict())
    x = torch.randn(5, 3, dtype=torch.float64)
    with DistributedDataParallel(
        model, job="ddp-mixed", rank=0, world_size=1, local_rank=0, local_world_size=1,
        coordinator=nodes[0].address, socket=nodes[0].socket, timeout=20,
    ) as ddp:
        for _ in range(2):
            ddp(x).sum().backward()
            reference_model(x).sum().backward()
        buckets = ddp._reducer._slots.buckets
        # The dtype of the first gradient ready (the last layer's) gets the plain job id.
        assert [b.client.job for b in buckets] == ["ddp-mixed", "ddp-mixed.grads-float64"]
        assert sum(len(b.params) for b in buckets) == 4  # wide and narrow, weight and bias
        for param, want in zip(model.parameters(), reference_model.parameters(), strict=True):
            if param.requires_grad:
                torch.testing.assert_close(param.grad, want.grad)
            else:
                assert param.grad is None


_EXIT_WITHOUT_CLOSE = """
import os, sys, weakref, torch
from commd_client.torch import DistributedDataParallel
class Anchor: pass
anchor, buffers = Anchor(), []
# At exit, finalizers run newest first: this older one runs after the wrapper's own.
weakref.finalize(anchor, lambda: print("closed", all(
    buffer._fd < 0 for buffer in buffers), flush=True))
model = DistributedDataParallel(torch.nn.Linear(3, 2), job="ddp-atexit", rank=0, world_size=1,
                                local_rank=0, local_world_size=1, coordinator=sys.argv[1],
                                socket=sys.argv[2], timeout=20)
model(torch.ones(4, 3)).sum().backward()
buffers.append(model._reducer._slots.buckets[0].client._host_buffer)
print("grads", sum(1 for p in model.parameters() if p.grad is not None), flush=True)
"""


def test_exit_without_close_releases_the_buffer(nodes) -> None:
    """The wrapper closes itself at interpreter exit, before the process is gone."""
    done = subprocess.run(
        [sys.executable, "-c", _EXIT_WITHOUT_CLOSE, nodes[0].address, nodes[0].socket],
        capture_output=True, text=True, timeout=25,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["grads", "2", "closed", "True"], done.stdout


def _train_in_process(nodes: list[LocalDaemon], job: str, compression: str,
                      make_optimizer: Any, steps: int = 6,
                      ran_dense: list[bool] | None = None) -> tuple[nn.Module, nn.Module]:
    """One rank through commd with ``compression``, and the same training without DDP.
    With ``ran_dense``: whether each iteration ran dense goes there (and the next one's
    momentum correction must rest, sending no velocities, exactly after two dense ones in a
    row), and the training ends early, once five iterations in a row ran dense."""
    model, reference = build_model("mlp", 7), build_model("mlp", 7)
    with DistributedDataParallel(
        model, job=job, rank=0, world_size=1, local_rank=0, local_world_size=1,
        coordinator=nodes[0].address, socket=nodes[0].socket, timeout=20,
        compression=compression,
    ) as ddp:
        optimizer, reference_optimizer = (make_optimizer(model.parameters()),
                                          make_optimizer(reference.parameters()))
        for step in range(steps):
            x, y = batch("mlp", 0, step, 0, 8)
            for net, opt in ((ddp, optimizer), (reference, reference_optimizer)):
                opt.zero_grad()
                loss_of(net, "mlp", 0, x, y).backward()
                opt.step()
            if ran_dense is not None:
                correction = ddp._reducer.correction
                assert correction is not None
                dense = ddp._reducer._slots.buckets[0].client.ran_dense
                rests = dense and bool(ran_dense) and ran_dense[-1]  # two dense in a row
                assert correction.sending_velocity is not rests  # no passes while resting
                ran_dense.append(dense)
                if ran_dense[-5:] == [True] * 5:
                    break
    return model, reference


def test_topk_under_sgd_momentum_is_momentum_corrected_on_the_rank(nodes) -> None:
    """Top-k under the user's SGD momentum 0.9, corrected on the rank, trains exactly as the
    daemon's momentum correction (``:momentum=0.9``, SGD without momentum) does: the same
    velocity is sparsified and the update is lr·A either way. Uncorrected, error feedback
    under the optimizer's momentum ends elsewhere."""
    def sgd(momentum: float) -> Any:
        return lambda params: torch.optim.SGD(params, lr=0.05, momentum=momentum)

    ranked, _ = _train_in_process(nodes, "ddp-mc-rank", "topk:0.3:allgather", sgd(0.9))
    daemon, _ = _train_in_process(nodes, "ddp-mc-daemon", "topk:0.3:allgather:momentum=0.9",
                                  sgd(0.0))
    for param, want in zip(ranked.parameters(), daemon.parameters(), strict=True):
        torch.testing.assert_close(param, want, atol=1e-5, rtol=1e-4)


def test_the_correction_keeps_momentum_sgd_exact_with_weight_decay(nodes) -> None:
    """Ratio 1 (nothing held back): what goes to commd is the velocity (the optimizer's
    momentum buffer without weight decay), and the weights are momentum SGD's."""
    def sgd(params: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.01)

    model, reference = _train_in_process(nodes, "ddp-momentum", "topk:1", sgd)
    for param, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(param, want, atol=1e-5, rtol=1e-5)


def test_the_correction_rests_while_the_daemon_runs_dense(nodes) -> None:
    """Ratio 1 (``topk:1``, its exchange measured against dense) holds nothing back, so dense
    measures faster and the daemon runs it (from iteration ~22 here): from the second dense
    iteration on the rank hands over its gradients as they are (no velocity passes), and the
    weights stay momentum SGD's through the switch."""
    def sgd(params: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=0.02, momentum=0.9, weight_decay=0.01)

    ran_dense: list[bool] = []
    model, reference = _train_in_process(nodes, "ddp-rests", "topk:1", sgd, steps=200,
                                         ran_dense=ran_dense)
    assert not ran_dense[0] and ran_dense[-5:] == [True] * 5, "".join(
        str(int(d)) for d in ran_dense)  # top-k first, then dense
    for param, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(param, want, atol=1e-5, rtol=1e-5)


def test_topk_under_adam_is_left_to_error_feedback(nodes) -> None:
    """Adam keeps its own moments: nothing is corrected (the gradients go as they are)."""
    def adam(params: Any) -> torch.optim.Optimizer:
        return torch.optim.Adam(params, lr=0.01)

    model, reference = _train_in_process(nodes, "ddp-adam", "topk:1", adam)
    for param, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(param, want, atol=1e-5, rtol=1e-5)


def test_momentum_correction_turns_off_when_a_step_is_missing(nodes, caplog) -> None:
    """Two reductions without a step between: the buffer's image is lost, so the correction
    says so and turns off; training goes on."""
    model = build_model("mlp", 7)
    with DistributedDataParallel(
        model, job="ddp-nostep", rank=0, world_size=1, local_rank=0, local_world_size=1,
        coordinator=nodes[0].address, socket=nodes[0].socket, timeout=20,
        compression="topk:0.5",
    ) as ddp:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        correction = ddp._reducer.correction
        assert correction is not None and correction.active
        for step in range(3):
            x, y = batch("mlp", 0, step, 0, 8)
            loss_of(ddp, "mlp", 0, x, y).backward()
            if step == 0:
                optimizer.step()  # momentum 0.9 learnt; steps 1 and 2 reduce without one
        assert correction.momentum == pytest.approx(0.9)
        assert not correction.active
        assert "two gradient reductions without an optimizer step" in caplog.text
        optimizer.step()
        assert all(torch.isfinite(p).all() for p in model.parameters())


def test_daemon_momentum_with_an_optimizer_momentum_is_named(nodes, caplog) -> None:
    """``:momentum=0.9`` with SGD(momentum=0.9) runs the momentum twice: one warning."""
    def sgd(params: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)

    _train_in_process(nodes, "ddp-double", "topk:0.5:momentum=0.9", sgd, steps=3)
    assert caplog.text.count("so it runs twice") == 1, caplog.text
    caplog.clear()
    _train_in_process(nodes, "ddp-single", "topk:0.5:momentum=0.9",
                      lambda params: torch.optim.SGD(params, lr=0.05), steps=3)
    assert "runs twice" not in caplog.text
