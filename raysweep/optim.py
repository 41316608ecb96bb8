"""Optimizer, LR scaling rule and the warmup + cosine schedule (pure math first, torch after)."""

from __future__ import annotations

import math

LR_RULE_POWER = {"linear": 1.0, "sqrt": 0.5, "none": 0.0}


def scaled_lr(base_lr: float, global_batch_size: int, reference_batch_size: int, rule: str) -> float:
    """peak_lr = base_lr × (global_batch_size / reference_batch_size) ** p; p = 1 (linear), ½ (sqrt), 0 (none)."""
    return base_lr * (global_batch_size / reference_batch_size) ** LR_RULE_POWER[rule]


def lr_at(step: int, peak_lr: float, min_lr: float, warmup_steps: int, total_steps: int) -> float:
    """LR for optimizer step `step` (0-based).

    1. warmup, step < W:          peak × (step + 1) / W   (the first step already moves; step W-1 is at peak)
    2. cosine, W ≤ step < T:      floor + (peak − floor) × ½ (1 + cos(π (step − W) / (T − W)))
    3. floor,  step ≥ T:          floor
    with floor = min(min_lr, peak_lr), so a tiny peak never schedules upwards.
    """
    floor = min(min_lr, peak_lr)
    if step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    if step >= total_steps:
        return floor
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return floor + (peak_lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def param_groups(model, weight_decay: float) -> list[dict]:
    """Decay matrices and conv kernels; never biases or norm weights (decay would pull them to 0)."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model, peak_lr: float, weight_decay: float, device_type: str, capturable: bool = False):
    """AdamW. `capturable`: the step count and the LR live on the device (the LR as a tensor the scheduler fills),
    so that a CUDA graph can replay the optimizer step with the schedule's current LR."""
    import torch

    # fused AdamW: one kernel for all parameters instead of a chain per tensor (CUDA; CPU since 2.4).
    fused = device_type in ("cuda", "cpu")
    groups = param_groups(model, weight_decay)
    if capturable:  # one LR tensor per group: the scheduler fills each in place (never the same tensor twice)
        device = next(model.parameters()).device
        for group in groups:
            group["lr"] = torch.tensor(peak_lr, dtype=torch.float32, device=device)
    return torch.optim.AdamW(groups, lr=peak_lr, betas=(0.9, 0.999), fused=fused, capturable=capturable)


class WarmupCosine:
    """`lr_at` as a LambdaLR factor; a callable object so the scheduler's state_dict stays plain data."""

    def __init__(self, peak_lr: float, min_lr: float, warmup_steps: int, total_steps: int):
        self.peak_lr, self.min_lr = peak_lr, min_lr
        self.warmup_steps, self.total_steps = warmup_steps, total_steps

    def __call__(self, step: int) -> float:
        return lr_at(step, self.peak_lr, self.min_lr, self.warmup_steps, self.total_steps) / self.peak_lr


def build_scheduler(optimizer, peak_lr: float, min_lr: float, warmup_steps: int, total_steps: int):
    """Stepped once per optimizer step; param groups start at peak_lr so the factor is lr_at / peak."""
    import torch

    return torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupCosine(peak_lr, min_lr, warmup_steps, total_steps))
