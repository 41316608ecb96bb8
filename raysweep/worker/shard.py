"""Data on the rank, resident once (device memory on a GPU): the whole training set, of which each epoch gives this
rank a uniform share cut into equal micro-batches; its contiguous part of the validation set; the model's input.

Every rank holds the whole training set so that each epoch can deal the ranks a fresh share of one permutation of
it, as torch's DistributedSampler does (`epoch_plan`): users' folders list their files by label, and a rank that
kept one contiguous part would train on a third of the alphabet, with BatchNorm's statistics and the gradient noise
scale (which compares the ranks' gradients) measuring the gap between thirds. What that costs, measured on the CPU
and in device memory, is in benchmarks/RESULTS.md (shard_cost).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.nn.parameter import is_lazy

from raysweep.data import CaptchaArrays


def shard_bounds(n: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, stop) of rank's contiguous part of n samples; parts differ by at most one (the validation set)."""
    return n * rank // world_size, n * (rank + 1) // world_size


def epoch_plan(n: int, num_batches: int, micro_batch: int, seed: int, epoch: int, rank: int,
               world_size: int) -> np.ndarray:
    """This rank's training samples for one epoch, (num_batches, micro_batch) indices into the whole training set of
    n: the epoch's optimizer steps × accumulation micro-batches, each of exactly `micro_batch` samples.

    One permutation of the whole set per epoch, seeded by (seed, epoch) and so the same on every rank; rank r takes
    the r-th of world_size equal shares and from it whole micro-batches (DistributedSampler and the DataLoader with
    drop_last: the n mod world_size samples past the last share and each share's remainder past its whole steps sit
    out this epoch, different ones every epoch). Every micro-batch has one size, so a compiled step has one shape to
    compile and a CUDA graph one to replay, and a step takes the per-GPU batch its peak LR is scaled for; every
    sample is used at most once per epoch, and every rank makes the same number of micro-batches (DDP's collectives
    need that).
    """
    share = n // world_size
    if share < num_batches * micro_batch:
        raise ValueError(
            f"a rank's share of {share} samples cannot fill {num_batches} micro-batches of {micro_batch} per epoch; "
            f"use more data or a smaller per-GPU batch"
        )
    perm = np.random.default_rng([seed, epoch]).permutation(n)
    return perm[rank * share: rank * share + num_batches * micro_batch].reshape(num_batches, micro_batch)


def plan_to_device(plan: np.ndarray, device: torch.device) -> torch.Tensor:
    """The epoch's plan on the device: one copy, from pinned memory on a GPU (asynchronous: the host does not
    wait for it); micro-batch k is row k."""
    flat = torch.from_numpy(plan)
    if device.type == "cuda":
        flat = flat.pin_memory().to(device, non_blocking=True)
    return flat


def channels_last_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    n, c, h, w = shape
    return h * w * c, 1, w * c, c


@dataclass
class Shard:
    """Samples resident on the training device: a rank's whole training set or its part of the validation set."""

    images: torch.Tensor  # (n, H, W) uint8 grayscale or (n, H, W, 3) RGB, on the training device
    labels: torch.Tensor  # (n, length) int64
    targets: torch.Tensor  # (n, length × classes) float one-hot, built once, not per step

    @classmethod
    def build(cls, arrays: CaptchaArrays, num_classes: int, device: torch.device, rank: int = 0,
              world_size: int = 1) -> Shard:
        """Rank `rank`'s contiguous part of `arrays` (all of it with world_size 1: the training set, which
        `epoch_plan` deals out), on `device`."""
        start, stop = shard_bounds(len(arrays), rank, world_size)
        with warnings.catch_warnings():
            # the object store hands out read-only arrays; torch only ever reads this one
            warnings.simplefilter("ignore", UserWarning)
            images = torch.from_numpy(arrays.images[start:stop])  # a view on CPU; copied once to a GPU
        labels = torch.from_numpy(arrays.labels[start:stop].astype(np.int64))
        targets = nn.functional.one_hot(labels, num_classes).flatten(1).float()
        return cls(images.to(device), labels.to(device), targets.to(device))

    def __len__(self) -> int:
        return len(self.labels)

    def batch(self, idx: torch.Tensor, channels_last: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """The micro-batch `idx`: model input (in the model's layout: `model_input`) and one-hot targets, sliced on
        the device (no host work)."""
        return model_input(self.images[idx], channels_last), self.targets[idx]


def rank_shards(data, num_classes: int, device: torch.device, rank: int, world_size: int) -> tuple[Shard, Shard]:
    """(training, validation) on a rank's device: the whole training set (each epoch deals this rank its share:
    epoch_plan) and the rank's contiguous part of the validation set (evaluation sums over the ranks, so which part
    a rank holds changes nothing). `data`: data.CaptchaData."""
    return (Shard.build(data.train, num_classes, device),
            Shard.build(data.val, num_classes, device, rank, world_size))


def wants_channels_last(model: nn.Module) -> bool:
    """Whether `model`'s convolutions run NHWC: its 4-D weights are laid out channels_last, as raysweep's CNN makes
    its own (model.captcha_cnn) and as a module's own `.to(memory_format=torch.channels_last)` makes any. Weights
    whose strides fit both layouts (a 1×1 kernel, one input channel) say nothing, nor do a lazy layer's before its
    first forward has sized them (models.size_lazy). Its batches come in that layout (`model_input`)."""
    last = torch.channels_last
    told = [w for w in model.parameters() if not is_lazy(w) and w.dim() == 4
            and w.is_contiguous() != w.is_contiguous(memory_format=last)]
    return bool(told) and all(w.is_contiguous(memory_format=last) for w in told)


def model_input(images: torch.Tensor, channels_last: bool = True) -> torch.Tensor:
    """uint8 (B, H, W) or (B, H, W, C) → float (B, C, H, W) in [0, 1]: NHWC for a model whose convolutions run
    NHWC (`channels_last`: `wants_channels_last`), else contiguous NCHW, PyTorch's default.

    A model in NCHW is never handed NHWC batches: its convolutions would follow the input's layout, and oneDNN's
    1×1 stride-2 weight gradient in NHWC with fewer channels than its block writes past its workspace
    (uxlfoundation/oneDNN#6035: every ResNet's shortcut; a user's ResNet died of it on the CPU,
    tests/test_models.py). For one channel, NCHW strides are the unsqueezed image's own: no copy either way.

    With one channel, (B, 1, H, W) holds the same bytes in NCHW and NHWC, and `contiguous(channels_last)` keeps
    the NCHW strides. cuDNN reads the layout from the strides, so it converted every batch to NHWC and back (on
    an H100 at batch 1024, compiled: 70.5 k images/s with the conversions, 82.0 k without); the NHWC strides
    say what the bytes already are. RGB images are stored HWC, so the same view (a permute) is NHWC already.
    """
    if not channels_last:
        x = images.permute(0, 3, 1, 2).contiguous() if images.dim() == 4 else images.unsqueeze(1)
        return x.float().div_(255.0)
    if images.dim() == 4:  # (B, H, W, C): NHWC as stored
        return images.permute(0, 3, 1, 2).float().div_(255.0)  # `float()` keeps the strides
    x = images.unsqueeze(1)
    x = x.as_strided(x.shape, channels_last_strides(x.shape))  # the same bytes, no copy
    return x.float().div_(255.0)
