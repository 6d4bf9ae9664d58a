"""Plain PyTorch model definitions used for profiles, examples and tests.

torch is imported lazily: ``commd.models.sizes`` and ``MODEL_NAMES`` work without torch, and
importing this package costs nothing until a model, input or the profiler is asked for.

Public API (see ``registry`` for the training convention):
    MODEL_NAMES                      the registered names, no torch needed
    MODELS[name]() -> nn.Module      resnet50, vgg16, bert_base, small_cnn
    build(name), num_classes(name)
    example_input(name, batch_size, *, seq_len=128, seed=0) -> tuple[Tensor, ...]
    example_target(name, batch_size, *, seed=0) -> Tensor
    loss(logits, target) -> Tensor
    resnet50(), vgg16(), bert_base(), small_cnn()
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from commd.models.bert import bert_base
    from commd.models.cnn import small_cnn
    from commd.models.registry import (
        DEFAULT_SEQ_LEN,
        MODELS,
        build,
        example_input,
        example_target,
        loss,
        num_classes,
    )
    from commd.models.resnet import resnet50
    from commd.models.vgg import vgg16

# Kept in step with registry.MODELS (a test checks it), so the CLI can list and validate
# names without importing torch.
MODEL_NAMES: tuple[str, ...] = ("resnet50", "vgg16", "bert_base", "small_cnn")

_LAZY = {
    "DEFAULT_SEQ_LEN": "registry",
    "MODELS": "registry",
    "build": "registry",
    "example_input": "registry",
    "example_target": "registry",
    "loss": "registry",
    "num_classes": "registry",
    "bert_base": "bert",
    "resnet50": "resnet",
    "small_cnn": "cnn",
    "vgg16": "vgg",
}

__all__ = [
    "DEFAULT_SEQ_LEN",
    "MODELS",
    "MODEL_NAMES",
    "bert_base",
    "build",
    "example_input",
    "example_target",
    "loss",
    "num_classes",
    "resnet50",
    "small_cnn",
    "vgg16",
]


def __getattr__(name: str) -> Any:
    # PEP 562: the first access imports the torch-backed module, then caches the attribute.
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
