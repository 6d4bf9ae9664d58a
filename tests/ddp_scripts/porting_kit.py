"""Helpers the porting scripts share; nothing here depends on which DDP a script imports.

A scenario returns a dict: ``ddp_class`` (the DDP class its script imported), ``params``
(name -> tensor: the final parameters and buffers of the trained modules, which must equal
stock torch DDP's on the same rank), ``buffers`` (which keys of ``params`` are buffers:
BatchNorm's running statistics are updated by each rank's last forward, after the
broadcast, so only the other keys must be equal across ranks), ``values`` (name -> tensor:
other numbers that must equal torch's, e.g. logged losses) and ``info`` (plain values the
test compares between the implementations).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def result(ddp: type, modules: dict[str, nn.Module], *,
           values: dict[str, torch.Tensor] | None = None,
           info: dict[str, Any] | None = None) -> dict[str, Any]:
    """``modules`` maps a key prefix to a trained (plain, unwrapped) module."""
    params, buffers = {}, []
    for prefix, module in modules.items():
        params.update({f"{prefix}{k}": v.detach().clone()
                       for k, v in module.state_dict().items()})
        buffers += [f"{prefix}{name}" for name, _ in module.named_buffers()]
    return {"ddp_class": class_name(ddp), "params": params, "buffers": buffers,
            "values": values or {}, "info": info or {}}
