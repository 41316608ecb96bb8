"""A CRNN without BatchNorm: convolutions, then a bidirectional GRU that reads the image left to right; a model of
your own for raysweep (docs/your-model.md).

    model:
      factory: "crnn:build"            # this file's folder is the working directory or the spec's folder
      kwargs: {width: 32, hidden: 64}

Three conv → ReLU → max-pool blocks turn the image into a sequence of columns (the height folded into the
features), a bidirectional GRU runs along the width, and the sequence is averaged into one step per character
position, each mapped to the charset: logits (N, length, num_classes). raysweep's loss is a per-position
classification (not CTC), so the positions are fixed slots along the width, as the captchas draw them.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class CaptchaCRNN(nn.Module):
    def __init__(self, channels: int, height: int, length: int, num_classes: int, width: int = 32, hidden: int = 64):
        super().__init__()
        layers, cin = [], channels
        for cout in (width, 2 * width, 2 * width):
            layers += [nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)]
            cin = cout
        self.features = nn.Sequential(*layers)
        self.rnn = nn.GRU(cin * (height // 8), hidden, batch_first=True, bidirectional=True)
        self.length = length
        self.head = nn.Linear(2 * hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = self.features(x)  # (N, C, H/8, W/8)
        seq = f.permute(0, 3, 1, 2).flatten(2)  # (N, W/8, C × H/8): one step per column, left to right
        out, _ = self.rnn(seq)  # (N, W/8, 2 × hidden)
        slots = F.adaptive_avg_pool1d(out.transpose(1, 2), self.length).transpose(1, 2)  # (N, length, 2 × hidden)
        return self.head(slots)  # (N, length, classes)


def build(image, width: int = 32, hidden: int = 64) -> nn.Module:
    """raysweep's model factory: `image` is the spec's image (channels, height, width, length, num_classes)."""
    return CaptchaCRNN(image.channels, image.height, image.length, image.num_classes, width, hidden)
