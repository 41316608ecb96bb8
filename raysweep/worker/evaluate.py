"""Evaluation on a rank's validation shard: loss, exact and per-character matches, as sums on the device."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from raysweep.config import TrialConfig
from raysweep.worker.device import autocast
from raysweep.worker.shard import Shard
from raysweep.worker.step import LOSS_FN


@dataclass
class EvalSums:
    """One rank's validation pass, as sums on the device."""

    loss_sum: torch.Tensor  # Σ loss × batch size
    samples: int
    exact: torch.Tensor  # captchas with every character right
    chars: torch.Tensor  # characters right
    char_total: int


@torch.no_grad()
def evaluate(model: nn.Module, shard: Shard, trial: TrialConfig, precision: str = "fp32",
             channels_last: bool = True) -> EvalSums:
    """Sums over the rank's validation shard: loss × n, exact matches, right characters (`channels_last`: the
    model's layout, RankModel.channels_last)."""
    model.eval()
    device = shard.images.device
    length, classes = trial.image.length, trial.image.num_classes
    zero = torch.zeros((), device=device, dtype=torch.float64)
    loss_sum, exact, chars = zero.clone(), zero.clone(), zero.clone()
    batch = trial.micro_batch_size
    with autocast(device, precision):
        for start in range(0, len(shard), batch):
            idx = torch.arange(start, min(start + batch, len(shard)), device=device)
            x, y = shard.batch(idx, channels_last)
            logits = model(x).float().reshape(len(idx), length, classes)  # the model's (N, L, C) or (N, L × C)
            loss_sum += LOSS_FN(logits.flatten(1), y) * len(idx)
            right = logits.argmax(-1) == shard.labels[idx]
            chars += right.sum()
            exact += right.all(dim=1).sum()
    return EvalSums(loss_sum, len(shard), exact, chars, len(shard) * length)
