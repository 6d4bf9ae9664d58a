"""Uneven inputs: torch's ``Join`` context manager with commd's wrapper.

torch's protocol, kept step for step so that ``model.join()`` and ``Join([model, ...])``
behave as with torch DDP: every forward of a rank that still has data announces itself
(``Join.notify_join_context``: an all-reduce of ones on the process group), says whether its
backward will synchronise, and picks the rank whose buffers count; a rank out of data answers
each of these from the join loop and shadows the gradient reduction with zeros (commd's job,
so nobody hangs). When every rank has joined, the last one to join broadcasts its model.

The small control all-reduces go over torch.distributed's process group, as torch's do (join
needs one); the tensors go through commd.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import JoinHook


class JoinParticipant(Protocol):
    """What torch's join protocol asks of commd's wrapper (``DistributedDataParallel``)."""

    require_forward_param_sync: bool  # torch DDP's: whether the next forward syncs

    @property
    def join_process_group(self) -> Any: ...

    @property
    def join_rank(self) -> int: ...

    def will_sync_module_buffers(self) -> bool: ...

    def sync_buffers_from(self, source: int) -> None:
        """Every rank takes rank ``source``'s synced buffers."""
        ...

    def take_model_from(self, source: int) -> None:
        """Every rank takes rank ``source``'s parameters (and synced buffers)."""
        ...

    def shadow_reduction(self) -> None:
        """Take part in the others' gradient reduction with zeros."""
        ...


class DdpJoinHook(JoinHook):
    """What a joined rank does while others train, and once all have joined."""

    def __init__(self, ddp: JoinParticipant) -> None:
        self.ddp = ddp

    def main_hook(self) -> None:
        ddp, group = self.ddp, self.ddp.join_process_group
        if ddp.will_sync_module_buffers():
            ddp.sync_buffers_from(common_rank(group, ddp.join_rank, False))
        sync = announce_sync(group, None)
        ddp.require_forward_param_sync = sync
        if sync:
            ddp.shadow_reduction()

    def post_hook(self, is_last_joiner: bool) -> None:
        ddp = self.ddp
        ddp.take_model_from(common_rank(ddp.join_process_group, ddp.join_rank, is_last_joiner))


def common_rank(group: Any, rank: int, candidate: bool) -> int:
    """The highest rank among the candidates (torch DDP's ``_find_common_rank``)."""
    value = torch.tensor([rank if candidate else -1])
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    chosen = int(value.item())
    if chosen < 0:
        raise RuntimeError("commd: no rank qualified in torch's Join protocol")
    return chosen


def announce_sync(group: Any, will_sync: bool | None) -> bool:
    """Tell joined ranks whether this iteration's backward synchronises (``will_sync`` None:
    this rank has joined and asks); returns whether any rank still training will."""
    flag = torch.ones(1) if will_sync else torch.zeros(1)
    work = dist.all_reduce(flag, group=group, async_op=True)
    work.wait()
    return bool(flag.item() != 0)


def rescale_by_active(work: Any, params: list[torch.nn.Parameter], world_size: int) -> None:
    """``divide_by_initial_world_size=False``: commd averaged over every rank, joined ones
    with zeros; divide by the ranks still training instead (``work``: Join's count)."""
    work.wait()
    active = int(work.result()[0].item())
    if 0 < active < world_size:
        with torch.no_grad():
            for param in params:
                if param.grad is not None:
                    param.grad.mul_(world_size / active)
