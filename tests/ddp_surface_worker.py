"""One rank of tests/daemon/test_ddp_surface.py: torch DDP's surface called as frameworks call it.

Each scenario runs twice in this process, stock torch DDP first, then commd's wrapper, from
the same seeds; the framework code it replays is copied from PyTorch Lightning 2.6 and
Accelerate 1.16 (their sources, not installed here), line for line where it touches DDP.
Writes ``rank<N>.pt`` ({scenario: {impl: result}}) after every scenario.

Usage: python ddp_surface_worker.py OUT_DIR  (torchrun's environment, COMMD_SOCKET, ...)
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import DDPCommHookType, register_ddp_comm_hook

from commd_client.torch import DistributedDataParallel as CommdDDP

IMPLS: dict[str, Callable[..., Any]] = {
    "torch": torch.nn.parallel.DistributedDataParallel, "commd": CommdDDP,
}
STEPS = 3


def build(rank: int) -> nn.Module:
    torch.manual_seed(100 + rank)  # its own seed: the broadcast at construction matters
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))


def batch(rank: int, step: int, part: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + 10 * step + part)
    # each rank's data has its own scale: BatchNorm's statistics differ between ranks
    return (torch.randn(8, 6, generator=gen) * (1 + rank),
            torch.randn(8, 3, generator=gen))


def state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


# --- PyTorch Lightning 2.6, pytorch_lightning/overrides/distributed.py -----------------------

def _find_tensors(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return itertools.chain(*map(_find_tensors, obj))
    if isinstance(obj, dict):
        return itertools.chain(*map(_find_tensors, obj.values()))
    return []


def lightning_prepare_for_backward(model: Any, output: Any) -> None:
    if torch.is_grad_enabled() and model.require_backward_grad_sync:
        model.require_forward_param_sync = True
        args = (list(_find_tensors(output))
                if model.find_unused_parameters and not model.static_graph else [])
        reducer = model.reducer
        reducer._rebuild_buckets()
        reducer.prepare_for_backward(args)
    else:
        model.require_forward_param_sync = False


# --- strategies/strategy.py _ForwardRedirection with strategies/ddp.py's manual hooks ------

def lightning_redirect(wrapper: Any, original: nn.Module, method: Callable[..., Any],
                       *args: Any) -> Any:
    original_forward = original.forward

    def wrapped_forward(*_args: Any, **_kwargs: Any) -> Any:
        original.forward = original_forward  # type: ignore[method-assign]
        out = method(*_args, **_kwargs)
        wrapper.require_backward_grad_sync = False  # on_after_inner_forward (manual opt.)
        return out

    original.forward = wrapped_forward  # type: ignore[method-assign]
    out = wrapper(*args)
    wrapper.require_backward_grad_sync = True  # on_after_outer_forward
    return out


# --- Accelerate 1.16, Accelerator.trigger_sync_in_backward ----------------------------------

@contextlib.contextmanager
def accelerate_trigger_sync_in_backward(model: Any) -> Iterator[None]:
    old_require_backward_grad_sync = model.require_backward_grad_sync
    old_require_forward_param_sync = model.require_forward_param_sync
    model.require_backward_grad_sync = True
    model.require_forward_param_sync = True
    model.reducer.prepare_for_backward([])
    try:
        yield
    finally:
        model.require_backward_grad_sync = old_require_backward_grad_sync
        model.require_forward_param_sync = old_require_forward_param_sync


# --- scenarios ------------------------------------------------------------------------------

def lightning_manual(ddp: Callable[..., Any], rank: int) -> dict[str, Any]:
    """Lightning's manual optimisation: the training step runs inside the wrapper's forward
    (redirected), calls manual_backward (pre_backward = prepare_for_backward) and steps."""
    net = build(rank)
    model = ddp(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    flags = []

    def training_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(net(x), y)
        lightning_prepare_for_backward(model, loss)  # strategy.pre_backward
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    for step in range(STEPS):
        lightning_redirect(model, net, training_step, *batch(rank, step))
        flags.append(model.require_forward_param_sync)
    trained = state(net)
    # back on: the next forward broadcasts rank 0's buffers (eval: BatchNorm keeps them)
    model.require_forward_param_sync = True
    net.eval()
    with torch.no_grad():
        model(batch(rank, 99)[0])
    return {"trained": trained, "synced": state(net), "flags": flags,
            "buffers": [name for name, _ in net.named_buffers()]}


def accelerate_trigger(ddp: Callable[..., Any], rank: int) -> dict[str, Any]:
    """Accelerate's documented trigger_sync_in_backward: two forwards under no_sync, the
    first loss backward locally, the second inside the trigger (it must reduce)."""
    net = build(rank)
    model = ddp(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(STEPS):
        with model.no_sync():
            xa, ya = batch(rank, step, 0)
            xb, yb = batch(rank, step, 1)
            loss_a = F.mse_loss(model(xa), ya)
            loss_b = F.mse_loss(model(xb), yb)
        loss_a.backward()
        with accelerate_trigger_sync_in_backward(model):
            loss_b.backward()
        opt.step()
        opt.zero_grad()
    return {"trained": state(net), "buffers": [name for name, _ in net.named_buffers()]}


def logging_surface(ddp: Callable[..., Any], rank: int) -> dict[str, Any]:
    """What Lightning's teardown and torch's own logging interfaces call."""
    net = build(rank)
    model = ddp(net)
    # torch's own registration helper (what Lightning's ddp_comm_hook and Accelerate's
    # comm_hook options end in): register_comm_hook, and the logger records the hook's name
    register_ddp_comm_hook(DDPCommHookType.ALLREDUCE, model)
    x, y = batch(rank, 0)
    F.mse_loss(model(x), y).backward()
    data = model._get_ddp_logging_data()
    # DDPStrategy.teardown, verbatim
    suggest = bool(not model.static_graph and data.get("can_set_static_graph"))
    model._set_ddp_runtime_logging_sample_rate(5)
    refused = ""
    try:
        model._set_ddp_runtime_logging_sample_rate(0)
    except Exception as exc:  # torch: ValueError through _log_and_throw
        refused = type(exc).__name__
    grads = [p.grad.clone() for p in net.parameters()]
    rebuilt = model.reducer._rebuild_buckets()
    model.reducer._push_all_rebuilt_params()
    if isinstance(model, CommdDDP):  # torch's only runs at the point of its static graph
        model.reducer._delay_all_reduce()
    unchanged = all(torch.equal(g, p.grad) for g, p in zip(grads, net.parameters(), strict=True))
    return {"data": {k: v for k, v in data.items() if isinstance(v, (int, str))},
            "suggest_static_graph": suggest, "refused_rate_0": refused,
            "rebuilt_type": type(rebuilt).__name__, "grads_unchanged": unchanged}


SCENARIOS = {"lightning_manual": lightning_manual, "accelerate_trigger": accelerate_trigger,
             "logging_surface": logging_surface}


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    record: dict[str, dict[str, Any]] = {}
    for name, scenario in SCENARIOS.items():
        record[name] = {}
        for impl, ddp in IMPLS.items():
            try:
                record[name][impl] = scenario(ddp, rank)
            except Exception as exc:
                record[name][impl] = {"error": repr(exc), "traceback": traceback.format_exc()}
                print(f"rank {rank} {name}/{impl}: {exc!r}", flush=True)
            dist.barrier()
            torch.save(record, out / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
