"""The model registry and the one training convention every model follows.

Convention (what a generic profiler or example relies on):
``logits = model(*example_input(name, batch))`` has shape (batch, num_classes(name)), and the
training loss is ``loss(logits, example_target(name, batch))`` (cross-entropy). Inputs are
synthetic: timings do not depend on the values, only on the shapes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from commd.models.bert import bert_base
from commd.models.cnn import small_cnn
from commd.models.resnet import resnet50
from commd.models.vgg import vgg16

__all__ = [
    "DEFAULT_SEQ_LEN",
    "MODELS",
    "build",
    "example_input",
    "example_target",
    "loss",
    "num_classes",
]

MODELS: dict[str, Callable[[], nn.Module]] = {
    "resnet50": resnet50,
    "vgg16": vgg16,
    "bert_base": bert_base,
    "small_cnn": small_cnn,
}

_NUM_CLASSES = {"resnet50": 1000, "vgg16": 1000, "bert_base": 2, "small_cnn": 10}
_IMAGE_SIZE = {"resnet50": 224, "vgg16": 224, "small_cnn": 32}
DEFAULT_SEQ_LEN = 128  # BERT fine-tuning's usual sequence length


def _check(name: str) -> None:
    if name not in MODELS:
        raise ValueError(f"commd: unknown model {name!r}; valid models: {', '.join(MODELS)}")


def build(name: str) -> nn.Module:
    """A fresh model by registry name (ValueError listing the valid names otherwise)."""
    _check(name)
    return MODELS[name]()


def num_classes(name: str) -> int:
    _check(name)
    return _NUM_CLASSES[name]


def example_input(
    name: str, batch_size: int, *, seq_len: int = DEFAULT_SEQ_LEN, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    """Synthetic positional arguments for ``MODELS[name]()`` (CPU tensors; move as needed).

    Images: one float32 (batch, 3, H, W) tensor. bert_base: (input_ids, token_type_ids),
    both int64 (batch, seq_len), no padding (so no attention mask).
    """
    _check(name)
    gen = torch.Generator().manual_seed(seed)
    if name == "bert_base":
        ids = torch.randint(0, 30522, (batch_size, seq_len), generator=gen)
        types = torch.zeros_like(ids)
        types[:, seq_len // 2 :] = 1  # sentence pair: both token-type embeddings get gradients
        return ids, types
    size = _IMAGE_SIZE[name]
    return (torch.randn(batch_size, 3, size, size, generator=gen),)


def example_target(name: str, batch_size: int, *, seed: int = 0) -> torch.Tensor:
    """Random int64 class labels in [0, num_classes(name)), shape (batch_size,)."""
    gen = torch.Generator().manual_seed(seed + 1)
    return torch.randint(0, num_classes(name), (batch_size,), generator=gen)


def loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The training loss of every registered model: mean cross-entropy."""
    return F.cross_entropy(logits, target)
