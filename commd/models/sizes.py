"""Parameter sizes of ResNet-50 computed arithmetically, without importing torch.

Benchmarks that must run on numpy alone (no torch in the environment) use this to get the
same 161-layer list as ``commd.models.resnet50()``; a test checks that the two agree.
"""

from __future__ import annotations

__all__ = ["resnet50_layer_sizes"]


def _conv(name: str, cin: int, cout: int, k: int) -> list[tuple[str, int]]:
    return [(f"{name}.weight", cout * cin * k * k)]  # ResNet convs have no bias


def _bn(name: str, c: int) -> list[tuple[str, int]]:
    return [(f"{name}.weight", c), (f"{name}.bias", c)]


def resnet50_layer_sizes(num_classes: int = 1000) -> list[tuple[str, int]]:
    """ResNet-50's (parameter name, numel) pairs in forward (= registration) order.

    Names and order are torchvision's: 161 tensors, 25,557,032 parameters for 1000 classes.
    """
    out = _conv("conv1", 3, 64, 7) + _bn("bn1", 64)
    inplanes = 64
    for stage, (planes, blocks) in enumerate(((64, 3), (128, 4), (256, 6), (512, 3)), 1):
        width, expanded = planes, planes * 4
        for b in range(blocks):
            p = f"layer{stage}.{b}"
            out += _conv(f"{p}.conv1", inplanes, width, 1) + _bn(f"{p}.bn1", width)
            out += _conv(f"{p}.conv2", width, width, 3) + _bn(f"{p}.bn2", width)
            out += _conv(f"{p}.conv3", width, expanded, 1) + _bn(f"{p}.bn3", expanded)
            if b == 0:  # the first block of each stage changes shape: projection shortcut
                out += _conv(f"{p}.downsample.0", inplanes, expanded, 1)
                out += _bn(f"{p}.downsample.1", expanded)
            inplanes = expanded
    out += [("fc.weight", num_classes * inplanes), ("fc.bias", num_classes)]
    return out
