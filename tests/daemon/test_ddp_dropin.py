"""commd's DistributedDataParallel against torch's contract, one rank in this process.

torch's whole constructor signature, ``isinstance``, what is refused and why (with the
reason in the message), comm hooks, the unused-parameter warning, the identity taken from a
torch.distributed process group (a one-rank gloo group on a HashStore, destroyed after each
test) and one job per wrapper. A real daemon serves every test; multi-rank scripts compared
with stock torch DDP are in test_ddp_porting.py.
"""

from __future__ import annotations

import copy
import inspect
import logging
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from launcher_env import point_at
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from commd.testing.daemons import LocalDaemon, gloo_daemons
from commd_client import CommdError
from commd_client._torch_options import interpret
from commd_client.torch import DistributedDataParallel

TORCH_DDP = torch.nn.parallel.DistributedDataParallel


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalDaemon]:
    with gloo_daemons(tmp_path_factory.mktemp("dropin"), ("d0",)) as (started,):
        yield started


@pytest.fixture
def where(daemon: LocalDaemon, monkeypatch: pytest.MonkeyPatch) -> LocalDaemon:
    """A one-rank environment pointing at the daemon (no torchrun variables)."""
    return point_at(daemon, monkeypatch)


@pytest.fixture
def group(where: LocalDaemon) -> Iterator[Any]:
    """A one-rank gloo process group, as init_process_group makes under mp.spawn."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _step(model: nn.Module, x: torch.Tensor) -> None:
    model(x).pow(2).sum().backward()


def test_signature_is_torchs_then_commds_keywords() -> None:
    """Every torch parameter, in torch's order and with torch's defaults; commd's are
    keyword-only after them."""
    ours = list(inspect.signature(DistributedDataParallel.__init__).parameters.values())
    theirs = list(inspect.signature(TORCH_DDP.__init__).parameters.values())
    assert [p.name for p in ours[:len(theirs)]] == [p.name for p in theirs]
    assert [p.default for p in ours[:len(theirs)]] == [p.default for p in theirs]
    assert all(p.kind is p.KEYWORD_ONLY for p in ours[len(theirs):])


def test_isinstance_positional_device_ids_and_attributes(where: LocalDaemon) -> None:
    module = nn.Linear(3, 2)
    with DistributedDataParallel(module, None) as model:
        assert isinstance(model, TORCH_DDP)
        assert model.module is module and model.device_ids is None and model.dim == 0
        assert model.process_group is None  # no torch.distributed group: the environment
        assert model.broadcast_buffers is True
        model._set_static_graph()
        _step(model, torch.ones(4, 3))
        assert module.weight.grad is not None
        with pytest.raises(TypeError, match="cannot be pickled"):
            pickle.dumps(model)


def test_every_torch_keyword_is_accepted(where: LocalDaemon) -> None:
    with DistributedDataParallel(
        nn.Linear(3, 2), None, None, 0, True, True, None, 1, True, False, True, False,
        None, None, None, None, False, None, False, None,
    ) as model:
        _step(model, torch.ones(4, 3))
        assert model._reducer.planner == f"fixed:{1024 * 1024}"  # bucket_cap_mb=1


def _options(**given: Any) -> Any:
    keywords: dict[str, Any] = {
        "device_ids": None, "output_device": None, "broadcast_buffers": None,
        "forward_sync_buffers": None, "init_sync": True, "process_group": None,
        "device_mesh": None, "bucket_cap_mb": None, "bucket_cap_mb_list": None,
        "mixed_precision": None, "planner": None,
    }
    return interpret(**{**keywords, **given})


def test_buffer_flags_follow_torch_2_13() -> None:
    assert (_options().forward_sync_buffers, _options().init_sync_buffers) == (True, True)
    old = _options(broadcast_buffers=False)
    assert (old.forward_sync_buffers, old.init_sync_buffers) == (False, False)
    new = _options(broadcast_buffers=True, forward_sync_buffers=False)
    assert (new.forward_sync_buffers, new.init_sync_buffers) == (False, True)


def test_bucket_sizes_become_the_fixed_planner_unless_a_planner_is_given() -> None:
    assert _options(bucket_cap_mb=25).planner == f"fixed:{25 * 1024 * 1024}"
    assert _options(bucket_cap_mb_list=[1, 4]).planner == f"fixed:{4 * 1024 * 1024}"
    assert _options(bucket_cap_mb=25, planner="wfbp").planner == "wfbp"
    assert _options().planner is None


class _Mesh:
    def __init__(self, ndim: int) -> None:
        self.ndim = ndim

    def get_group(self) -> str:
        return "the mesh's group"


def test_a_one_dimensional_device_mesh_gives_its_group() -> None:
    assert _options(device_mesh=_Mesh(1)).process_group == "the mesh's group"


@pytest.mark.parametrize(("given", "says"), [
    ({"device_ids": [0]}, "device_ids=[0]"),
    ({"output_device": "cuda:0"}, "output_device='cuda:0'"),
    ({"mixed_precision": object()}, "fp16_compress_hook"),
    ({"device_mesh": _Mesh(2)}, "1-D mesh"),
    ({"device_mesh": _Mesh(1), "process_group": object()}, "not both"),
    ({"bucket_cap_mb": -1}, "positive number"),
    ({"bucket_cap_mb": "25"}, "positive number"),
    ({"bucket_cap_mb": True}, "positive number"),
])
def test_what_cannot_be_matched_is_refused_with_the_reason(given: dict[str, Any],
                                                           says: str) -> None:
    with pytest.raises(CommdError, match=says.replace("[", r"\[").replace("]", r"\]")):
        _options(**given)


def test_fp16_hook_reduces_in_half_precision(where: LocalDaemon) -> None:
    """One rank: the reduced gradient is the local one rounded to float16, back in float32."""
    module, reference = nn.Linear(5, 3), nn.Linear(5, 3)
    reference.load_state_dict(module.state_dict())
    x = torch.randn(4, 5) * 3
    with DistributedDataParallel(module) as model:
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        for _ in range(2):
            module.zero_grad()
            reference.zero_grad()
            _step(model, x)
            _step(reference, x)
            for param, want in zip(module.parameters(), reference.parameters(), strict=True):
                assert param.grad is not None and param.grad.dtype == torch.float32
                torch.testing.assert_close(param.grad, want.grad.half().float(), rtol=0, atol=0)
        assert model._reducer._slots.buckets[0].flags.dtype == torch.float16
        with pytest.raises(CommdError, match="only be called once"):
            model.register_comm_hook(None, default_hooks.allreduce_hook)


def test_a_hook_after_the_first_backward_is_refused(where: LocalDaemon) -> None:
    with DistributedDataParallel(nn.Linear(3, 2)) as model:
        _step(model, torch.ones(2, 3))
        with pytest.raises(CommdError, match="before the first backward"):
            model.register_comm_hook(None, default_hooks.bf16_compress_hook)


def test_the_powersgd_hook_runs_as_the_daemons_powersgd(where: LocalDaemon) -> None:
    """torch's powerSGD_hook with its state becomes the daemon's PowerSGD: dense before
    start_powerSGD_iter, then a rank-1 approximation of the weight (one rank, so the result
    is exactly P Qᵀ of the rank's gradient plus its error), the bias exact."""
    torch.manual_seed(0)
    module = nn.Linear(16, 12)
    reference = copy.deepcopy(module)
    state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=1,
                                        start_powerSGD_iter=2)
    x = torch.randn(8, 16)
    with DistributedDataParallel(module) as model:
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        assert model._reducer.compression is not None
        assert model._reducer.compression.startswith("powersgd:1:start=2:")
        for step in range(4):
            module.zero_grad()
            reference.zero_grad()
            _step(model, x)
            _step(reference, x)
            weight, want = module.weight.grad, reference.weight.grad
            assert weight is not None and want is not None
            if step < 2:
                torch.testing.assert_close(weight, want, rtol=0, atol=0)
            else:
                assert torch.linalg.matrix_rank(weight).item() == 1
                assert not torch.allclose(weight, want, atol=1e-4)
            torch.testing.assert_close(module.bias.grad, reference.bias.grad)


def test_powersgd_needs_its_state(where: LocalDaemon) -> None:
    with DistributedDataParallel(nn.Linear(3, 2), compression="topk:0.1") as model:
        with pytest.raises(CommdError, match="PowerSGDState"):
            model.register_comm_hook(None, powerSGD_hook.powerSGD_hook)
        state = powerSGD_hook.PowerSGDState(None, start_powerSGD_iter=2)
        with pytest.raises(CommdError, match=r"on top of compression='topk:0\.1'"):
            model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)


@pytest.mark.parametrize(("hook", "says"), [
    (powerSGD_hook.batched_powerSGD_hook, "no counterpart"),
    (lambda state, bucket: bucket.buffer(), "cannot run in commd's daemon"),
    ("not callable", "needs a callable"),
])
def test_hooks_commd_cannot_run_are_refused(where: LocalDaemon, hook: Any, says: str) -> None:
    with DistributedDataParallel(nn.Linear(3, 2)) as model:
        with pytest.raises(CommdError, match=says.replace("(", r"\(").replace(")", r"\)")):
            model.register_comm_hook(None, hook)
        _step(model, torch.ones(2, 3))  # still usable, as if nothing was registered


class _TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(3, 2)
        self.spare = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def test_unused_parameters_are_named_once_when_torch_would_raise(
    where: LocalDaemon, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="commd_client")
    with DistributedDataParallel(_TwoHeads()) as model:
        for _ in range(3):
            _step(model, torch.ones(2, 3))
    warnings = [r.getMessage() for r in caplog.records if "got no gradient" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "'spare.weight', 'spare.bias'" in warnings[0]
    assert "find_unused_parameters=True" in warnings[0]
    caplog.clear()
    with DistributedDataParallel(_TwoHeads(), find_unused_parameters=True) as model:
        _step(model, torch.ones(2, 3))
    assert not [r for r in caplog.records if "got no gradient" in r.getMessage()]


def test_join_needs_a_process_group(where: LocalDaemon) -> None:
    with DistributedDataParallel(nn.Linear(3, 2)) as model, \
            pytest.raises(CommdError, match="init_process_group"):
        model.join()


def test_identity_comes_from_the_process_group(group: Any) -> None:
    """Rank, world and local ranks from the group; a fresh job id per wrapper (rank 0's), and
    with a chosen job id each further wrapper in the process gets ``.ddpN``."""
    first = DistributedDataParallel(nn.Linear(3, 2))
    second = DistributedDataParallel(nn.Linear(3, 2))
    try:
        assert first.process_group is group
        assert (first.endpoint.rank, first.endpoint.world_size) == (0, 1)
        assert (first.endpoint.local_rank, first.endpoint.local_world_size) == (0, 1)
        assert first.endpoint.job.startswith("default-")
        # Rank 0's random suffix per wrapper: a new job each time, the same on every rank.
        assert second.endpoint.job.startswith("default-")
        assert second.endpoint.job != first.endpoint.job
        _step(first, torch.ones(2, 3))
        _step(second, torch.ones(2, 3))
    finally:
        first.close()
        second.close()
    again = DistributedDataParallel(nn.Linear(3, 2), job="named")
    again.close()
    rewrapped = DistributedDataParallel(nn.Linear(3, 2), job="named")
    try:
        assert rewrapped.endpoint.job == "named.ddp1"  # a new job, not the closed one's id
        _step(rewrapped, torch.ones(2, 3))
    finally:
        rewrapped.close()


@pytest.mark.parametrize(("variable", "value", "says"), [
    ("RANK", "1", "RANK=1 in the environment"),
    ("WORLD_SIZE", "4", "WORLD_SIZE=4 in the environment"),
])
def test_environment_contradicting_the_group_fails_loudly(
    group: Any, monkeypatch: pytest.MonkeyPatch, variable: str, value: str, says: str
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(CommdError, match=says):
        DistributedDataParallel(nn.Linear(3, 2))


@pytest.mark.parametrize("keyword", [{"rank": 2}, {"world_size": 3}, {"local_rank": 1},
                                     {"local_world_size": 2}])
def test_keywords_contradicting_the_group_fail_loudly(group: Any,
                                                      keyword: dict[str, int]) -> None:
    name = next(iter(keyword))
    with pytest.raises(CommdError, match=f"{name}=.* the torch.distributed process group"):
        DistributedDataParallel(nn.Linear(3, 2), **keyword)


def test_a_group_this_process_is_not_in_is_refused(group: Any, tmp_path: Path) -> None:
    class _Elsewhere:
        pass

    with pytest.raises((CommdError, ValueError, RuntimeError)):
        DistributedDataParallel(nn.Linear(3, 2), process_group=_Elsewhere())
