"""The captcha CNN: 3 conv blocks, then two linear layers, one logit per (position, character)."""

from __future__ import annotations

import torch
from torch import nn


def conv_block(in_channels: int, out_channels: int, dropout: float) -> nn.Sequential:
    """Conv 3×3 pad 1 → BatchNorm → Dropout → ReLU → MaxPool 2 (the original model's order)."""
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1),
        nn.BatchNorm2d(out_channels),
        nn.Dropout(dropout),
        nn.ReLU(),
        nn.MaxPool2d(2),
    )


class CaptchaCNN(nn.Module):
    """Input (B, 1, H, W) floats in [0, 1]; output (B, length × num_classes) logits."""

    def __init__(self, height: int, width: int, length: int, num_classes: int, dropout: float = 0.5):
        super().__init__()
        self.length, self.num_classes = length, num_classes
        self.features = nn.Sequential(conv_block(1, 32, dropout), conv_block(32, 64, dropout), conv_block(64, 64, dropout))
        # three 2× pools, each flooring: 60×160 → 30×80 → 15×40 → 7×20
        flat = 64 * (height // 8) * (width // 8)
        self.head = nn.Sequential(
            nn.Flatten(),
            nn.Linear(flat, 1024),
            nn.Dropout(dropout),
            nn.ReLU(),
            nn.Linear(1024, length * num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))
