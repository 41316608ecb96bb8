"""A small residual network with BatchNorm: a model of your own for raysweep (docs/your-model.md).

    model:
      factory: "resnet:build"          # this file's folder is the working directory or the spec's folder
      kwargs: {width: 32, blocks: [1, 1, 1]}

Three stages of residual blocks (3×3 convolutions, BatchNorm, ReLU; the 2nd and 3rd stages halve the image), then
the feature map averaged down to one column per character position and a 1×1 convolution to the charset: logits
(N, length, num_classes). Nothing here knows raysweep beyond the contract: the factory takes the image spec
(channels, height, width, length, num_classes) and keyword arguments, and returns an nn.Module.
"""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    """conv 3×3 → BN → ReLU → conv 3×3 → BN, plus the input (a 1×1 conv + BN where the shape changes), → ReLU."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class CaptchaResNet(nn.Module):
    def __init__(self, channels: int, length: int, num_classes: int, width: int = 32,
                 blocks: tuple[int, ...] = (1, 1, 1)):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(channels, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width),
                                  nn.ReLU())
        layers, cin = [], width
        for stage, count in enumerate(blocks):
            cout = width * 2**stage
            for i in range(count):
                layers.append(Block(cin, cout, 2 if stage > 0 and i == 0 else 1))
                cin = cout
        self.stages = nn.Sequential(*layers)
        self.columns = nn.AdaptiveAvgPool2d((1, length))  # one column of features per character position
        self.head = nn.Conv2d(cin, num_classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.columns(self.stages(self.stem(x))))  # (N, classes, 1, length)
        return logits.flatten(2).transpose(1, 2)  # (N, length, classes)


def build(image, width: int = 32, blocks: list[int] = (1, 1, 1)) -> nn.Module:
    """raysweep's model factory: `image` is the spec's image (channels, height, width, length, num_classes)."""
    return CaptchaResNet(image.channels, image.length, image.num_classes, width, tuple(blocks))
