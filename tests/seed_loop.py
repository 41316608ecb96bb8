"""The seeds' training loop, as the users ran it before raysweep: the reference that tests/test_model.py and
tests/test_loop_pieces.py hold raysweep's model and step to, and the baseline of benchmarks/loop_vs_seed.py.

A torch Dataset opens each PNG with PIL per sample, a DataLoader batches them (optionally in worker
processes), the model is the plain nn.Sequential with nn.Dropout, fp32, and every step syncs for
`loss.item()`. Same architecture, loss and optimizer as raysweep's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn


class PngCaptchas(torch.utils.data.Dataset):
    def __init__(self, folder: Path, charset: str):
        self.files = sorted(Path(folder).glob("*.png"))
        self.index = {c: i for i, c in enumerate(charset)}
        self.classes = len(charset)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i):
        from PIL import Image

        path = self.files[i]
        with Image.open(path) as im:
            x = torch.from_numpy(np.asarray(im.convert("L"), dtype=np.float32) / 255.0).unsqueeze(0)
        label = torch.tensor([self.index[c] for c in path.name.split("_")[0]])
        return x, nn.functional.one_hot(label, self.classes).flatten().float()


def seed_model(height: int, width: int, length: int, num_classes: int, dropout: float = 0.5) -> nn.Sequential:
    def block(i, o):
        return [nn.Conv2d(i, o, 3, padding=1), nn.BatchNorm2d(o), nn.Dropout(dropout), nn.ReLU(), nn.MaxPool2d(2)]

    return nn.Sequential(
        *block(1, 32), *block(32, 64), *block(64, 64), nn.Flatten(),
        nn.Linear(64 * (height // 8) * (width // 8), 1024), nn.Dropout(dropout), nn.ReLU(),
        nn.Linear(1024, length * num_classes),
    )


def copy_weights(src: nn.Module, dst: nn.Module) -> None:
    """Same architecture, different module names: copy parameters and buffers in order."""
    with torch.no_grad():
        for a, b in zip(src.state_dict().values(), dst.state_dict().values(), strict=True):
            b.copy_(a)


def train_steps(model, loader, steps: int, lr: float = 1e-3) -> list[float]:
    """The seeds' step: forward, loss, backward, AdamW step, and a .item() sync every step."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    loss_fn = nn.MultiLabelSoftMarginLoss()
    model.train()
    losses = []
    while len(losses) < steps:
        for x, y in loader:
            loss = loss_fn(model(x), y)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(loss.item())
            if len(losses) == steps:
                break
    return losses
