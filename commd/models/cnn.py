"""A small CNN for 32x32x3 images and 10 classes (CIFAR-10 shaped), quick to train on CPU.

Used by the examples and tests: it has the shape of a real model (convolutions early,
a large fully-connected layer late) but trains in seconds. 12 tensors, 591,274 parameters.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["SmallCNN", "small_cnn"]


class SmallCNN(nn.Module):
    """Four 3x3 convolutions in two pooled stages, then a 4096→128→``num_classes`` classifier."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(inplace=True),
            nn.MaxPool2d(2),  # 16x16
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(inplace=True),
            nn.MaxPool2d(2),  # 8x8
        )  # fmt: skip
        self.classifier = nn.Sequential(
            nn.Linear(64 * 8 * 8, 128), nn.ReLU(inplace=True), nn.Linear(128, num_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.classifier(torch.flatten(self.features(x), 1))
        return logits


def small_cnn(num_classes: int = 10) -> SmallCNN:
    """The small CNN: 32x32x3 input, ``num_classes`` logits."""
    return SmallCNN(num_classes)
