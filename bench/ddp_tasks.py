"""A learnable task for bench/ddp_compare.py: deep_mlp trained on a fixed random teacher.

- Student: deep_mlp (48 x Linear(256, 256) with ReLU between), the same layers as
  bench/ddp_compare.py's, initialised near the identity (``I + N(0, (0.1/16)^2)``, zero
  biases): with PyTorch's default or He init a plain 48-layer ReLU stack stays at the uniform
  loss for hundreds of steps, near the identity it learns at once. The last layer starts at a
  tenth of that, so the first predictions are near-uniform.
- Teacher: ``label = argmax(x @ W)`` over ``CLASSES`` classes, ``W`` a fixed seeded 256 x CLASSES
  matrix, the same on every rank and in every variant; the student's first ``CLASSES`` outputs
  are its logits. The labels are a function of the inputs, so the loss can fall towards 0 and
  measures learning (it starts at ln 10 = 2.30).
- Data: every rank draws a fresh batch ``x ~ N(0, 1)`` every step from its own stream, seeded by
  the rank and the bench's repeat, so no batch is seen twice and every variant sees the same
  batches in the same repeat. A 48-layer net trained for 150 steps is chaotic: one seed's
  final loss moves by ~10 % between seeds (dense too), so compare means over repeats.
- Optimizer: SGD, lr 0.01, momentum 0.9 (dense training: 2.30 → ~1.2 in 200 steps of 2 × 64).
"""

from __future__ import annotations

from typing import Any

INPUT = 256
CLASSES = 10
LAYERS = 48
TEACHER_SEED = 1234
DATA_SEED = 5678
EVAL_SEED = 91011
EVAL_SAMPLES = 4096  # the held-out set: the final model's loss on it is the table's loss
INIT_NOISE = 0.1  # std of the init's deviation from the identity, times sqrt(fan_in)
LAST_LAYER_GAIN = 0.1
DEFAULT_LR = 0.01
MOMENTUM = 0.9


def deep_mlp() -> Any:
    """The student; the same parameters in every process (seeded)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(INPUT, INPUT)]
    for _ in range(LAYERS - 1):
        layers += [nn.ReLU(), nn.Linear(INPUT, INPUT)]
    linears = [layer for layer in layers if isinstance(layer, nn.Linear)]
    with torch.no_grad():
        for layer in linears:
            noise = torch.randn(INPUT, INPUT) * (INIT_NOISE / INPUT**0.5)
            layer.weight.copy_(torch.eye(INPUT) + noise)
            layer.bias.zero_()
        linears[-1].weight.mul_(LAST_LAYER_GAIN)
    return nn.Sequential(*layers)


class TeacherStream:
    """One rank's endless supply of fresh (inputs, labels) batches."""

    def __init__(self, rank: int, batch: int, seed: int = 0) -> None:
        """``seed``: which of the data streams (the bench's repeat); the teacher is fixed."""
        import torch

        teacher = torch.Generator().manual_seed(TEACHER_SEED)
        self.weight = torch.randn(INPUT, CLASSES, generator=teacher)
        self.data = torch.Generator().manual_seed(DATA_SEED + 1000 * rank + 7 * seed)
        self.batch = batch

    def next(self) -> tuple[Any, Any]:
        import torch

        x = torch.randn(self.batch, INPUT, generator=self.data)
        return x, (x @ self.weight).argmax(dim=1)


def held_out() -> tuple[Any, Any]:
    """EVAL_SAMPLES fixed samples no rank trains on (their own seed), labelled by the teacher."""
    import torch

    stream = TeacherStream(0, EVAL_SAMPLES)
    stream.data = torch.Generator().manual_seed(EVAL_SEED)
    return stream.next()


def loss(output: Any, labels: Any) -> Any:
    """Cross-entropy over the student's first CLASSES outputs."""
    import torch.nn.functional as F

    return F.cross_entropy(output[:, :CLASSES], labels)


def optimizer(parameters: Any, lr: float = DEFAULT_LR, momentum: float = MOMENTUM) -> Any:
    """SGD with momentum: the setting top-k with error feedback is usually studied in. With
    commd's momentum correction the momentum is the daemon's, and the optimizer's is 0."""
    import torch

    return torch.optim.SGD(parameters, lr=lr, momentum=momentum)
