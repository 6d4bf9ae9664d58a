"""ResNet-50, parameter-for-parameter the same as torchvision's ``resnet50()``.

Written here (torchvision is not a dependency) so that profiles and tests use the exact
layer list that the MG-WFBP literature uses: 161 parameter tensors, 25,557,032 parameters,
registered in torchvision's order (which is also forward order).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["Bottleneck", "ResNet", "resnet50"]


class Bottleneck(nn.Module):
    """1x1 -> 3x3 -> 1x1 block, stride on the 3x3 (torchvision's "ResNet v1.5")."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        out = planes * self.expansion
        # Registration order matters: named_parameters() must match torchvision's.
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.relu = nn.ReLU(inplace=True)
        self.downsample: nn.Module | None = None
        if stride != 1 or inplanes != out:
            self.downsample = nn.Sequential(
                nn.Conv2d(inplanes, out, 1, stride=stride, bias=False), nn.BatchNorm2d(out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        out: torch.Tensor = self.relu(y + identity)
        return out


class ResNet(nn.Module):
    """ImageNet ResNet built from bottleneck blocks (224x224x3 input, ``num_classes`` logits)."""

    def __init__(self, blocks: tuple[int, int, int, int], num_classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        inplanes = 64
        stages = []
        for i, (planes, count) in enumerate(zip((64, 128, 256, 512), blocks, strict=True)):
            stride = 1 if i == 0 else 2
            layers = [Bottleneck(inplanes, planes, stride)]
            inplanes = planes * Bottleneck.expansion
            layers += [Bottleneck(inplanes, planes) for _ in range(count - 1)]
            stages.append(nn.Sequential(*layers))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(inplanes, num_classes)
        # torchvision's initialisation, so that training from scratch behaves the same.
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        logits: torch.Tensor = self.fc(torch.flatten(self.avgpool(x), 1))
        return logits


def resnet50(num_classes: int = 1000) -> ResNet:
    """torchvision-equivalent ResNet-50 (bottleneck blocks [3, 4, 6, 3])."""
    return ResNet((3, 4, 6, 3), num_classes)
