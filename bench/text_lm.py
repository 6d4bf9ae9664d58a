"""The model and data of bench/time_to_loss.py: a byte-level transformer LM on the Python
standard library's own sources, text that every machine with Python has.

- Data: the stdlib's ``*.py`` files (``sysconfig.get_paths()["stdlib"]``, recursively, paths
  sorted), concatenated file by file until ``budget`` bytes; a file that would cross the budget
  is cut there. Every ``HELD_OUT_EVERY``-th file of that list (5 %) is held out: it is never
  trained on; validation windows come only from it. The same Python version gives the same
  bytes, so every variant and every repeat trains on the same text.
- Training batches: random windows of ``CONTEXT + 1`` bytes of the training text, drawn by a
  generator seeded by (seed, rank): every rank has its own stream, the same in every variant.
- Validation: ``VAL_WINDOWS`` fixed windows spread evenly over the held-out text; the loss is
  the mean next-byte cross-entropy (nats) over all their positions.
- Model: a GPT-style decoder (pre-norm blocks, causal self-attention, GELU MLP of 4·d, learnt
  positions, no dropout, untied output layer), initialised from a fixed seed with N(0, 0.02)
  (residual projections scaled by 1/sqrt(2·layers), as GPT-2), so every process starts equal.
"""

from __future__ import annotations

import math
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VOCAB = 256  # bytes
CONTEXT = 128
LAYERS = 4
WIDTH = 256
HEADS = 4
HELD_OUT_EVERY = 20  # file i of the sorted list is held out when i % 20 == 19: 5 % of files
DEFAULT_BUDGET = 8_000_000  # bytes of source read (training + held out)
VAL_WINDOWS = 64
INIT_SEED = 0
INIT_STD = 0.02


@dataclass(frozen=True)
class Corpus:
    """The training and held-out bytes, and which files each came from."""

    train: bytes
    held_out: bytes
    train_files: tuple[str, ...]  # paths relative to the stdlib directory
    held_out_files: tuple[str, ...]


def stdlib_files(root: Path | None = None) -> list[Path]:
    """The stdlib's ``*.py`` files, sorted by their path relative to ``root`` (site-packages,
    where a virtual environment's packages may live, left out: it differs between machines)."""
    base = Path(sysconfig.get_paths()["stdlib"]) if root is None else root
    return sorted((p for p in base.rglob("*.py")
                   if "site-packages" not in p.relative_to(base).parts and p.is_file()),
                  key=lambda p: p.relative_to(base).as_posix())


def load_corpus(budget: int = DEFAULT_BUDGET, root: Path | None = None) -> Corpus:
    """Read files in sorted order until ``budget`` bytes; every HELD_OUT_EVERY-th is held out."""
    if budget <= 0:
        raise ValueError(f"budget must be a positive number of bytes, not {budget}")
    base = Path(sysconfig.get_paths()["stdlib"]) if root is None else root
    train: list[bytes] = []
    held: list[bytes] = []
    train_names: list[str] = []
    held_names: list[str] = []
    left = budget
    for index, path in enumerate(stdlib_files(base)):
        if left <= 0:
            break
        data = path.read_bytes()[:left]
        left -= len(data)
        name = path.relative_to(base).as_posix()
        if index % HELD_OUT_EVERY == HELD_OUT_EVERY - 1:
            held.append(data)
            held_names.append(name)
        else:
            train.append(data)
            train_names.append(name)
    if not held or not train:
        raise ValueError(f"{base}: {budget} bytes give no held-out or no training file; "
                         f"{HELD_OUT_EVERY} files or more are needed")
    return Corpus(b"".join(train), b"".join(held), tuple(train_names), tuple(held_names))


def as_tensor(data: bytes) -> Any:
    import torch

    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


class Batches:
    """One rank's endless stream of training batches: (inputs, targets), each batch × CONTEXT."""

    def __init__(self, text: Any, batch: int, rank: int, seed: int = 0) -> None:
        import torch

        if len(text) <= CONTEXT + 1:
            raise ValueError(f"{len(text)} bytes of training text: fewer than a window")
        self.text = text
        self.batch = batch
        self.generator = torch.Generator().manual_seed(1_000_003 * seed + rank)

    def next(self) -> tuple[Any, Any]:
        import torch

        starts = torch.randint(0, len(self.text) - CONTEXT - 1, (self.batch,),
                               generator=self.generator)
        windows = torch.stack([self.text[s:s + CONTEXT + 1] for s in starts.tolist()])
        return windows[:, :-1], windows[:, 1:]


def validation_windows(held_out: Any, count: int = VAL_WINDOWS) -> tuple[Any, Any]:
    """``count`` windows spread evenly over the held-out text (the same in every process)."""
    import torch

    span = len(held_out) - CONTEXT - 1
    if span < 0:
        raise ValueError(f"{len(held_out)} held-out bytes: fewer than a window")
    starts = [span * i // max(1, count - 1) for i in range(count)]
    windows = torch.stack([held_out[s:s + CONTEXT + 1] for s in starts])
    return windows[:, :-1], windows[:, 1:]


def loss(logits: Any, targets: Any) -> Any:
    import torch.nn.functional as F

    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def evaluate(model: Any, windows: tuple[Any, Any], chunk: int = 16) -> float:
    """Mean validation loss of ``model`` (the bare module) over ``windows``."""
    import torch

    inputs, targets = windows
    total = 0.0
    with torch.no_grad():
        for i in range(0, len(inputs), chunk):
            total += float(loss(model(inputs[i:i + chunk]), targets[i:i + chunk])) * len(
                inputs[i:i + chunk])
    return total / len(inputs)


def build_model(layers: int = LAYERS, width: int = WIDTH, heads: int = HEADS) -> Any:
    """The decoder, seeded: the same parameters in every process."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm1 = nn.LayerNorm(width)
            self.qkv = nn.Linear(width, 3 * width)
            self.proj = nn.Linear(width, width)
            self.norm2 = nn.LayerNorm(width)
            self.up = nn.Linear(width, 4 * width)
            self.down = nn.Linear(4 * width, width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, _ = x.shape
            q, k, v = (part.view(b, t, heads, width // heads).transpose(1, 2)
                       for part in self.qkv(self.norm1(x)).split(width, dim=2))
            attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(attended.transpose(1, 2).reshape(b, t, width))
            return x + self.down(F.gelu(self.up(self.norm2(x))))

    class ByteLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, width)
            self.position = nn.Embedding(CONTEXT, width)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.norm = nn.LayerNorm(width)
            self.head = nn.Linear(width, VOCAB)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            positions = torch.arange(tokens.shape[1])
            x = self.embed(tokens) + self.position(positions)
            for block in self.blocks:
                x = block(x)
            return self.head(self.norm(x))

    if width % heads:
        raise ValueError(f"width {width} is not a multiple of heads {heads}")
    torch.manual_seed(INIT_SEED)
    model = ByteLM()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() < 2:
                if not name.endswith("weight"):  # biases; LayerNorm's weights stay 1
                    parameter.zero_()
                continue
            std = INIT_STD / math.sqrt(2 * layers) if name.endswith(("proj.weight",
                                                                      "down.weight")) else INIT_STD
            parameter.normal_(0.0, std)
    return model


def gradient_bytes(model: Any) -> int:
    """Bytes of one rank's gradients (what dense DDP all-reduces per step)."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
