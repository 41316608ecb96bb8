"""The per-worker DDP loop of one trial, and the `TorchTrainer` that runs it.

Every rank: build → (resume) → for each epoch: train one epoch, evaluate, reduce, report (+ checkpoint).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import tempfile
import time
import warnings
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from raysweep.config import TrialConfig
from raysweep.data import CaptchaArrays
from raysweep.model import CaptchaCNN
from raysweep.optim import build_optimizer, build_scheduler

log = logging.getLogger(__name__)

CHECKPOINT_FILE = "state.pt"
GiB = 2**30
AUTOCAST_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_precision(precision: str, device: torch.device) -> str:
    """`auto` → bf16 on a GPU that supports it, else fp32 (bf16 ran 3× slower than fp32 on the AVX2 CPUs here)."""
    if precision != "auto":
        return precision
    return "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"


def keep_freed_memory_in_heap() -> bool:
    """glibc: serve large tensors from the heap and keep them there once freed.

    By default every allocation over 32 MB is a fresh mmap, page-faulted on first touch and unmapped
    on free, so each step re-faults every activation: a 157 MB elementwise pass took 77 ms into new
    memory and 13 ms into reused memory here (benchmarks/RESULTS.md). Returns False where it does not apply.
    """
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_max = -1, -4
    return bool(libc.mallopt(m_mmap_max, 0)) and bool(libc.mallopt(m_trim_threshold, 2**31 - 1))


# ---------------------------------------------------------------------------------------------
# Data on the rank: a contiguous shard, resident once (device memory on GPU), sliced per batch.


def shard_bounds(n: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, stop) of rank's contiguous share of n samples; shares differ by at most one."""
    return n * rank // world_size, n * (rank + 1) // world_size


def epoch_plan(shard_size: int, num_batches: int, seed: int, epoch: int, rank: int) -> list[np.ndarray]:
    """Shard indices for one epoch: a seeded permutation cut into `num_batches` near-equal micro-batches.

    Every sample is used exactly once per epoch and every rank makes the same number of micro-batches
    (DDP's collectives need that), so micro-batches are within one sample of shard / num_batches.
    """
    if shard_size < num_batches:
        raise ValueError(
            f"a rank's shard of {shard_size} samples cannot fill {num_batches} micro-batches per epoch; "
            f"use more data or fewer workers / accumulation steps"
        )
    perm = np.random.default_rng([seed, epoch, rank]).permutation(shard_size)
    return np.array_split(perm, num_batches)


@dataclass
class Shard:
    images: torch.Tensor  # (n, H, W) uint8, on the training device
    labels: torch.Tensor  # (n, length) int64
    targets: torch.Tensor  # (n, length × classes) float one-hot, built once, not per step

    @classmethod
    def build(cls, arrays: CaptchaArrays, rank: int, world_size: int, num_classes: int, device: torch.device):
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

    def batch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """uint8 → float in [0, 1] on the device; no host work beyond launching kernels.

        With one channel, (B, 1, H, W) contiguous is already channels_last in memory: no copy.
        """
        x = self.images[idx].unsqueeze(1).float().div_(255.0)
        return x.contiguous(memory_format=torch.channels_last), self.targets[idx]


# ---------------------------------------------------------------------------------------------
# The worker function


def train_worker(config: dict) -> None:
    """Ray Train entry point on every rank; `config` = {"trial": TrialConfig dict, "data": ObjectRef}."""
    import ray
    import ray.train
    import ray.train.torch

    trial = TrialConfig.from_dict(config["trial"])
    _quiet_ray_train_logs()
    keep_freed_memory_in_heap()
    data = ray.get(config["data"])  # zero-copy from the node's object store
    ctx = ray.train.get_context()
    rank, world_size = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device()
    tc, img = trial.train, trial.image

    torch.manual_seed(tc.seed)  # identical init on every rank (DDP also broadcasts rank 0's weights)
    model = build_model(trial)
    model = ray.train.torch.prepare_model(model)  # to device; DDP only when world_size > 1
    core = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    if tc.compile:
        model = torch.compile(model)  # after DDP wrapping, so DDP's bucketing sees the compiled graph
    optimizer = build_optimizer(core, trial.peak_lr, trial.knobs.weight_decay, device.type)
    scheduler = build_scheduler(optimizer, trial.peak_lr, tc.min_lr, trial.warmup_steps, trial.total_steps)
    precision = resolve_precision(tc.precision, device)
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")

    start_epoch, samples_seen = 1, 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            state = torch.load(os.path.join(d, CHECKPOINT_FILE), map_location=device, weights_only=True)
        core.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        scaler.load_state_dict(state["scaler"])
        start_epoch, samples_seen = state["epoch"] + 1, state["samples_seen"]
        if rank == 0:
            log.info("resumed from checkpoint at epoch %d", state["epoch"])

    train = Shard.build(data.train, rank, world_size, img.num_classes, device)
    val = Shard.build(data.val, rank, world_size, img.num_classes, device)
    del data
    loss_fn = nn.MultiLabelSoftMarginLoss()

    for epoch in range(start_epoch, tc.epochs + 1):
        # a fresh, epoch-derived seed: dropout and shuffling replay exactly after a resume
        torch.manual_seed(hash((tc.seed, epoch, rank)) & 0x7FFF_FFFF)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        sums = train_one_epoch(model, train, optimizer, scheduler, scaler, loss_fn, trial, epoch, rank, precision)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # once per epoch: make the timing honest
        train_time = time.perf_counter() - t0
        sums.update(evaluate(core, val, loss_fn, trial, precision))
        metrics = reduce_metrics(sums, train_time, time.perf_counter() - t0, device)
        samples_seen += int(metrics.pop("train_samples"))
        metrics.update(epoch=epoch, samples_seen=samples_seen, lr=scheduler.get_last_lr()[0])
        if rank == 0:
            metrics["device_name"] = _device_name(device)
            metrics["precision_used"] = precision

        due = epoch % tc.checkpoint_every == 0 or epoch == tc.epochs
        report(metrics, rank, due, lambda: {
            "model": core.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict(), "epoch": epoch, "samples_seen": samples_seen,
        })


def build_model(trial: TrialConfig) -> nn.Module:
    img = trial.image
    model = CaptchaCNN(img.height, img.width, img.length, img.num_classes, trial.model.dropout)
    # NHWC: oneDNN's and cuDNN's fast conv layouts (1.3× on the CPU step here, benchmarks/RESULTS.md)
    return model.to(memory_format=torch.channels_last)


def train_one_epoch(model, shard, optimizer, scheduler, scaler, loss_fn, trial: TrialConfig, epoch: int, rank: int,
                    precision: str = "fp32") -> dict:
    """One pass over the rank's shard; returns on-device sums (no host sync inside)."""
    tc = trial.train
    accum = trial.knobs.grad_accum_steps
    device = shard.images.device
    plan = epoch_plan(len(shard), trial.steps_per_epoch * accum, tc.seed, epoch, rank)
    plan = [torch.from_numpy(idx).to(device, non_blocking=True) for idx in plan]
    autocast = _autocast(device, precision)
    max_norm = tc.grad_clip if tc.grad_clip is not None else math.inf
    params = [p for p in model.parameters() if p.requires_grad]
    zero = torch.zeros((), device=device, dtype=torch.float64)
    loss_sum, grad_norm_sum, clipped = zero.clone(), zero.clone(), zero.clone()
    grad_norm_max = torch.zeros((), device=device, dtype=torch.float32)
    samples = 0

    model.train()
    for step in range(trial.steps_per_epoch):
        for micro in range(accum):
            idx = plan[step * accum + micro]
            x, y = shard.batch(idx)
            # DDP all-reduces gradients in backward; skip it on all but the last micro-step
            sync = micro == accum - 1 or not hasattr(model, "no_sync")
            with contextlib.nullcontext() if sync else model.no_sync():
                with autocast:
                    logits = model(x)
                loss = loss_fn(logits.float(), y)
                scaler.scale(loss / accum).backward()
            loss_sum += loss.detach() * len(idx)
            samples += len(idx)
        scaler.unscale_(optimizer)  # clip and log the true norm, not the fp16-scaled one
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        grad_norm_sum += norm
        grad_norm_max = torch.maximum(grad_norm_max, norm.float())
        clipped += norm > max_norm
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
    return {
        "train_loss_sum": loss_sum, "train_samples": samples, "grad_norm_sum": grad_norm_sum,
        "clipped_steps": clipped, "optimizer_steps": trial.steps_per_epoch, "grad_norm_max": grad_norm_max,
    }


@torch.no_grad()
def evaluate(model, shard: Shard, loss_fn, trial: TrialConfig, precision: str = "fp32") -> dict:
    """Sums over the rank's validation shard: loss × n, exact matches, right characters."""
    model.eval()
    device = shard.images.device
    length, classes = trial.image.length, trial.image.num_classes
    zero = torch.zeros((), device=device, dtype=torch.float64)
    loss_sum, exact, chars = zero.clone(), zero.clone(), zero.clone()
    batch = trial.knobs.per_gpu_batch_size
    with _autocast(device, precision):
        for start in range(0, len(shard), batch):
            idx = torch.arange(start, min(start + batch, len(shard)), device=device)
            x, y = shard.batch(idx)
            logits = model(x).float()
            loss_sum += loss_fn(logits, y) * len(idx)
            right = logits.view(-1, length, classes).argmax(-1) == shard.labels[idx]
            chars += right.sum()
            exact += right.all(dim=1).sum()
    return {"val_loss_sum": loss_sum, "val_samples": len(shard), "val_exact": exact, "val_chars": chars,
            "val_char_total": len(shard) * length}


def reduce_metrics(sums: dict, train_time: float, epoch_time: float, device: torch.device) -> dict:
    """Two collectives per epoch (a SUM and a MAX); the one host sync of the epoch is here."""
    import psutil

    def tensor(values):
        return torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device) for v in values])

    s = tensor([sums[k] for k in ("train_loss_sum", "train_samples", "val_loss_sum", "val_samples", "val_exact",
                                  "val_chars", "val_char_total", "grad_norm_sum", "clipped_steps", "optimizer_steps")])
    cuda = device.type == "cuda"
    m = tensor([
        sums["grad_norm_max"],
        torch.cuda.max_memory_allocated(device) / GiB if cuda else 0.0,
        torch.cuda.max_memory_reserved(device) / GiB if cuda else 0.0,
        psutil.Process().memory_info().rss / GiB,
        train_time,
        epoch_time,
    ])
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(s, op=dist.ReduceOp.SUM)
        dist.all_reduce(m, op=dist.ReduceOp.MAX)
    (loss, n, vloss, vn, exact, chars, char_total, gsum, clipped, steps), maxes = s.tolist(), m.tolist()
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    steps /= world  # every rank counted the same optimizer steps
    clipped /= world
    gsum /= world
    return {
        "train_samples": n,
        "train_loss": loss / max(n, 1),
        "val_loss": vloss / max(vn, 1),
        "val_exact_acc": exact / max(vn, 1),
        "val_char_acc": chars / max(char_total, 1),
        "grad_norm": gsum / max(steps, 1),
        "grad_norm_max": maxes[0],
        "clip_fraction": clipped / max(steps, 1),
        "epoch_time_s": maxes[5],
        "samples_per_s": n / max(maxes[4], 1e-9),
        "peak_mem_allocated_gb": maxes[1],
        "peak_mem_reserved_gb": maxes[2],
        "rss_gb": maxes[3],
    }


def report(metrics: dict, rank: int, checkpoint_due: bool, state_fn) -> None:
    """Every rank reports (it is a collective); rank 0 alone attaches the checkpoint."""
    import ray.train

    if rank == 0 and checkpoint_due:
        with tempfile.TemporaryDirectory() as d:
            torch.save(state_fn(), os.path.join(d, CHECKPOINT_FILE))
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d))
    else:
        ray.train.report(metrics)


def _autocast(device: torch.device, precision: str):
    dtype = AUTOCAST_DTYPES[precision]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({torch.get_num_threads()} threads)"


def _quiet_ray_train_logs() -> None:
    # the per-report INFO line ignores LoggingConfig: its logger is named by file path (RAY_NOTES.md)
    try:
        import ray.train.v2._internal.execution.context as context

        logging.getLogger(context.__file__).setLevel(logging.WARNING)
    except ImportError:
        pass


# ---------------------------------------------------------------------------------------------


def make_trainer(trial: TrialConfig, data_ref, storage_path: str, name: str, callbacks=()):
    """A `TorchTrainer` for one trial. `name` must be deterministic: an existing run resumes."""
    from ray.train import CheckpointConfig, FailureConfig, LoggingConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    resources = {"CPU": trial.scaling.cpus_per_worker}
    if trial.scaling.use_gpu:
        resources["GPU"] = 1
    return TorchTrainer(
        train_worker,
        train_loop_config={"trial": trial.to_dict(), "data": data_ref},
        scaling_config=ScalingConfig(
            num_workers=trial.scaling.num_workers, use_gpu=trial.scaling.use_gpu, resources_per_worker=resources
        ),
        run_config=RunConfig(
            name=name,
            storage_path=storage_path,
            callbacks=list(callbacks),
            checkpoint_config=CheckpointConfig(num_to_keep=1),
            # worker crashes restart from the last checkpoint; a group that cannot start is retried
            # once, so the wait is bounded by 2 × worker_start_timeout_s
            failure_config=FailureConfig(max_failures=trial.train.max_failures, controller_failure_limit=1),
            logging_config=LoggingConfig(log_level="WARNING"),
        ),
    )
