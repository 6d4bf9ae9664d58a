"""Momentum correction for top-k under the user's own SGD momentum (docs/design/compression.md).

Top-k with error feedback holds a gradient back and sends it late in one piece; an optimizer
with momentum then multiplies that lump again, and training runs behind momentum SGD's. Deep
Gradient Compression moves the momentum before the sparsification. This does it without
touching the optimizer: once the wrapped parameters are seen stepped by ``torch.optim.SGD``
with momentum ``m`` (dampening 0, no Nesterov), each rank

- hands commd its velocity ``u = m·u + g`` instead of ``g`` (the node sum of the ranks'
  velocities is the node's velocity: momentum is linear), and
- turns the reduced sum ``A`` back into ``g' = A − m·b``, where ``b`` is what the
  optimizer's momentum buffer holds (less weight decay's part), so the optimizer's own
  momentum step ``b ← m·b + g'`` makes it ``A``: the update is ``lr·A``, DGC's.

Without weight decay ``b`` is the optimizer's momentum buffer itself, read where it lies
(no copy, no pass); once a step has weight decay, ``b`` is followed here in torch's step
pre-hook (``b ← m·b + g'``, one pass), starting from the buffer as it is then.

The optimizer, its state dict, learning-rate and momentum schedules stay as they are; weight
decay keeps its momentum, as in momentum SGD. The first backward runs before any optimizer
step: ``u`` starts at zero, so ``u = g`` there whatever ``m`` turns out to be.

While the daemon runs every group dense it costs nothing: the exchange is exact, so the
velocities' average is the optimizer's buffer and sending the gradients as they are gives the
same update (momentum SGD's). Whether an iteration ran dense comes back with its ``done``,
the same on every rank (all nodes switch plans at one iteration), and decides what the next
iteration sends: after two dense ones in a row the gradients as they are, uncorrected;
otherwise the velocities, started again from the buffer's image ``b`` after resting (the
average of the ranks' velocities there; only their split between ranks is not followed).
The daemon says dense only for an iteration that sent none of what top-k held back: it
releases that a share per dense iteration, and corrected, each share is applied once
(``lr·A``); left in the optimizer's buffer, its momentum would apply it 1/(1 − m) times
(the loss jumped at every switch to dense). Two in a row, so that the buffer the optimizer
goes on from is a velocity that carried none of it.

It switches itself off (and says so once) where the invariant cannot hold: another optimizer
(Adam keeps its own moments), Nesterov, dampening or maximize, several momenta, not all of
the wrapped parameters in one optimizer, or a reduction without a step after it (or a step
without one).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

logger = logging.getLogger("commd_client")

__all__ = ["DoubleMomentumCheck", "MomentumCorrection", "StepHook", "step_hook_for"]


def _ours(ids: set[int], optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The optimizer's parameter groups that hold any of the parameters ``ids``."""
    return [g for g in optimizer.param_groups if ids & {id(p) for p in g["params"]}]


class StepHook:
    """torch's global optimizer step pre-hook for the wrapped parameters, held by a weak
    reference (a collected wrapper leaves no hook behind); ``close`` removes it."""

    def __init__(self, params: Sequence[torch.nn.Parameter]) -> None:
        self.params = params
        self._ids = {id(p) for p in params}
        me = weakref.ref(self)

        def hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            this = me()
            if this is not None:
                this.before_step(optimizer)

        self._handle: RemovableHandle | None = register_optimizer_step_pre_hook(hook)

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        raise NotImplementedError

    def close(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


def step_hook_for(params: Sequence[torch.nn.Parameter],
                  compression: str | None) -> StepHook | None:
    """Top-k without the daemon's momentum: the rank's correction; with ``:momentum=M``: the
    check that the optimizer has none of its own; anything else: None."""
    text = (compression or "").strip()
    if not text.startswith("topk:"):
        return None
    return DoubleMomentumCheck(params) if ":momentum=" in text else MomentumCorrection(params)


class DoubleMomentumCheck(StepHook):
    """``:momentum=M``: the daemon keeps the momentum, so an optimizer with its own would run
    it twice (a 1/(1 − m)² weight per gradient, training diverges or crawls). Says so once, at
    the first step of an optimizer of the wrapped parameters, then lets go."""

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        groups = _ours(self._ids, optimizer)
        if not groups:
            return
        momenta = sorted({float(g.get("momentum", 0.0)) for g in groups} - {0.0})
        if momenta:
            logger.warning(
                "commd: compression with ':momentum=' keeps the momentum in the daemon, but "
                "the optimizer (%s) has momentum %s too, so it runs twice; build the "
                "optimizer with momentum=0, or drop ':momentum=' and keep the optimizer's "
                "(the wrapper then corrects top-k on each rank).",
                type(optimizer).__name__, ", ".join(f"{m:g}" for m in momenta))
        self.close()


class MomentumCorrection(StepHook):
    """Per rank: the velocities sent and the momentum buffer's image, per parameter."""

    def __init__(self, params: Sequence[torch.nn.Parameter]) -> None:
        super().__init__(params)
        self.momentum: float | None = None  # None: no optimizer step seen yet
        self.active = True
        self._velocity: list[torch.Tensor | None] = [None] * len(params)
        # b: the optimizer's buffers (read in place), or, once weight decay is seen, our own
        self._optimizer: weakref.ReferenceType[torch.optim.Optimizer] | None = None
        self._own_image = False
        self._buffer: list[torch.Tensor | None] = [None] * len(params)
        self._reduced = False  # a reduction since the last optimizer step
        # what this iteration hands over: the velocities, or the gradients as they are after
        # two dense iterations in a row (agreed on every rank)
        self.sending_velocity = True
        self._dense_before = False  # the iteration before the last one ran dense
        self._stale = False  # velocities not followed through dense rounds: restart from b

    # --- backward: what is sent ----------------------------------------------------------------

    def send(self, index: int, view: torch.Tensor, grad: torch.Tensor | None = None) -> None:
        """``view`` is about to be handed to commd: make it this rank's velocity ``m·u + g``
        (and remember it), unless the last two iterations ran dense. ``grad``: the gradient
        where it is not in ``view`` yet (autograd's fresh tensor), written into the view in
        the same pass; None: ``view`` holds it."""
        with torch.no_grad():
            if not self.active or not self.sending_velocity:
                if grad is not None:
                    view.copy_(grad)
                return
            velocity = self._velocity[index]
            base = self._image(index) if self._stale else velocity
            if base is not None:
                source = view if grad is None else grad
                torch.add(source, base, alpha=self.momentum or 0.0, out=view)
            elif grad is not None:
                view.copy_(grad)
            if velocity is None:  # u = 0 before: u = g
                self._velocity[index] = view.detach().clone()
            else:
                velocity.copy_(view)

    def received(self, ran_dense: bool = False) -> None:
        """Every ``.grad`` holds the reduced velocities ``A`` (or gradients, when this
        iteration sent those): make it ``A − m·b``. ``ran_dense``: every group of this
        iteration ran dense; after two such in a row the next one sends its gradients as
        they are (the first also carried what top-k held back)."""
        if not self.active:
            return
        if self._reduced:
            self._off("two gradient reductions without an optimizer step in between")
            return
        self._reduced = True
        if self.sending_velocity:
            self._stale = False
            momentum = self.momentum or 0.0
            with torch.no_grad():
                for index, param in enumerate(self.params):
                    buffer = self._image(index)
                    if buffer is not None and param.grad is not None:
                        param.grad.sub_(buffer, alpha=momentum)
        else:
            self._stale = True  # no velocity this round: the next one starts from b
        self.sending_velocity = not (ran_dense and self._dense_before)
        self._dense_before = ran_dense

    # --- the optimizer's step ------------------------------------------------------------------

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        """torch's global step pre-hook: learn ``m`` and follow the momentum buffer."""
        if not self.active:
            return
        groups = _ours(self._ids, optimizer)
        if not groups:
            return  # another model's optimizer
        why = self._ineligible(optimizer, groups)
        if why:
            # Adam or plain SGD from the start: error feedback alone is what they want.
            expected = why.startswith("the optimizer is") or "momentum 0" in why
            self._off(why, quiet=self.momentum is None and expected)
            return
        if not self._reduced:
            self._off("an optimizer step without a gradient reduction before it")
            return
        self._reduced = False
        self.momentum = float(groups[0]["momentum"])
        self._optimizer = weakref.ref(optimizer)
        if not self._own_image and any(g.get("weight_decay", 0.0) for g in groups):
            # weight decay enters the optimizer's buffer but not A: b is ours from here on,
            # starting from the buffer as it is (no weight decay in it yet)
            self._buffer = [None if b is None else b.detach().clone()
                            for b in map(self._image, range(len(self.params)))]
            self._own_image = True
        if not self._own_image:
            return
        with torch.no_grad():
            for index, param in enumerate(self.params):
                if param.grad is None:
                    continue
                buffer = self._buffer[index]
                if buffer is None:
                    self._buffer[index] = param.grad.detach().clone()
                else:  # b ← m·b + g' in one pass
                    torch.add(param.grad, buffer, alpha=self.momentum, out=buffer)

    def _image(self, index: int) -> torch.Tensor | None:
        """``b`` of parameter ``index``: ours, or the optimizer's buffer (None before its
        first step)."""
        if self._own_image:
            return self._buffer[index]
        optimizer = self._optimizer() if self._optimizer is not None else None
        state = optimizer.state.get(self.params[index]) if optimizer is not None else None
        return state.get("momentum_buffer") if state else None

    def _ineligible(self, optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> str:
        if not isinstance(optimizer, torch.optim.SGD):
            return f"the optimizer is {type(optimizer).__name__}, not SGD"
        momenta = {float(g.get("momentum", 0.0)) for g in groups}
        if len(momenta) != 1:
            return f"the parameter groups have different momenta {sorted(momenta)}"
        if momenta == {0.0}:
            return "SGD runs with momentum 0"
        if any(g.get("nesterov") or g.get("dampening", 0.0) for g in groups):
            return "SGD runs with Nesterov momentum or dampening"
        if any(g.get("maximize") for g in groups):  # its buffer follows −g'
            return "SGD runs with maximize=True"
        held = {id(p) for g in groups for p in g["params"]}
        if not self._ids <= held:
            return "the optimizer holds only some of the wrapped parameters"
        return ""

    def _off(self, why: str, quiet: bool = False) -> None:
        """No correction from here on: plain error feedback."""
        log = logger.info if quiet else logger.warning
        log("commd: top-k momentum correction is off: %s; compressed gradients go through "
            "error feedback alone from here on.", why)
        self.active = False
        self._velocity = [None] * len(self.params)
        self._buffer = [None] * len(self.params)
        self._optimizer = None
        self.close()
