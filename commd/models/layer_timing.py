"""Measure a model's forward time and per-layer backward times on this machine.

How: a ``register_post_accumulate_grad_hook`` on every parameter marks the instant its
gradient is ready (the moment a communication daemon could start sending it). Sorting one
iteration's marks, parameter p is charged the time from the previous mark (or from the start of
``backward()``) to its own; parameters that become ready together get ~0. Per layer we take the
median over the measured iterations (robust to a noisy shared machine), then scale the medians
so that they sum to the median "backward start -> last gradient ready" time, so a simulator that
accumulates ``backward_s`` ends backward when the real one did.

CUDA: kernels run asynchronously, so host clocks would time kernel *launches*. There, every
mark is a CUDA event recorded on the current stream (the hook runs on the stream that produced
the gradient's accumulation); we synchronise once per iteration, after ``backward()``, and read
the events' elapsed times. That measures GPU execution without stalling the pipeline per layer.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from commd.models.registry import DEFAULT_SEQ_LEN, build, example_input, example_target, loss

__all__ = ["LayerTiming", "Measurement", "measure"]


@dataclass(frozen=True)
class LayerTiming:
    """One parameter tensor's part of the backward pass: its name, its gradient's bytes, and the
    backward seconds charged to it (its scaled median)."""

    name: str
    bytes: int
    backward_s: float


@dataclass(frozen=True)
class Measurement:
    """What ``measure`` found for one model on this machine: the forward and backward times and the
    per-layer timings, whose backward seconds sum to ``backward_s``."""

    forward_s: float  # median forward + loss time
    layers: list[LayerTiming]  # forward (registration) order
    backward_s: float  # median backward start -> last gradient ready (= sum of layers)
    backward_call_s: float  # median time of the whole backward() call
    scale: float  # factor applied to the per-layer medians (close to 1)


class _Clock(Protocol):
    def mark(self) -> Any: ...
    def seconds(self, start: Any, end: Any) -> float: ...
    def sync(self) -> None: ...


class _HostClock:
    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, start: float, end: float) -> float:
        return end - start

    def sync(self) -> None:
        pass


class _CudaClock:
    def mark(self) -> torch.cuda.Event:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def seconds(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return float(start.elapsed_time(end)) / 1e3  # elapsed_time is in milliseconds

    def sync(self) -> None:
        torch.cuda.synchronize()


def _ready_deltas(ready: list[float]) -> list[float]:
    """Per-parameter time since the previous gradient (in ready order) became ready."""
    deltas = [0.0] * len(ready)
    prev = 0.0
    for i in sorted(range(len(ready)), key=ready.__getitem__):
        deltas[i] = max(ready[i] - prev, 0.0)
        prev = max(prev, ready[i])
    return deltas


def measure(
    model_name: str,
    *,
    batch_size: int,
    iterations: int,
    warmup: int,
    device: str = "cpu",
    seq_len: int = DEFAULT_SEQ_LEN,
    progress: Callable[[int, float, float], None] | None = None,
) -> Measurement:
    """Train ``model_name`` on synthetic data for ``warmup + iterations`` steps and time them.

    ``progress(iteration, forward_s, backward_s)`` is called after every step (warm-up
    steps are numbered from 1 - warmup to 0). Raises ValueError for an unknown model.
    """
    torch.manual_seed(0)
    model: nn.Module = build(model_name).to(device).train()
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    inputs = tuple(t.to(device) for t in example_input(model_name, batch_size, seq_len=seq_len))
    target = example_target(model_name, batch_size).to(device)
    clock: _Clock = _CudaClock() if torch.device(device).type == "cuda" else _HostClock()

    marks: list[Any] = [None] * len(params)
    handles = _mark_when_ready(params, marks, clock)
    forwards: list[float] = []
    spans: list[float] = []
    calls: list[float] = []
    deltas: list[list[float]] = []  # [iteration][parameter]
    try:
        for step in range(1 - warmup, iterations + 1):
            # set_to_none: gradients are assigned, not added, as after optimizer.zero_grad().
            model.zero_grad(set_to_none=True)
            marks[:] = [None] * len(params)
            clock.sync()
            t0 = clock.mark()
            out = loss(model(*inputs), target)
            t1 = clock.mark()
            out.backward()
            t2 = clock.mark()
            clock.sync()
            missing = [params[i][0] for i, m in enumerate(marks) if m is None]
            if missing:
                raise RuntimeError(f"commd: parameters got no gradient: {', '.join(missing[:5])}")
            ready = [clock.seconds(t1, m) for m in marks]
            fwd, call = clock.seconds(t0, t1), clock.seconds(t1, t2)
            if progress is not None:
                progress(step, fwd, call)
            if step >= 1:
                forwards.append(fwd)
                calls.append(call)
                spans.append(max(ready))
                deltas.append(_ready_deltas(ready))
    finally:
        for h in handles:
            h.remove()

    return _summarise(params, forwards, calls, spans, deltas)


def _mark_when_ready(params: list[tuple[str, nn.Parameter]], marks: list[Any],
                     clock: _Clock) -> list[Any]:
    """Hooks that stamp ``marks[i]`` when parameter i's gradient is accumulated."""

    def hook_for(i: int) -> Callable[[torch.Tensor], None]:
        def hook(_: torch.Tensor) -> None:
            marks[i] = clock.mark()

        return hook

    return [p.register_post_accumulate_grad_hook(hook_for(i)) for i, (_, p) in enumerate(params)]


def _summarise(params: list[tuple[str, nn.Parameter]], forwards: list[float], calls: list[float],
               spans: list[float], deltas: list[list[float]]) -> Measurement:
    """Per-layer medians, scaled to sum to the median backward span."""
    medians = [statistics.median(col) for col in zip(*deltas, strict=True)]
    span = statistics.median(spans)
    total = sum(medians)
    scale = span / total if total > 0 else 1.0
    layers = [
        LayerTiming(n, p.numel() * p.element_size(), m * scale)
        for (n, p), m in zip(params, medians, strict=True)
    ]
    return Measurement(
        forward_s=statistics.median(forwards),
        layers=layers,
        backward_s=span,
        backward_call_s=statistics.median(calls),
        scale=scale,
    )
