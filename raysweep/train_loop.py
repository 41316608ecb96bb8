"""The rank side of a trial: the per-worker DDP loop (build, step, evaluate, reduce, checkpoint).

Every rank: build → (resume) → for each epoch: train one epoch, evaluate, reduce, report (+ checkpoint).
Imports no Ray at module level: the loop runs (and is tested) in a plain process too. The
`TorchTrainer` that runs it is built in cluster.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
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
from raysweep.metrics import EpochMetrics, WorkerParams, report_dict
from raysweep.model import build_model
from raysweep.noise import estimate
from raysweep.optim import build_optimizer, build_scheduler

log = logging.getLogger(__name__)

CHECKPOINT_FILE = "state.pt"
GiB = 2**30
AUTOCAST_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
LOSS_FN = nn.MultiLabelSoftMarginLoss()  # mean over batch and classes, on one-hot targets


def resolve_precision(precision: str, device: torch.device) -> str:
    """`auto` → bf16 where the hardware computes it natively (GPUs that support it; CPUs with AVX512-BF16
    or AMX), else fp32.

    Measured on the CPU step (benchmarks/RESULTS.md): an AVX512-BF16 CPU ran bf16 autocast 2-2.5× faster
    than fp32 (batch 64-512, same loss to 0.1 %); an AVX2-only CPU ran it 3× slower, emulated.
    """
    if precision != "auto":
        return precision
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp32"
    return "bf16" if cpu_has_native_bf16() else "fp32"


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX tiles, as torch's CPU dispatch sees them (private probes: absent → False, fp32)."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)


def _libc():
    import ctypes

    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to tune
        return None


def keep_host_memory(device: torch.device) -> bool:
    """CPU workers: serve large tensors from glibc's heap and keep them there between steps.

    Otherwise every activation over 32 MB is a fresh mmap, page-faulted on first touch and unmapped
    when freed, every step. At batch 512 on this project's 2-core CPU the step ran 101-120 images/s
    this way against 65-69 with huge pages alone, at a peak RSS of 6.6 GiB against 3.4 GiB
    (benchmarks/RESULTS.md). `release_host_memory()` at each epoch's end bounds the heap.
    GPU workers keep glibc's default: their activations live on the GPU.
    """
    libc = _libc()
    if device.type != "cpu" or libc is None:
        return False
    m_trim_threshold, m_mmap_max = -1, -4
    return bool(libc.mallopt(m_mmap_max, 0)) and bool(libc.mallopt(m_trim_threshold, 2**31 - 1))


def release_host_memory() -> None:
    """Give free heap pages back to the OS (once per epoch), so fragmentation cannot accumulate."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


class TrialFailure(Exception):
    """A failure every rank agreed on (OOM past the downshifts, divergence): the trial ends, no retry."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class FaultInjection:
    """Test-only switches (CPU has no allocator limit, and NaNs are hard to provoke on purpose).

    RAYSWEEP_TEST_OOM_ABOVE=N: the training step raises torch.OutOfMemoryError when the per-GPU
    micro-batch exceeds N. RAYSWEEP_TEST_NAN_AT_STEP=K: the loss is NaN at optimizer step K (1-based).
    Everything else on the path is the real one. They reach workers through `cluster.worker_env()`.
    """

    oom_above: int | None = None
    nan_at_step: int | None = None

    @classmethod
    def from_env(cls) -> FaultInjection:
        def read(name):
            value = os.environ.get(name)
            return int(value) if value else None

        return cls(read("RAYSWEEP_TEST_OOM_ABOVE"), read("RAYSWEEP_TEST_NAN_AT_STEP"))

    def check_oom(self, micro_batch: int) -> None:
        if self.oom_above is not None and micro_batch > self.oom_above:
            raise torch.OutOfMemoryError(f"RAYSWEEP_TEST_OOM_ABOVE={self.oom_above}: micro-batch {micro_batch}")


FAULTS = FaultInjection.from_env()


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
# One rank's model: the build that training and the probe share


@dataclass
class RankModel:
    """One rank's model (`model` for the step: DDP-wrapped and/or compiled; `core` for evaluation and
    checkpoints), its optimizer, the precision it runs and the fp16 scaler."""

    model: nn.Module
    core: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    precision: str
    device: torch.device
    noise: GradNoiseMeter | None = None  # the gradient noise scale's measurements (None: not measured)

    @classmethod
    def build(cls, trial: TrialConfig, device: torch.device, wrap=None, compile: bool = False,
              measure_noise: bool = True) -> RankModel:
        """`wrap`: `ray.train.torch.prepare_model` on a worker (to the device; DDP when world size > 1).
        `measure_noise=False`: no GradNoiseMeter (benchmarks/noise_cost.py measures what it costs)."""
        torch.manual_seed(trial.train.seed)  # identical init on every rank (DDP also broadcasts rank 0's weights)
        model = build_model(trial.image, trial.model.dropout)
        model = wrap(model) if wrap is not None else model.to(device)
        core = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
        noise = GradNoiseMeter.attach(model, device) if measure_noise else None  # on the DDP module: before compiling
        if compile:
            model = torch.compile(model)  # after DDP wrapping, so DDP's bucketing sees the compiled graph
        optimizer = build_optimizer(core, trial.peak_lr, trial.knobs.weight_decay, device.type)
        precision = resolve_precision(trial.train.precision, device)
        scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
        return cls(model, core, optimizer, scaler, precision, device, noise)


class GradNoiseMeter:
    """The measurements behind the gradient noise scale (noise.py has the estimator), summed on the device.

    Each optimizer step needs the squared norm of a small-batch gradient |G_b|² and of the big-batch one
    |G_B|² (the pre-clip norm the loop computes anyway, squared):
    - several ranks (DDP): a communication hook squares-and-sums every gradient bucket *before* the
      all-reduce (the rank's own gradient over micro-batch × accumulation samples: b), then all-reduces it
      averaged, exactly as DDP's default hook does. With `no_sync()` accumulation the hook runs once per
      step, on the accumulated buffer. No host sync, no extra collective: the sums join the epoch's
      all-reduce in `reduce_metrics`.
    - one rank with ≥ 2 micro-batches per step: each micro-batch's backward writes its own gradient
      (b = the micro-batch), squared-summed and then added to the step's sum by hand, as autograd would.
    - one rank, one micro-batch: no pair, nothing measured (the metrics are absent, not zero).
    fp16: the buffers hold GradScaler-scaled gradients; `step_done` divides by the scale², on the device.
    """

    def __init__(self, device: torch.device, ddp: bool):
        self.ddp = ddp
        zero = torch.zeros((), dtype=torch.float64, device=device)
        self.step_small = zero.clone()  # this step's Σ |G_b|² (DDP: over buckets; one rank: mean over micro-batches)
        self.small_sum, self.big_sum, self.steps = zero.clone(), zero.clone(), zero.clone()
        self._sum: list[torch.Tensor] | None = None  # one rank: the step's gradient so far (micro-batches before this)

    @classmethod
    def attach(cls, model: nn.Module, device: torch.device) -> GradNoiseMeter:
        ddp = isinstance(model, nn.parallel.DistributedDataParallel)
        meter = cls(device, ddp)
        if ddp:
            model.register_comm_hook(meter, _noise_hook)
        return meter

    def split(self, accum: int) -> int:
        """b_big / b_small for a step: the world size (DDP), the micro-batches (one rank), 1 = no pair."""
        return dist.get_world_size() if self.ddp else accum

    def before_backward(self, params: list[torch.Tensor], micro: int, accum: int) -> None:
        """One rank: let this micro-batch's backward write its gradient alone (the step's sum so far is kept)."""
        if not self.ddp and accum > 1 and micro > 0:
            for p in params:
                p.grad = None

    def after_backward(self, params: list[torch.Tensor], micro: int, accum: int) -> None:
        """One rank: add this micro-batch's |gradient|², then its gradient to the step's sum (which is what
        autograd's accumulation would have done: one extra read of the gradients per micro-batch)."""
        if self.ddp or accum < 2:
            return
        grads = [p.grad for p in params]
        # the backward saw loss / accum: |g_k|² = accum² |grad|², averaged over the step's accum micro-batches
        self.step_small += torch.stack(torch._foreach_norm(grads)).double().square().sum() * accum
        if micro == 0:
            self._sum = grads
        else:
            torch._foreach_add_(self._sum, grads)
        if micro == accum - 1:
            for p, g in zip(params, self._sum):
                p.grad = g
            self._sum = None

    def step_done(self, norm: torch.Tensor, inv_scale: torch.Tensor | float = 1.0) -> None:
        """After the step's backward(s): `norm` = the pre-clip norm of the (all-reduced, unscaled) gradient."""
        small = self.step_small * (inv_scale * inv_scale)
        ok = torch.isfinite(norm) & torch.isfinite(small)  # fp16 overflow steps are skipped, as the scaler skips them
        self.small_sum += torch.where(ok, small, 0.0)
        self.big_sum += torch.where(ok, norm.double().square(), 0.0)
        self.steps += ok
        self.step_small.zero_()

    def take(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The epoch's sums (Σ|G_b|², Σ|G_B|², steps), and start over."""
        sums = self.small_sum.clone(), self.big_sum.clone(), self.steps.clone()
        for t in (self.small_sum, self.big_sum, self.steps, self.step_small):
            t.zero_()
        self._sum = None
        return sums


def _noise_hook(meter: GradNoiseMeter, bucket):
    """DDP communication hook: the bucket's squared sum before the all-reduce, then DDP's default all-reduce.

    (dist.GradBucket) → torch.futures.Future[torch.Tensor]; unannotated: DDP compares annotations as
    objects, and this module's are strings (`from __future__ import annotations`)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    buffer = bucket.buffer()
    norm = torch.linalg.vector_norm(buffer, dtype=torch.promote_types(buffer.dtype, torch.float32))  # fp16 buckets too
    meter.step_small += norm.double().square()
    return allreduce_hook(None, bucket)


# ---------------------------------------------------------------------------------------------
# The worker function


def train_worker(config: dict) -> None:
    """Ray Train entry point on every rank; `config` = {"trial": TrialConfig dict, "data": ObjectRef, "failure_file",
    "resume_from": a checkpoint folder to load when Ray Train hands none (cluster.recover_torn_snapshot)}."""
    import ray
    import ray.train
    import ray.train.torch

    trial = TrialConfig.from_dict(config["trial"])
    quiet_ray_train_logs()
    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    data = ray.get(config["data"])  # zero-copy from the node's object store
    device = ray.train.torch.get_device()
    keep_host_memory(device)
    run = TrainingRun.build(trial, data, rank, ctx.get_world_size(), device, wrap=ray.train.torch.prepare_model)
    run.nodes = gather_strings(ray.get_runtime_context().get_node_id())
    del data
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None and config.get("resume_from"):  # Ray's checkpoint list was torn by a kill (cluster.py)
        checkpoint = ray.train.Checkpoint(config["resume_from"])
    start_epoch = run.restore(checkpoint)
    if run.last_report:
        # the checkpoint's epoch again (every rank): its report may have died with a killed driver, and a run
        # that had finished must end with its real final result; trackers skip what they already hold
        ray.train.report(run.last_report)
    try:
        run.fit_in_memory()
        for epoch in range(start_epoch, trial.train.epochs + 1):
            payload = report_dict(run.epoch(epoch), run.worker_params())
            due = epoch % trial.train.checkpoint_every == 0 or epoch == trial.train.epochs
            report(payload, rank, due, lambda: run.state(epoch, payload))
    except TrialFailure as failure:  # every rank raised it at the same point: end cleanly, no retry
        if rank == 0:
            write_failure(config["failure_file"], failure)


def write_failure(location: str, failure: TrialFailure) -> None:
    """Rank 0's half of the agreed-failure file (cluster.read_failure is the trial function's half)."""
    import json

    from raysweep import storage

    storage.write_text(location, json.dumps({"kind": failure.kind, "message": str(failure)}))


@dataclass
class TrainingRun:
    """One rank's model, schedule and data; `epoch()` trains, evaluates and reduces."""

    trial: TrialConfig
    net: RankModel
    scheduler: torch.optim.lr_scheduler.LRScheduler
    train: Shard
    val: Shard
    rank: int
    samples_seen: int = 0
    downshifts: int = 0
    nodes: str = ""  # every rank's Ray node id, by rank
    last_report: dict | None = None  # what the restored checkpoint's epoch reported

    @classmethod
    def build(cls, trial: TrialConfig, data, rank: int, world_size: int, device: torch.device, wrap=None) -> TrainingRun:
        net = RankModel.build(trial, device, wrap, compile=trial.train.compile)
        scheduler = build_scheduler(net.optimizer, trial.peak_lr, trial.train.min_lr, trial.warmup_steps,
                                    trial.total_steps)
        classes = trial.image.num_classes
        return cls(trial, net, scheduler, Shard.build(data.train, rank, world_size, classes, device),
                   Shard.build(data.val, rank, world_size, classes, device), rank)

    def restore(self, checkpoint) -> int:
        """Load a Ray Train checkpoint if there is one; returns the epoch to start at."""
        if checkpoint is None:
            return 1
        with checkpoint.as_directory() as d:
            state = torch.load(os.path.join(d, CHECKPOINT_FILE), map_location=self.net.device, weights_only=True)
        self.net.core.load_state_dict(state["model"])
        self.net.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.net.scaler.load_state_dict(state["scaler"])
        self.samples_seen = state["samples_seen"]
        self.last_report = state.get("report")
        if self.rank == 0:
            log.info("resumed from checkpoint at epoch %d", state["epoch"])
        return state["epoch"] + 1

    def fit_in_memory(self) -> None:
        """One probe step at the trial's micro-batch on every rank before training; on OOM halve the
        micro-batch and double accumulation (same global batch and LR), at most max_downshifts times."""
        for shift in range(self.trial.train.max_downshifts + 1):
            micro = self.trial.micro_batch_size
            if probe_step(self.net, self.trial, micro).fits:
                if shift and self.rank == 0:
                    log.warning("OOM at micro-batch %d: running %d × %d", 2 * micro, micro, self.trial.accumulation_steps)
                return
            if shift == self.trial.train.max_downshifts or micro == 1:
                break
            self.trial = self.trial.downshifted()
            self.downshifts += 1
        raise TrialFailure("oom", f"OOM at per-GPU batch {self.trial.knobs.per_gpu_batch_size} "
                                  f"(micro-batch {micro} after {self.downshifts} downshifts)")

    def state(self, epoch: int, reported: dict) -> dict:
        """The checkpoint: everything to continue after `epoch`, and what that epoch reported."""
        net = self.net
        return {"model": net.core.state_dict(), "optimizer": net.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "scaler": net.scaler.state_dict(), "epoch": epoch,
                "samples_seen": self.samples_seen, "report": reported}

    def worker_params(self) -> WorkerParams:
        return WorkerParams(device_name(self.net.device), self.net.precision, self.trial.micro_batch_size,
                            self.trial.accumulation_steps, self.downshifts, self.nodes)

    def epoch(self, epoch: int) -> EpochMetrics:
        """Train one epoch, evaluate, reduce across ranks."""
        device = self.net.device
        cuda = device.type == "cuda"
        # a fresh, epoch-derived seed: dropout and shuffling replay exactly after a resume
        torch.manual_seed(hash((self.trial.train.seed, epoch, self.rank)) & 0x7FFF_FFFF)
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        train = train_one_epoch(self.net, self.train, self.scheduler, self.trial, epoch, self.rank)
        if cuda:
            torch.cuda.synchronize(device)  # once per epoch: make the timing honest
        train_time_s = time.perf_counter() - t0
        val = evaluate(self.net.core, self.val, self.trial, self.net.precision)
        metrics = reduce_metrics(train, val, train_time_s=train_time_s, epoch_time_s=time.perf_counter() - t0,
                                 epoch=epoch, samples_before=self.samples_seen, lr=self.scheduler.get_last_lr()[0],
                                 device=device)
        self.samples_seen = metrics.samples_seen
        if not cuda:
            release_host_memory()
        return metrics


@dataclass
class TrainSums:
    """One rank's epoch, as sums on the device (no host sync until `reduce_metrics`)."""

    loss_sum: torch.Tensor  # Σ loss × micro-batch size
    samples: int
    grad_norm_sum: torch.Tensor  # Σ pre-clip global norm over optimizer steps
    grad_norm_max: torch.Tensor
    clipped_steps: torch.Tensor
    optimizer_steps: int
    noise_small: torch.Tensor | float = 0.0  # Σ over steps of |G_b|² (GradNoiseMeter), this rank
    noise_big: torch.Tensor | float = 0.0  # Σ over the same steps of |G_B|²
    noise_steps: torch.Tensor | float = 0.0  # steps measured
    noise_split: int = 1  # b_big / b_small (1: no pair, no estimate)


def train_one_epoch(net: RankModel, shard: Shard, scheduler, trial: TrialConfig, epoch: int, rank: int) -> TrainSums:
    """One pass over the rank's shard; returns on-device sums (no host sync inside)."""
    model, optimizer, scaler = net.model, net.optimizer, net.scaler
    tc = trial.train
    accum = trial.accumulation_steps
    device = shard.images.device
    num_batches = trial.micro_batches_per_epoch
    if len(shard) > (trial.micro_batch_size + 1) * num_batches:
        raise ValueError(f"a shard of {len(shard)} samples is more than {num_batches} micro-batches of "
                         f"{trial.micro_batch_size}: train_size {trial.train_size} does not describe this data")
    plan = _to_device(epoch_plan(len(shard), num_batches, tc.seed, epoch, rank), device)
    autocast = _autocast(device, net.precision)
    max_norm = tc.grad_clip if tc.grad_clip is not None else math.inf
    params = [p for p in model.parameters() if p.requires_grad]
    zero = torch.zeros((), device=device, dtype=torch.float64)
    loss_sum, grad_norm_sum, clipped = zero.clone(), zero.clone(), zero.clone()
    grad_norm_max = torch.zeros((), device=device, dtype=torch.float32)
    samples = 0
    watch = DivergenceWatch(device)
    noise = net.noise
    if noise is not None and noise.split(accum) < 2:  # one rank, one micro-batch: no pair, nothing to measure
        noise = None
    if noise is not None:
        noise.take()  # a fresh epoch (the start-up probe step leaves nothing, but a failed epoch might)

    model.train()
    fp16 = scaler.is_enabled()
    distributed = _distributed()
    for step in range(trial.steps_per_epoch):
        step_loss = zero.clone()
        for micro in range(accum):
            idx = plan[step * accum + micro]
            FAULTS.check_oom(trial.micro_batch_size)
            x, y = shard.batch(idx)
            # DDP all-reduces gradients in backward; skip it on all but the last micro-step
            sync = micro == accum - 1 or not hasattr(model, "no_sync")
            if noise is not None:
                noise.before_backward(params, micro, accum)
            with contextlib.nullcontext() if sync else model.no_sync():
                with autocast:
                    logits = model(x)
                loss = LOSS_FN(logits.float(), y)
                if FAULTS.nan_at_step == scheduler.last_epoch + 1:
                    loss = loss * float("nan")
                scaler.scale(loss / accum).backward()
            if noise is not None:
                noise.after_backward(params, micro, accum)
            loss_sum += loss.detach() * len(idx)
            step_loss += loss.detach()
            samples += len(idx)
        scaler.unscale_(optimizer)  # clip and log the true norm, not the fp16-scaled one
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if noise is not None:  # the scale the gradients were multiplied by, read on the device (no sync)
            noise.step_done(norm, 1.0 / scaler._get_scale_async().double() if fp16 else 1.0)
        # the norm is of the all-reduced gradients: every rank sees the same value and stops together
        bad = ~torch.isfinite(norm)
        if fp16:  # the scaler skips overflowing steps by design: there, a non-finite loss is divergence
            bad = ~torch.isfinite(step_loss)
            if distributed:  # losses are per rank: agree (read a step late on GPUs, like the rest)
                bad = bad.float()
                dist.all_reduce(bad, op=dist.ReduceOp.MAX)
                bad = bad > 0
        watch.check(bad, epoch, scheduler.last_epoch + 1)
        grad_norm_sum += norm
        grad_norm_max = torch.maximum(grad_norm_max, norm.float())
        clipped += norm > max_norm
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
    watch.finish(epoch)
    sums = TrainSums(loss_sum, samples, grad_norm_sum, grad_norm_max, clipped, trial.steps_per_epoch)
    if noise is not None:
        small, big, measured = noise.take()
        sums = dataclasses.replace(sums, noise_small=small, noise_big=big, noise_steps=measured,
                                   noise_split=noise.split(accum))
    return sums


def _to_device(plan: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """The epoch's micro-batch indices on the device: one copy, from pinned memory on a GPU (asynchronous:
    the host does not wait for it), split into views there."""
    flat = torch.from_numpy(np.concatenate(plan))
    if device.type == "cuda":
        flat = flat.pin_memory().to(device, non_blocking=True)
    return list(torch.split(flat, [len(idx) for idx in plan]))


class DivergenceWatch:
    """Ends the trial on a non-finite step (gradient norm; loss under fp16) without a host sync per step on a GPU.

    CPU: the value is already on the host, checked at once. CUDA: each step's flag is copied to
    pinned memory behind the step and read one step later (after the next step is queued), so the
    GPU never idles; a divergence is caught at most one step late, identically on every rank.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.pending = None  # (host flag, event, epoch, step) of the previous step (CUDA)
        if self.cuda:
            self.host = torch.zeros((), dtype=torch.bool).pin_memory()

    def check(self, bad: torch.Tensor, epoch: int, step: int) -> None:
        """`bad`: a bool tensor, identical on every rank."""
        if not self.cuda:
            if bad:
                raise TrialFailure("diverged", f"diverged: non-finite loss or gradient norm at epoch {epoch}, step {step}")
            return
        self.finish(epoch)
        self.host.copy_(bad, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self.pending = (event, epoch, step)

    def finish(self, epoch: int) -> None:
        if self.cuda and self.pending is not None:
            event, at_epoch, step = self.pending
            event.synchronize()
            self.pending = None
            if bool(self.host):
                raise TrialFailure("diverged", f"diverged: non-finite loss or gradient norm at epoch {at_epoch}, step {step}")


@dataclass(frozen=True)
class ProbeStep:
    """One probe step at one micro-batch, agreed across ranks (max of each figure; OOM anywhere is OOM)."""

    per_gpu_batch_size: int
    fits: bool
    peak_mem_allocated_gb: float  # CUDA allocator peaks (0 on CPU)
    peak_mem_reserved_gb: float
    peak_rss_gb: float  # process resident memory: the figure on CPU
    step_time_s: float
    device_memory_gb: float  # the device's total memory (on CPU: the machine's)
    images_per_s: float = 0.0  # global, when it fits (set by the probe command)


def probe_step(net: RankModel, trial: TrialConfig, micro_batch: int) -> ProbeStep:
    """One full step (forward, backward, optimizer) at `micro_batch` on random data; model and
    optimizer left as they were. Every rank agrees on the outcome: OOM anywhere is OOM everywhere.

    Runs on the unwrapped module, so the step issues no collective that an OOM could leave half-
    joined; the only collective is the all-reduce of the outcome, which every rank reaches.
    """
    import psutil

    model, optimizer, scaler, device = net.core, net.optimizer, net.scaler, net.device
    img = trial.image
    cuda = device.type == "cuda"
    snapshot = {k: v.detach().clone() for k, v in model.state_dict().items()}  # BN buffers too
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    rss = RssSampler() if not cuda else None
    oom = False
    t0 = time.perf_counter()
    try:
        FAULTS.check_oom(micro_batch)
        x = torch.randint(0, 256, (micro_batch, 1, img.height, img.width), dtype=torch.uint8, device=device)
        x = x.float().div_(255.0).contiguous(memory_format=torch.channels_last)
        labels = torch.randint(0, img.num_classes, (micro_batch, img.length), device=device)
        y = nn.functional.one_hot(labels, img.num_classes).flatten(1).float()
        model.train()
        with _autocast(device, net.precision):
            logits = model(x)
        scaler.scale(LOSS_FN(logits.float(), y)).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), trial.train.grad_clip or math.inf)
        scaler.step(optimizer)
        scaler.update()
        if cuda:
            torch.cuda.synchronize(device)
    except torch.OutOfMemoryError:
        oom = True
    finally:
        x = y = logits = labels = None  # noqa: F841 - drop the step's tensors before measuring again
        optimizer.zero_grad(set_to_none=True)
    step_time_s = time.perf_counter() - t0
    peak_rss = rss.stop() if rss else psutil.Process().memory_info().rss
    model.load_state_dict(snapshot)
    optimizer.state.clear()  # the probe's moments must not leak into training
    if cuda:
        alloc, reserved = torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.empty_cache()
    else:
        alloc = reserved = 0
        total = psutil.virtual_memory().total
    agreed = all_reduce_named({"oom": float(oom), "alloc": alloc / GiB, "reserved": reserved / GiB,
                               "rss": peak_rss / GiB, "step_time_s": step_time_s, "total": total / GiB},
                              dist.ReduceOp.MAX, device)
    return ProbeStep(micro_batch, not agreed["oom"], agreed["alloc"], agreed["reserved"], agreed["rss"],
                     agreed["step_time_s"], agreed["total"])


class RssSampler:
    """Peak resident memory of this process while it runs (CPU has no allocator peak to read)."""

    def __init__(self, interval_s: float = 0.005):
        import threading

        import psutil

        self.process, self.peak, self.interval_s = psutil.Process(), 0, interval_s
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.done.is_set():
            self.peak = max(self.peak, self.process.memory_info().rss)
            self.done.wait(self.interval_s)

    def stop(self) -> int:
        self.done.set()
        self.thread.join()
        return max(self.peak, self.process.memory_info().rss)


@dataclass
class EvalSums:
    """One rank's validation pass, as sums on the device."""

    loss_sum: torch.Tensor  # Σ loss × batch size
    samples: int
    exact: torch.Tensor  # captchas with every character right
    chars: torch.Tensor  # characters right
    char_total: int


@torch.no_grad()
def evaluate(model: nn.Module, shard: Shard, trial: TrialConfig, precision: str = "fp32") -> EvalSums:
    """Sums over the rank's validation shard: loss × n, exact matches, right characters."""
    model.eval()
    device = shard.images.device
    length, classes = trial.image.length, trial.image.num_classes
    zero = torch.zeros((), device=device, dtype=torch.float64)
    loss_sum, exact, chars = zero.clone(), zero.clone(), zero.clone()
    batch = trial.micro_batch_size
    with _autocast(device, precision):
        for start in range(0, len(shard), batch):
            idx = torch.arange(start, min(start + batch, len(shard)), device=device)
            x, y = shard.batch(idx)
            logits = model(x).float()
            loss_sum += LOSS_FN(logits, y) * len(idx)
            right = logits.view(-1, length, classes).argmax(-1) == shard.labels[idx]
            chars += right.sum()
            exact += right.all(dim=1).sum()
    return EvalSums(loss_sum, len(shard), exact, chars, len(shard) * length)


def all_reduce_named(values: dict[str, object], op, device: torch.device) -> dict[str, float]:
    """All-reduce named scalars in one collective; returns them by name on the host (a sync)."""
    t = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device) for v in values.values()])
    if _distributed():
        dist.all_reduce(t, op=op)
    return dict(zip(values, t.tolist()))


def reduce_metrics(train: TrainSums, val: EvalSums, *, train_time_s: float, epoch_time_s: float, epoch: int,
                   samples_before: int, lr: float, device: torch.device) -> EpochMetrics:
    """Two collectives per epoch (a SUM and a MAX); the epoch's host syncs are here."""
    import psutil

    cuda = device.type == "cuda"
    s = all_reduce_named({
        "train_loss": train.loss_sum, "train_samples": train.samples, "val_loss": val.loss_sum,
        "val_samples": val.samples, "val_exact": val.exact, "val_chars": val.chars, "val_char_total": val.char_total,
        "grad_norm": train.grad_norm_sum, "clipped_steps": train.clipped_steps, "optimizer_steps": train.optimizer_steps,
        "noise_small": train.noise_small, "noise_big": train.noise_big, "noise_steps": train.noise_steps,
    }, dist.ReduceOp.SUM, device)
    m = all_reduce_named({
        "grad_norm_max": train.grad_norm_max,
        "peak_mem_allocated_gb": torch.cuda.max_memory_allocated(device) / GiB if cuda else 0.0,
        "peak_mem_reserved_gb": torch.cuda.max_memory_reserved(device) / GiB if cuda else 0.0,
        "rss_gb": psutil.Process().memory_info().rss / GiB,
        "train_time_s": train_time_s,
        "epoch_time_s": epoch_time_s,
    }, dist.ReduceOp.MAX, device)
    steps = s["optimizer_steps"]  # every rank counted the same optimizer steps, and saw the same norms
    n, vn = s["train_samples"], max(s["val_samples"], 1)
    noise = None
    if s["noise_steps"] > 0:  # per-step means over the epoch and the ranks first (the sums are of both), then the ratio
        world = dist.get_world_size() if _distributed() else 1
        b_big = n * world / steps  # the global batch: samples ÷ one rank's optimizer steps
        noise = estimate(s["noise_small"] / s["noise_steps"], s["noise_big"] / s["noise_steps"],
                         b_big / train.noise_split, b_big)
    return EpochMetrics(
        epoch=epoch,
        samples_seen=samples_before + int(n),
        train_loss=s["train_loss"] / max(n, 1),
        val_loss=s["val_loss"] / vn,
        val_exact_acc=s["val_exact"] / vn,
        val_char_acc=s["val_chars"] / max(s["val_char_total"], 1),
        lr=lr,
        grad_norm=s["grad_norm"] / max(steps, 1),
        grad_norm_max=m["grad_norm_max"],
        clip_fraction=s["clipped_steps"] / max(steps, 1),
        epoch_time_s=m["epoch_time_s"],
        samples_per_s=n / max(m["train_time_s"], 1e-9),
        peak_mem_allocated_gb=m["peak_mem_allocated_gb"],
        peak_mem_reserved_gb=m["peak_mem_reserved_gb"],
        rss_gb=m["rss_gb"],
        grad_noise_scale=noise.grad_noise_scale if noise else None,
        grad_sq_norm=noise.grad_sq_norm if noise else None,
        grad_trace_cov=noise.grad_trace_cov if noise else None,
    )


def report(metrics: dict, rank: int, checkpoint_due: bool, state_fn) -> None:
    """Every rank reports (it is a collective); rank 0 alone attaches the checkpoint."""
    import ray.train

    if rank == 0 and checkpoint_due:
        with tempfile.TemporaryDirectory() as d:
            torch.save(state_fn(), os.path.join(d, CHECKPOINT_FILE))
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d))
    else:
        ray.train.report(metrics)


def gather_strings(value: str) -> str:
    """Every rank's `value`, by rank, comma-separated (one collective, at start-up only)."""
    if not _distributed():
        return value
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return ",".join(values)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _autocast(device: torch.device, precision: str):
    dtype = AUTOCAST_DTYPES[precision]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def device_name(device: torch.device) -> str:
    """What the trial ran on, for MLflow's `device_name` param."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({torch.get_num_threads()} threads)"


def quiet_ray_train_logs() -> None:
    """The per-report INFO line ignores LoggingConfig: its logger is named by file path (RAY_NOTES.md)."""
    try:
        import ray.train.v2._internal.execution.context as context

        logging.getLogger(context.__file__).setLevel(logging.WARNING)
    except ImportError:
        pass
