"""Images/s and peak memory of raysweep's training step on one GPU, over per-GPU batch × precision ×
channels_last × torch.compile, with FLOPs per image and the achieved share of the GPU's bf16 peak.

The step is raysweep's own (`train_one_epoch` on a uint8 shard resident in GPU memory, batches sliced
there, no host syncs). Each configuration: warm-up steps (compilation included), then timed steps
between two synchronizations. Last line: RESULT gpu_throughput ratio=<images/s at batch 1024 bf16
(best configuration) ÷ 1,900, the seeds' per-GPU images/s>; the issue's goal is ≥ 100,000 images/s
(about 50×).

    python benchmarks/gpu_throughput.py                       # the full grid on cuda:0
    python benchmarks/gpu_throughput.py --batches 1024 --compile off
    python benchmarks/gpu_throughput.py --quick               # CPU allowed: checks the code path (CI)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SEED_IMAGES_PER_S_PER_GPU = 1_900  # the users' figure: 50,030 images in ~9 s on 3×A100 at batch 1536
GOAL_IMAGES_PER_S = 100_000
BF16_PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}  # dense tensor-core


def flops_per_image(height: int, width: int, dropout: float = 0.5) -> float:
    """Forward + backward FLOPs per image, counted by torch's FlopCounterMode (convs and matmuls)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from raysweep.model import CaptchaCNN

    model = CaptchaCNN(height, width, 4, 36, dropout)
    x = torch.rand(2, 1, height, width)
    with FlopCounterMode(display=False) as counter:
        model(x).sum().backward()
    return counter.get_total_flops() / 2


def peak_tflops(device_name: str) -> float | None:
    for key, value in BF16_PEAK_TFLOPS.items():
        if key in device_name:
            return value
    return None


def measure(device, batch: int, precision: str, channels_last: bool, compiled: bool, steps: int, warmup: int,
            height: int, width: int) -> tuple[float, float, float]:
    """(images/s, peak allocated GiB, peak reserved GiB) of raysweep's step; raises OutOfMemoryError."""
    import numpy as np
    import torch

    from raysweep.config import ImageSpec, Knobs, ModelConfig, ScalingConfig, TrainConfig, TrialConfig
    from raysweep.data import CaptchaArrays
    from raysweep.model import CaptchaCNN
    from raysweep.optim import build_optimizer, build_scheduler
    from raysweep.train_loop import RankModel, Shard, train_one_epoch

    def trial(n_steps):
        return TrialConfig(
            knobs=Knobs(per_gpu_batch_size=batch, base_lr=1e-3, warmup_epochs=0, weight_decay=1e-4, grad_accum_steps=1,
                        lr_rule="none"),
            train=TrainConfig(epochs=2, precision=precision), model=ModelConfig(dropout=0.5),
            scaling=ScalingConfig(num_workers=1),
            image=ImageSpec(width=width, height=height, length=4, num_classes=36), train_size=batch * n_steps,
        )

    rng = np.random.default_rng(0)

    def shard(n_steps):  # exactly batch × steps images, resident on the device, sliced per step
        n = batch * n_steps
        arrays = CaptchaArrays(rng.integers(0, 256, (n, height, width), dtype=np.uint8),
                               rng.integers(0, 36, (n, 4), dtype=np.uint8))
        return Shard.build(arrays, 0, 1, 36, device)

    torch.manual_seed(0)
    model = CaptchaCNN(height, width, 4, 36, 0.5)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    model = model.to(device)
    step_model = torch.compile(model) if compiled else model
    opt = build_optimizer(model, 1e-3, 1e-4, device.type)
    sched = build_scheduler(opt, 1e-3, 1e-6, 0, 10 * (steps + warmup))
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    net = RankModel(step_model, model, opt, scaler, precision, device)
    cuda = device.type == "cuda"
    train_one_epoch(net, shard(warmup), sched, trial(warmup), 1, 0)
    timed_shard = shard(steps)
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    sums = train_one_epoch(net, timed_shard, sched, trial(steps), 2, 0)
    float(sums.loss_sum)  # synchronizes
    elapsed = time.perf_counter() - t0
    alloc = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else 0.0
    reserved = torch.cuda.max_memory_reserved(device) / 2**30 if cuda else 0.0
    return batch * steps / elapsed, alloc, reserved


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny grid; runs on CPU when no GPU (CI)")
    p.add_argument("--batches", default="256,512,1024,2048,4096")
    p.add_argument("--precisions", default="fp32,bf16")
    p.add_argument("--channels-last", default="on,off")
    p.add_argument("--compile", default="off,on")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    a = p.parse_args()

    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not a.quick:
        print("gpu_throughput: no CUDA device; run with --quick to check the code path on CPU", file=sys.stderr)
        return 2
    device = torch.device("cuda:0" if cuda else "cpu")
    height, width = (60, 160)
    batches = [int(b) for b in a.batches.split(",")]
    precisions = a.precisions.split(",")
    layouts = [v == "on" for v in a.channels_last.split(",")]
    compiles = [v == "on" for v in a.compile.split(",")]
    steps, warmup = a.steps, a.warmup
    if a.quick:
        height, width, batches, steps, warmup = 24, 64, [8, 16], 2, 1
        compiles = [False] if not cuda else compiles
    if cuda:
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    name = torch.cuda.get_device_name(device) if cuda else f"CPU ({os.cpu_count()} cores)"
    flops = flops_per_image(height, width)
    peak = peak_tflops(name)
    print(f"gpu_throughput on {name}, torch {torch.__version__}; images {width}×{height}; "
          f"{flops / 1e6:.0f} MFLOP per image forward+backward (FlopCounterMode); "
          f"bf16 dense peak {peak or '?'} TFLOP/s; {steps} timed steps after {warmup} warm-up")
    print(f"{'batch':>6s} {'precision':>9s} {'ch_last':>7s} {'compile':>7s} {'images/s':>11s} {'alloc GiB':>9s} "
          f"{'resv GiB':>8s} {'GiB/image':>9s} {'% bf16 peak':>11s}")
    best_1024 = 0.0
    for batch in batches:
        for precision in precisions:
            for cl in layouts:
                for comp in compiles:
                    try:
                        rate, alloc, reserved = measure(device, batch, precision, cl, comp, steps, warmup, height, width)
                    except torch.OutOfMemoryError:
                        print(f"{batch:6d} {precision:>9s} {str(cl):>7s} {str(comp):>7s} {'OOM':>11s}", flush=True)
                        torch.cuda.empty_cache()
                        continue
                    share = f"{100 * rate * flops / (peak * 1e12):10.1f}%" if peak else f"{'-':>11s}"
                    print(f"{batch:6d} {precision:>9s} {str(cl):>7s} {str(comp):>7s} {rate:11,.0f} {alloc:9.2f} "
                          f"{reserved:8.2f} {alloc / batch:9.5f} {share}", flush=True)
                    if precision == "bf16" and batch == 1024:
                        best_1024 = max(best_1024, rate)
                    if cuda:
                        torch.cuda.empty_cache()
    if best_1024:
        print(f"batch 1024 bf16 best: {best_1024:,.0f} images/s; goal {GOAL_IMAGES_PER_S:,} "
              f"({'met' if best_1024 >= GOAL_IMAGES_PER_S else 'not met'})")
    print(f"RESULT gpu_throughput ratio={best_1024 / SEED_IMAGES_PER_S_PER_GPU:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
