"""CIFAR-style ResNets, written out so the package needs no torchvision.

Differences from the ImageNet models: a 3x3 stride-1 stem conv and no max-pool, so 32x32 inputs keep
enough resolution (and tiny 8x8..16x16 inputs still work, the head pools adaptively). Block layout
follows torchvision (ResNet v1.5: the stride sits on the bottleneck's 3x3 conv).

Parameter counts for num_classes=10, in_channels=3:
    resnet_small         78,042
    resnet18         11,173,962
    resnet50         23,520,842
    resnet152        58,156,618
    wide_resnet50_2  66,847,050
"""
from __future__ import annotations

from typing import Optional, Sequence, Type, Union

import torch
from torch import nn

__all__ = ["BasicBlock", "Bottleneck", "ResNet", "resnet_small", "resnet18", "resnet50", "resnet152",
           "wide_resnet50_2"]


def _conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, kernel_size=3, stride=stride, padding=1, bias=False)


def _conv1x1(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, kernel_size=1, stride=stride, bias=False)


def _projection(cin: int, cout: int, stride: int) -> Optional[nn.Sequential]:
    """1x1 conv + BN shortcut when the block changes shape; None means identity."""
    if stride == 1 and cin == cout:
        return None
    return nn.Sequential(_conv1x1(cin, cout, stride), nn.BatchNorm2d(cout))


class BasicBlock(nn.Module):
    """Two 3x3 convs with BN; output channels = planes."""
    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1, width_per_group: int = 64):
        super().__init__()
        if width_per_group != 64:
            raise ValueError("BasicBlock supports only width_per_group=64")
        self.conv1 = _conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = _conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = _projection(inplanes, planes, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        # out-of-place add: `out += identity` would modify a BN output that hooks may have kept
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (strided), 1x1 expand; output channels = planes * 4.

    The inner width is planes * width_per_group / 64, so width_per_group=128 gives wide_resnet50_2.
    """
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, width_per_group: int = 64):
        super().__init__()
        width = int(planes * (width_per_group / 64.0))
        out = planes * self.expansion
        self.conv1 = _conv1x1(inplanes, width)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = _conv3x3(width, width, stride)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = _conv1x1(width, out)
        self.bn3 = nn.BatchNorm2d(out)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = _projection(inplanes, out, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    """Stem (3x3 conv, BN, ReLU) -> stages -> adaptive avg pool -> Linear.

    `widths[i]` is the planes of stage i, `layers[i]` its block count, `strides[i]` the stride of its
    first block.
    """

    def __init__(self, block: Type[Union[BasicBlock, Bottleneck]], layers: Sequence[int], widths: Sequence[int],
                 strides: Sequence[int], stem_channels: int = 64, num_classes: int = 10, in_channels: int = 3,
                 width_per_group: int = 64):
        super().__init__()
        if not len(layers) == len(widths) == len(strides):
            raise ValueError("layers, widths and strides must have the same length")
        if num_classes < 1 or in_channels < 1:
            raise ValueError(f"need num_classes >= 1 and in_channels >= 1, got {num_classes}, {in_channels}")
        self.conv1 = _conv3x3(in_channels, stem_channels)
        self.bn1 = nn.BatchNorm2d(stem_channels)
        self.relu = nn.ReLU(inplace=True)
        inplanes = stem_channels
        stages = []
        for n, planes, stride in zip(layers, widths, strides):
            blocks = []
            for i in range(n):
                blocks.append(block(inplanes, planes, stride if i == 0 else 1, width_per_group))
                inplanes = planes * block.expansion
            stages.append(nn.Sequential(*blocks))
        # named layer1..layerN like torchvision so state-dict keys and layer filters look familiar
        for i, stage in enumerate(stages, 1):
            self.add_module(f"layer{i}", stage)
        self.num_stages = len(stages)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(inplanes, num_classes)

        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        for i in range(1, self.num_stages + 1):
            x = getattr(self, f"layer{i}")(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))


_IMAGENET_WIDTHS = (64, 128, 256, 512)
_IMAGENET_STRIDES = (1, 2, 2, 2)


def resnet_small(num_classes: int = 10, in_channels: int = 3) -> ResNet:
    """Tiny ResNet for tests and demos: 16-channel stem, one BasicBlock per stage of widths 16/32/64."""
    return ResNet(BasicBlock, (1, 1, 1), (16, 32, 64), (1, 2, 2), stem_channels=16,
                  num_classes=num_classes, in_channels=in_channels)


def resnet18(num_classes: int = 10, in_channels: int = 3) -> ResNet:
    """CIFAR ResNet-18: BasicBlock [2, 2, 2, 2] (11.17M params for 10 classes)."""
    return ResNet(BasicBlock, (2, 2, 2, 2), _IMAGENET_WIDTHS, _IMAGENET_STRIDES,
                  num_classes=num_classes, in_channels=in_channels)


def resnet50(num_classes: int = 10, in_channels: int = 3) -> ResNet:
    """CIFAR ResNet-50: Bottleneck [3, 4, 6, 3] (23.5M params for 10 classes)."""
    return ResNet(Bottleneck, (3, 4, 6, 3), _IMAGENET_WIDTHS, _IMAGENET_STRIDES,
                  num_classes=num_classes, in_channels=in_channels)


def resnet152(num_classes: int = 10, in_channels: int = 3) -> ResNet:
    """CIFAR ResNet-152: Bottleneck [3, 8, 36, 3] (58.2M params for 10 classes)."""
    return ResNet(Bottleneck, (3, 8, 36, 3), _IMAGENET_WIDTHS, _IMAGENET_STRIDES,
                  num_classes=num_classes, in_channels=in_channels)


def wide_resnet50_2(num_classes: int = 10, in_channels: int = 3) -> ResNet:
    """CIFAR Wide ResNet-50-2: ResNet-50 with the bottleneck width doubled (66.8M params for 10 classes)."""
    return ResNet(Bottleneck, (3, 4, 6, 3), _IMAGENET_WIDTHS, _IMAGENET_STRIDES,
                  num_classes=num_classes, in_channels=in_channels, width_per_group=128)
