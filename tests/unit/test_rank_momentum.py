"""The DDP wrapper's momentum correction on its own (no daemon): what each iteration hands
over after dense and top-k iterations, against torch's momentum SGD.

One rank and an exact exchange stand in for commd here: the reduced ``.grad`` is exactly
what was handed over. With an exact exchange every update must be momentum SGD's, whatever
the daemon reported as dense; what the reports change is the work on the rank.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from commd_client._torch_momentum import MomentumCorrection

MOMENTUM = 0.9


def _params(seed: int) -> list[nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(shape, generator=generator)) for shape in ((4, 3), (3,))]


def _gradients(step: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(shape, generator=generator) for shape in ((4, 3), (3,))]


Tensors = list[torch.Tensor]
Exchange = Callable[[int, torch.Tensor], torch.Tensor]


def _hand_over(correction: MomentumCorrection, step: int, exchange: Exchange,
               fresh: bool = False) -> tuple[Tensors, Tensors]:
    """One backward: each gradient of ``step`` goes through ``correction.send``, and
    ``exchange(index, handed)`` stands in for commd's result in ``.grad``. Returns what was
    handed over and what came back. ``fresh``: the gradient comes as autograd's own tensor
    after ``zero_grad`` (the view holds last iteration's result), not already in the view."""
    handed, returned = [], []
    for index, (param, gradient) in enumerate(zip(correction.params, _gradients(step),
                                                  strict=True)):
        if fresh:
            view = torch.full_like(gradient, float("nan"))  # whatever the view held
            correction.send(index, view, gradient.clone())
        else:
            view = gradient.clone()
            correction.send(index, view)
        handed.append(view.clone())
        param.grad = exchange(index, view)
        returned.append(param.grad.clone())
    return handed, returned


def _exact(index: int, handed: torch.Tensor) -> torch.Tensor:
    """The exact exchange of one rank: ``A`` is what was handed over."""
    return handed


def _train(ran_dense: list[bool], weight_decay: float = 0.0, decay_from: int = 0,
           fresh: bool = False
           ) -> tuple[list[Tensors], list[nn.Parameter], list[nn.Parameter], list[Tensors]]:
    """Iterations whose ``done`` reported ``ran_dense[t]``, with ``weight_decay`` from
    iteration ``decay_from`` on (``fresh``: as for ``_hand_over``). Returns what each
    iteration handed over, the corrected parameters, momentum SGD's, and the optimizer's
    momentum buffers before each iteration."""
    params, reference = _params(0), _params(0)
    correction = MomentumCorrection(params)
    optimizer = torch.optim.SGD(params, lr=0.05, momentum=MOMENTUM)
    plain = torch.optim.SGD(reference, lr=0.05, momentum=MOMENTUM)
    handed: list[Tensors] = []
    buffers: list[Tensors] = []
    try:
        for step, dense in enumerate(ran_dense):
            if step == decay_from:
                for group in (*optimizer.param_groups, *plain.param_groups):
                    group["weight_decay"] = weight_decay
            buffers.append([optimizer.state[p]["momentum_buffer"].clone()
                            if p in optimizer.state else torch.zeros_like(p) for p in params])
            sent, _ = _hand_over(correction, step, _exact, fresh)
            correction.received(dense)
            optimizer.step()
            for param, gradient in zip(reference, _gradients(step), strict=True):
                param.grad = gradient.clone()
            plain.step()
            handed.append(sent)
        assert correction.active
    finally:
        correction.close()
    return handed, params, reference, buffers


@pytest.mark.parametrize(("weight_decay", "decay_from"), [(0.0, 0), (0.01, 0), (0.01, 3)])
def test_an_exact_exchange_gives_momentum_sgd_whatever_ran_dense(
        weight_decay: float, decay_from: int) -> None:
    """Without weight decay the optimizer's buffer is b; with it (from the start, or from a
    later step on, when b is taken over from the buffer) b is followed on the rank."""
    pattern = [False, True, True, True, False, False, True, False, False]
    _, params, reference, _ = _train(pattern, weight_decay, decay_from)
    for param, want in zip(params, reference, strict=True):
        torch.testing.assert_close(param, want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_a_fresh_gradient_is_handed_over_as_the_same_bits(weight_decay: float) -> None:
    """After ``zero_grad`` autograd's fresh tensor is written into the view in the pass that
    forms the velocity (or copied, while resting): the same bits as the gradient loaded into
    the view first and corrected there, in every state (first, top-k, dense, restarted)."""
    pattern = [False, True, True, True, False, False, True, False, False]
    in_place, params, _, _ = _train(pattern, weight_decay)
    fresh, fresh_params, _, _ = _train(pattern, weight_decay, fresh=True)
    for step, (want, got) in enumerate(zip(in_place, fresh, strict=True)):
        for index, (a, b) in enumerate(zip(want, got, strict=True)):
            assert torch.equal(a, b), f"iteration {step}, tensor {index}"
    for param, want in zip(fresh_params, params, strict=True):
        assert torch.equal(param, want)


def test_after_two_dense_iterations_the_gradients_go_as_they_are() -> None:
    """No passes while the daemon runs dense: after two dense iterations in a row what is
    handed over is the gradient itself (after one, the velocity still goes: that round also
    carried what top-k held back)."""
    pattern = [False, True, True, True, False, False]
    handed, _, _, _ = _train(pattern)
    for step in (3, 4):  # after iterations 1-2 and 2-3, both dense
        for sent, gradient in zip(handed[step], _gradients(step), strict=True):
            torch.testing.assert_close(sent, gradient, atol=0, rtol=0)
    for step in (1, 2, 5):  # after a top-k iteration, or one dense after top-k: m·u + g
        for sent, gradient in zip(handed[step], _gradients(step), strict=True):
            assert not torch.equal(sent, gradient)


def test_the_velocity_restarts_from_the_optimizers_buffer_after_dense_rounds() -> None:
    """Iteration 3 sent gradients (after two dense ones) and ran top-k, so iteration 4 sends
    m·b + g, where b is the optimizer's momentum buffer (no weight decay here): the average of
    the velocities the ranks would hold had they been followed through the dense rounds."""
    pattern = [False, True, True, False, False, False]
    handed, _, _, buffers = _train(pattern)
    for step in (4, 5):
        for sent, gradient, buffer in zip(handed[step], _gradients(step), buffers[step],
                                          strict=True):
            torch.testing.assert_close(sent, MOMENTUM * buffer + gradient, atol=1e-6, rtol=1e-6)


def test_top_k_iterations_alone_send_velocities_throughout() -> None:
    """Never dense: every iteration after the first hands over m·u + g (u: what it sent)."""
    pattern = [False] * 5
    handed, _, _, _ = _train(pattern)
    for step in range(1, 5):
        for sent, before, gradient in zip(handed[step], handed[step - 1], _gradients(step),
                                          strict=True):
            torch.testing.assert_close(sent, MOMENTUM * before + gradient, atol=1e-6, rtol=1e-6)


def test_maximize_turns_the_correction_off() -> None:
    """SGD(maximize=True) keeps −g' in its buffer: the correction would push the wrong way."""
    params = _params(0)
    correction = MomentumCorrection(params)
    optimizer = torch.optim.SGD(params, lr=0.05, momentum=MOMENTUM, maximize=True)
    _hand_over(correction, 0, _exact)
    correction.received()
    optimizer.step()
    assert not correction.active


@pytest.mark.parametrize(("weight_decay", "decay_from"), [(0.0, 0), (0.01, 0), (0.01, 3)])
def test_a_lossy_exchange_leaves_the_optimizer_buffer_at_a_plus_weight_decays_momentum(
        weight_decay: float, decay_from: int) -> None:
    """DGC's invariant, where b matters: after an iteration that sent velocities, the
    optimizer's momentum buffer is what commd returned, ``A``, plus weight decay's own
    momentum ``W ← m·W + wd·p``. The exchange here returns half of what was handed over."""
    pattern = [False, False, True, True, False, False, False, True, False, False]
    params = _params(0)
    correction = MomentumCorrection(params)
    optimizer = torch.optim.SGD(params, lr=0.05, momentum=MOMENTUM)
    decay = [torch.zeros_like(p) for p in params]  # W
    try:
        for step, dense in enumerate(pattern):
            if step == decay_from:
                optimizer.param_groups[0]["weight_decay"] = weight_decay
            decayed = optimizer.param_groups[0]["weight_decay"]
            decay = [MOMENTUM * kept + decayed * param.detach()
                     for param, kept in zip(params, decay, strict=True)]
            _, returned = _hand_over(correction, step, lambda index, handed: 0.5 * handed)
            correction.received(dense)
            optimizer.step()
            if step < 2 or not (pattern[step - 1] and pattern[step - 2]):  # velocities went
                for param, reduced, kept in zip(params, returned, decay, strict=True):
                    torch.testing.assert_close(optimizer.state[param]["momentum_buffer"],
                                               reduced + kept, atol=1e-6, rtol=1e-5)
        assert correction.active
    finally:
        correction.close()


def _error_feedback(sent: torch.Tensor, residual: torch.Tensor, dense: bool) -> torch.Tensor:
    """A one-rank stand-in for the daemon's top-k with error feedback: a top-k round returns
    the larger half of ``sent + residual`` and keeps the rest; a dense round returns it all
    (the first after top-k sends what was held back at once). ``residual`` is updated."""
    total = sent + residual
    if dense:
        residual.zero_()
        return total
    keep = total.abs() >= total.abs().flatten().median()
    residual.copy_(torch.where(keep, torch.zeros_like(total), total))
    return torch.where(keep, total, torch.zeros_like(total))


def _train_with_error_feedback(ran_dense: list[bool], rest: bool) -> list[nn.Parameter]:
    """Training through ``_error_feedback``; ``rest=False``: the correction is told every
    iteration ran top-k, so it sends velocities throughout (DGC's update, exactly)."""
    params = _params(0)
    correction = MomentumCorrection(params)
    optimizer = torch.optim.SGD(params, lr=0.05, momentum=MOMENTUM)
    residuals = [torch.zeros_like(p) for p in params]
    try:
        for step, dense in enumerate(ran_dense):
            def exchange(index: int, handed: torch.Tensor, dense: bool = dense) -> torch.Tensor:
                return _error_feedback(handed, residuals[index], dense)

            _hand_over(correction, step, exchange)
            correction.received(dense and rest)
            optimizer.step()
    finally:
        correction.close()
    return params


def test_resting_through_dense_rounds_applies_what_top_k_held_back_once() -> None:
    """The first dense round after top-k sends the residual at once. Resting only from the
    second on, the weights through the dense rounds are those of sending velocities
    throughout; resting from the first, the residual's lump would stay in the optimizer's
    buffer and its momentum would apply it again and again."""
    pattern = [False, False, False, True, True, True, True, True]
    resting = _train_with_error_feedback(pattern, rest=True)
    exact = _train_with_error_feedback(pattern, rest=False)
    for param, want in zip(resting, exact, strict=True):
        torch.testing.assert_close(param, want, atol=1e-6, rtol=1e-5)
