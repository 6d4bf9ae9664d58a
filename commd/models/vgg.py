"""VGG-16 without batch norm, parameter-for-parameter the same as torchvision's ``vgg16()``.

Its three huge fully-connected layers (~124 M of its 138 M parameters) sit at the output end,
so their gradients are ready first: the classic case where merging matters little and
overlap matters a lot. 32 parameter tensors, 138,357,544 parameters.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["VGG", "vgg16"]

# torchvision's configuration "D": channels of each 3x3 conv, "M" = 2x2 max-pool.
_CFG_D: tuple[int | str, ...] = (
    64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M",
)  # fmt: skip


class VGG(nn.Module):
    """VGG with torchvision's module layout (``features.N``, ``classifier.N`` names)."""

    def __init__(self, cfg: tuple[int | str, ...] = _CFG_D, num_classes: int = 1000) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        channels = 3
        for v in cfg:
            if v == "M":
                layers.append(nn.MaxPool2d(2, 2))
            else:
                assert isinstance(v, int)
                layers += [nn.Conv2d(channels, v, 3, padding=1), nn.ReLU(inplace=True)]
                channels = v
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d((7, 7))
        self.classifier = nn.Sequential(
            nn.Linear(512 * 7 * 7, 4096), nn.ReLU(True), nn.Dropout(),
            nn.Linear(4096, 4096), nn.ReLU(True), nn.Dropout(),
            nn.Linear(4096, num_classes),
        )  # fmt: skip
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
            if isinstance(m, nn.Conv2d | nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.avgpool(self.features(x))
        logits: torch.Tensor = self.classifier(torch.flatten(x, 1))
        return logits


def vgg16(num_classes: int = 1000) -> VGG:
    """torchvision-equivalent VGG-16 (no batch norm), 224x224x3 input."""
    return VGG(_CFG_D, num_classes)
