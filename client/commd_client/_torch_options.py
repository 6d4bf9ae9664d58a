"""torch DDP's constructor keywords, read the way they apply to commd.

What has a meaning here is honoured (``process_group``, ``device_mesh``, ``bucket_cap_mb``,
``init_sync``, ``broadcast_buffers`` / ``forward_sync_buffers``, ``find_unused_parameters``);
what only tunes torch's own reducer is accepted and ignored; what cannot be matched on commd's
CPU path is refused with the reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from commd_protocol import CommdError

from ._torch_common import GPU_MESSAGE
from ._torch_identity import default_group

_MIB = 1024 * 1024


@dataclass(frozen=True)
class TorchOptions:
    """The keywords of ``torch.nn.parallel.DistributedDataParallel`` that commd acts on."""

    process_group: Any | None  # None: no torch.distributed group; the environment decides
    planner: str | None
    init_sync: bool
    init_sync_buffers: bool
    forward_sync_buffers: bool


def interpret(
    *,
    device_ids: Sequence[Any] | None,
    output_device: Any,
    broadcast_buffers: bool | None,
    forward_sync_buffers: bool | None,
    init_sync: bool,
    process_group: Any | None,
    device_mesh: Any | None,
    bucket_cap_mb: float | None,
    bucket_cap_mb_list: Sequence[float] | None,
    mixed_precision: Any | None,
    planner: str | None,
) -> TorchOptions:
    if device_ids:
        raise CommdError(f"commd: device_ids={list(device_ids)!r} was given; {GPU_MESSAGE}")
    if output_device is not None and torch.device(output_device).type != "cpu":
        raise CommdError(f"commd: output_device={output_device!r} was given; {GPU_MESSAGE}")
    if mixed_precision is not None:
        raise CommdError(
            "commd: mixed_precision is not supported: commd reduces gradients in their own "
            "dtype; for half precision on the wire use "
            "model.register_comm_hook(None, default_hooks.fp16_compress_hook) (or "
            "bf16_compress_hook), and torch.autocast for a low-precision forward"
        )
    # Which buffers torch 2.13 syncs: forward_sync_buffers wins over the deprecated
    # broadcast_buffers, and only broadcast_buffers=False also skips the buffers at init.
    if forward_sync_buffers is not None:
        forward, at_init = forward_sync_buffers, True
    else:
        forward = at_init = broadcast_buffers if broadcast_buffers is not None else True
    return TorchOptions(
        process_group=_group(process_group, device_mesh),
        planner=planner if planner is not None else _bucket_planner(bucket_cap_mb,
                                                                    bucket_cap_mb_list),
        init_sync=bool(init_sync),
        init_sync_buffers=at_init,
        forward_sync_buffers=bool(forward),
    )


def _group(process_group: Any | None, device_mesh: Any | None) -> Any | None:
    if device_mesh is not None:
        if process_group is not None:
            raise CommdError("commd: pass process_group or device_mesh, not both (as torch)")
        if device_mesh.ndim != 1:
            raise CommdError(
                f"commd: device_mesh has {device_mesh.ndim} dimensions; data parallelism "
                "needs a 1-D mesh (pass mesh['dp'] for the data-parallel dimension)"
            )
        return device_mesh.get_group()
    return process_group if process_group is not None else default_group()


def _bucket_planner(cap_mb: float | None, caps_mb: Sequence[float] | None) -> str | None:
    """torch's bucket size as commd's fixed-size planner: a user who sets it wants it."""
    if cap_mb is None and caps_mb:
        cap_mb = max(caps_mb)  # torch's effective cap for a per-bucket list
    if cap_mb is None:
        return None  # commd's own planner (the daemon's default)
    if isinstance(cap_mb, bool) or not isinstance(cap_mb, int | float) or not cap_mb > 0:
        raise CommdError(f"commd: bucket_cap_mb must be a positive number, got {cap_mb!r}")
    return f"fixed:{max(1, int(cap_mb * _MIB))}"
