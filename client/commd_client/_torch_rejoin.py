"""A rank that joins a running ``fault_tolerance="continue"`` job gets its training state from
a live peer, through commd.

The state is one ``torch.save`` of the module's parameters and buffers, every object given to
``register_state`` (its ``state_dict()``) and the step the job is at. It travels through two
short jobs of two ranks, the source (rank 0 there) and the joiner (rank 1), on one node or
two: one element for its length, then its bytes, four to a float64 (exact: every uint32
is). The source is the
lowest rank that was in the job before the change; it gives the state from inside its
``wait`` for the iteration the joiner completes, when its parameters have had exactly the
updates the joiner's first step needs.

The joiner loads it with ``torch.load(weights_only=True)``: tensors and plain containers
only, so a peer cannot make it run code.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import io
import logging
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np
import torch

from commd_protocol import CommdError

from ._torch_common import Endpoint, broadcast_once

_WORD = 4  # bytes per float64 element: a uint32 is exact in float64

logger = logging.getLogger("commd_client")


class Stateful(Protocol):
    """What ``register_state`` takes (an optimizer, a scheduler): an object whose ``state_dict()``
    travels with the training state and that a joiner loads it back into."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> Any: ...


def prepare_to_join() -> None:
    """Load, before this rank can join a running job, what its first training step would load
    lazily. From the join on, the survivors wait for the joiner's first gradients; torch's
    first optimizer constructed in a process imports ``torch._dynamo`` (most of a second on a
    small machine), which would otherwise fall inside that wait. Every rank pays it once
    anyway; here it is paid before the others are stopped for the join."""
    with contextlib.suppress(ImportError):  # a torch build without it: nothing to load
        importlib.import_module("torch._dynamo")


def pack(module: torch.nn.Module, states: Mapping[str, Stateful], step: int) -> bytes:
    """The training state as bytes."""
    payload = {
        "parameters": {name: p.detach() for name, p in module.named_parameters()},
        "buffers": {name: b.detach() for name, b in module.named_buffers()},
        "states": {name: obj.state_dict() for name, obj in states.items()},
        "step": step,
    }
    sink = io.BytesIO()
    torch.save(payload, sink)
    return sink.getvalue()


def unpack(blob: bytes) -> dict[str, Any]:
    try:
        payload = torch.load(io.BytesIO(blob), weights_only=True)
    except Exception as exc:
        raise CommdError(f"commd: the training state from the live peer is unreadable: {exc}") \
            from None
    if not isinstance(payload, dict) or not {"parameters", "buffers", "states", "step"} \
            <= payload.keys():
        raise CommdError("commd: the training state from the live peer is not commd's")
    return payload


def load_module(module: torch.nn.Module, payload: Mapping[str, Any]) -> None:
    """Overwrite the module's parameters and buffers with the peer's; CommdError naming the
    first tensor that differs in name or shape (a joiner with another model)."""
    for kind, named in (("parameters", list(module.named_parameters())),
                        ("buffers", list(module.named_buffers()))):
        theirs: Mapping[str, torch.Tensor] = payload[kind]
        ours = dict(named)
        if list(theirs) != list(ours):
            missing = sorted(set(ours) ^ set(theirs))
            raise CommdError(
                f"commd: this rank's model does not match the running job's: {kind} differ "
                f"({missing[:5]}); every rank must run the same model")
        for name, tensor in ours.items():
            if theirs[name].shape != tensor.shape or theirs[name].dtype != tensor.dtype:
                raise CommdError(
                    f"commd: this rank's model does not match the running job's: {name!r} is "
                    f"{tuple(tensor.shape)} {tensor.dtype} here, {tuple(theirs[name].shape)} "
                    f"{theirs[name].dtype} in the job")
        with torch.no_grad():
            for name, tensor in ours.items():
                tensor.copy_(theirs[name])


def load_state(name: str, obj: Stateful, payload: Mapping[str, Any]) -> None:
    """``obj.load_state_dict`` with the peer's state of ``name``, if it sent one."""
    states: Mapping[str, Any] = payload["states"]
    if name in states:
        obj.load_state_dict(states[name])


def _pair(endpoint: Endpoint, epoch: int, joiner: int, role: int, local: bool,
          coordinator: str) -> Endpoint:
    """The endpoint of one transfer job: the source is its rank 0, the joiner its rank 1.
    ``local``: both are on one node (a replacement for a rank of a node whose other ranks
    live), so the job is one node's two local ranks; else one rank on each of two nodes.
    ``coordinator``: the job's coordinator now, as the daemon says ("": the rank's own), so
    that both sides form at the same one after a takeover, whatever their launch named."""
    return dataclasses.replace(endpoint, job=f"{endpoint.job}.state{epoch}.{joiner}", rank=role,
                               world_size=2, local_rank=role if local else 0,
                               local_world_size=2 if local else 1,
                               fault_tolerance="fail", min_world_size=1,
                               coordinator=coordinator or endpoint.coordinator,
                               helper_of=(endpoint.job, epoch))


def send(endpoint: Endpoint, epoch: int, joiner: int, blob: bytes, *, local: bool,
         coordinator: str = "") -> None:
    """The source's side: ``blob`` to rank ``joiner`` (``local``: on this node)."""
    _exchange(_pair(endpoint, epoch, joiner, 0, local, coordinator), blob)


def receive(endpoint: Endpoint, epoch: int, *, local: bool, coordinator: str = "") -> bytes:
    """The joiner's side: the source's bytes (``local``: the source is on this node)."""
    return _exchange(_pair(endpoint, epoch, endpoint.rank, 1, local, coordinator), None)


def take_state(endpoint: Endpoint, epoch: int, source: int, *, local: bool,
               coordinator: str = "") -> bytes:
    """The joiner's side, failing with what to do: a fault during the hand-over (the
    source lost, or any membership change) fails the transfer at once, and this rank
    with it; the job goes on without it."""
    try:
        return receive(endpoint, epoch, local=local, coordinator=coordinator)
    except CommdError as exc:
        raise CommdError(
            f"commd: rank {endpoint.rank} could not take the running job's training state "
            f"from rank {source}: {exc}; the job goes on without this rank: start it again "
            "to join once more") from None


def give_state(endpoint: Endpoint, epoch: int, joiner: int, blob: bytes, *, local: bool,
               coordinator: str = "") -> None:
    """The source's side, which a fault during the hand-over must not fail: the source
    trains on (the joiner, or the change that failed the transfer, is the job's to handle
    as a membership change), and the failure is logged."""
    try:
        send(endpoint, epoch, joiner, blob, local=local, coordinator=coordinator)
    except CommdError as exc:
        logger.warning("commd: the training state did not reach joining rank %d: %s; this "
                       "rank trains on", joiner, exc)


def _exchange(pair: Endpoint, blob: bytes | None) -> bytes:
    length = torch.tensor([float(len(blob)) if blob is not None else 0.0], dtype=torch.float64)
    broadcast_once(pair, ".size", [("state", length)])
    count = int(length.item())
    words = -(-count // _WORD)
    data = torch.zeros(max(words, 1), dtype=torch.float64)
    if blob is not None:
        padded = blob + b"\0" * (words * _WORD - count)
        data[:words] = torch.from_numpy(np.frombuffer(padded, dtype=np.uint32).astype(np.float64))
    broadcast_once(pair, ".data", [("state", data)])
    return data.numpy()[:words].astype(np.uint32).tobytes()[:count]
