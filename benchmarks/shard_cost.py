"""What dealing every epoch's shares from the whole training set costs a rank, against a fixed contiguous part.

    python benchmarks/shard_cost.py [--n 50000] [--world 3] [--batch 256] [--device cpu|cuda] [--reps 5] [--quick]

raysweep holds the whole training set on every rank and deals each epoch's shares from one permutation of it
(worker/shard.py, epoch_plan: DistributedSampler's scheme), so that no rank trains on one part of a label-sorted
folder. Before, each rank held its contiguous third and shuffled within it. Side by side, as rank 0 of `--world`
ranks, at the users' scale (160×60 images; pixel values do not change the cost):

- memory: the bytes of data resident on the rank (images, labels, one-hot targets) and, on CUDA, the allocator's
  growth when the set goes to the device; on a CPU the images are a view on the arrays (the object store's pages in
  a real worker), so only labels and targets are the rank's own;
- time: one epoch's data path (the plan, then every micro-batch gathered and turned into the model's input, as the
  step reads it) for the rank's share, in alternation, `--reps` times; and one optimizer step of the real model at
  the same micro-batch, to put the data path against an epoch of training.

Figures in benchmarks/RESULTS.md (shard_cost).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import numpy as np
import torch

CHARSET = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def resident_bytes(shard, device: torch.device) -> int:
    """What the shard holds on its own: on a CPU the images are a view on the caller's arrays."""
    own = shard.labels.nbytes + shard.targets.nbytes
    return own + (shard.images.nbytes if device.type == "cuda" else 0)


def data_path_s(shard, n: int, world: int, num_batches: int, epoch: int, device: torch.device) -> float:
    """One epoch of rank 0's data path: its plan, then every micro-batch's input and targets on the device."""
    from raysweep.worker.shard import epoch_plan, plan_to_device

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    plan = plan_to_device(epoch_plan(n, num_batches, n // world // num_batches, 0, epoch, 0, world), device)
    total = torch.zeros((), device=device)
    for row in plan:
        x, y = shard.batch(row)
        total += x[:, :, :1, :1].sum() + y[:, :1].sum()  # touch both: nothing is skipped
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    else:
        float(total)
    return time.perf_counter() - t0


def step_s(batch: int, device: torch.device, reps: int) -> float:
    """Median seconds of one optimizer step of the real model at `batch` (fp32 on CPU, bf16 on CUDA)."""
    from raysweep.config import ImageSpec, Knobs, ModelConfig, ScalingConfig, TrainConfig, TrialConfig
    from raysweep.data import CaptchaArrays
    from raysweep.optim import build_scheduler
    from raysweep.worker.net import RankModel
    from raysweep.worker.shard import Shard
    from raysweep.worker.step import train_one_epoch

    precision = "bf16" if device.type == "cuda" else "fp32"
    steps = 3
    trial = TrialConfig(
        knobs=Knobs(per_gpu_batch_size=batch, base_lr=1e-3, warmup_epochs=0, weight_decay=0.0, grad_accum_steps=1,
                    lr_rule="none"),
        train=TrainConfig(epochs=100, precision=precision, compile=False, cuda_graphs=False),
        model=ModelConfig(), scaling=ScalingConfig(num_workers=1),
        image=ImageSpec(width=160, height=60, length=4, num_classes=len(CHARSET)), train_size=batch * steps)
    rng = np.random.default_rng(1)
    arrays = CaptchaArrays(rng.integers(0, 256, (batch * steps, 60, 160), dtype=np.uint8),
                           rng.integers(0, len(CHARSET), (batch * steps, 4), dtype=np.uint8))
    net = RankModel.build(trial, device)
    shard = Shard.build(arrays, len(CHARSET), device)
    sched = build_scheduler(net.optimizer, 1e-3, 1e-6, 0, 10_000)
    train_one_epoch(net, shard, sched, trial, 1, 0)  # warm-up
    times = []
    for epoch in range(2, 2 + reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        float(train_one_epoch(net, shard, sched, trial, epoch, 0).loss_sum)
        times.append((time.perf_counter() - t0) / steps)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=50_000, help="training images")
    parser.add_argument("--world", type=int, default=3, help="ranks (this process is rank 0)")
    parser.add_argument("--batch", type=int, default=256, help="per-GPU batch")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="small figures: 3,000 images, batch 64, 2 reps")
    args = parser.parse_args()
    if args.quick:
        args.n, args.batch, args.reps = 3_000, 64, 2
    from raysweep.data import CaptchaArrays
    from raysweep.worker.shard import Shard

    device = torch.device(args.device)
    torch.set_num_threads(os.cpu_count() or 1)
    print(f"shard_cost on {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, device {device}"
          f"{' (' + torch.cuda.get_device_name(device) + ')' if device.type == 'cuda' else ''}; rank 0 of "
          f"{args.world}, {args.n:,} training images 160×60, per-GPU batch {args.batch}, {args.reps} alternating reps")
    rng = np.random.default_rng(0)
    arrays = CaptchaArrays(rng.integers(0, 256, (args.n, 60, 160), dtype=np.uint8),
                           rng.integers(0, len(CHARSET), (args.n, 4), dtype=np.uint8))
    share = args.n // args.world
    num_batches = -(-args.n // (args.batch * args.world))  # steps_per_epoch × 1 accumulation step
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    # before: the rank's contiguous third, shuffled within (= the whole-set scheme over that third alone, world 1)
    third = Shard.build(arrays, len(CHARSET), device, rank=0, world_size=args.world)
    grown_third = (torch.cuda.memory_allocated(device) - before) if device.type == "cuda" else 0
    whole = Shard.build(arrays, len(CHARSET), device)
    grown_whole = (torch.cuda.memory_allocated(device) - before - grown_third) if device.type == "cuda" else 0
    schemes = {"contiguous part (before)": (third, len(third), 1),
               "whole set, dealt (now)": (whole, args.n, args.world)}
    times = {name: [] for name in schemes}
    for rep in range(args.reps + 1):  # the first round warms caches and the allocator: not counted
        for name, (shard, n, world) in schemes.items():
            seconds = data_path_s(shard, n, world, num_batches, rep + 1, device)
            if rep:
                times[name].append(seconds)
    step = step_s(min(args.batch, share // num_batches), device, max(2, args.reps))
    epoch_train_s = num_batches * step
    print(f"a rank's share: {share:,} images in {num_batches} micro-batches of {share // num_batches}; one optimizer "
          f"step of the model there: {step * 1000:.1f} ms, so an epoch's training ≈ {epoch_train_s:.1f} s")
    print(f"{'scheme':<26}{'resident MiB':>14}{'device growth MiB':>19}{'data path s/epoch':>19}{'of training':>13}")
    for name, grown in zip(schemes, (grown_third, grown_whole)):
        shard = schemes[name][0]
        median = statistics.median(times[name])
        print(f"{name:<26}{resident_bytes(shard, device) / 2**20:>14.1f}{grown / 2**20:>19.1f}{median:>19.4f}"
              f"{median / epoch_train_s:>13.2%}")
    before_s, now_s = (statistics.median(t) for t in times.values())
    print(f"RESULT shard_cost ratio={now_s / before_s:.3f}")


if __name__ == "__main__":
    main()
