"""Images/s and peak memory of raysweep's training step on one GPU, over per-GPU batch × precision ×
channels_last × torch.compile, with FLOPs per image and the achieved share of the GPU's bf16 peak.

The step is raysweep's own (`train_one_epoch` on a uint8 shard resident in GPU memory, batches sliced
there, no host syncs). Each configuration: warm-up steps (compilation included), then timed steps
between two synchronizations. Configurations run most-telling first (batch 1024, the goal's, eager, then
compiled; then the other batches), so `--budget-s` cuts the least telling ones. `--compile` takes `off`,
`on` (inductor: fuses BN-dropout-ReLU-pool) and `graphs` (inductor + CUDA graphs, `reduce-overhead`).
Last line: RESULT gpu_throughput ratio=<images/s at batch 1024 bf16 (best configuration) ÷ 1,900, the seeds'
per-GPU images/s>; the issue's goal is ≥ 100,000 images/s (about 53×).

    python benchmarks/gpu_throughput.py                       # the full grid on cuda:0
    python benchmarks/gpu_throughput.py --batches 1024 --compile off,on,graphs --budget-s 200 --json t.json
    python benchmarks/gpu_throughput.py --profile --batches 1024 --precisions bf16 --compile off
    python benchmarks/gpu_throughput.py --quick               # CPU allowed: checks the code path (CI)

`--profile` runs the first configuration under torch.profiler and prints the step's top ops by GPU time,
GPU time by kind of kernel, how busy the GPU was, and what limits the step (host/launches, memory
traffic or arithmetic).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SEED_IMAGES_PER_S_PER_GPU = 1_900  # the users' figure: 50,030 images in ~9 s on 3×A100 at batch 1536
GOAL_IMAGES_PER_S = 100_000
GOAL_BATCH = 1024
BF16_PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}  # dense tensor-core
COMPILE_MODES = {"off": None, "on": "default", "graphs": "reduce-overhead"}
KERNEL_KINDS = (  # (kind, substrings of a kernel's name), first match wins; the rest is "elementwise/other"
    ("convolution", ("conv", "cudnn", "implicit", "xmma", "dgrad", "wgrad", "fprop")),
    ("matmul", ("gemm", "cutlass", "cublas")),
    ("batch norm", ("batch_norm", "batchnorm", "bn_", "welford")),
    ("pooling", ("pool",)),
    ("optimizer", ("adam", "foreach", "multi_tensor")),
)


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


def one_gpu_trial(batch: int, precision: str, height: int, width: int, train_size: int):
    """One rank's trial at `batch` (no accumulation, no LR rule): what the GPU scripts here measure."""
    from raysweep.config import ImageSpec, Knobs, ModelConfig, ScalingConfig, TrainConfig, TrialConfig

    return TrialConfig(
        knobs=Knobs(per_gpu_batch_size=batch, base_lr=1e-3, warmup_epochs=0, weight_decay=1e-4, grad_accum_steps=1,
                    lr_rule="none"),
        train=TrainConfig(epochs=2, precision=precision), model=ModelConfig(dropout=0.5),
        scaling=ScalingConfig(num_workers=1), image=ImageSpec(width=width, height=height, length=4, num_classes=36),
        train_size=train_size,
    )


def training_device(script: str, quick: bool):
    """cuda:0, or the CPU under --quick; None (after saying why) when there is no GPU and no --quick."""
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda:0")
    if not quick:
        print(f"{script}: no CUDA device; run with --quick to check the code path on CPU", file=sys.stderr)
        return None
    return torch.device("cpu")


class Bench:
    """raysweep's step at one configuration: a model, its optimizer, and shards of random uint8 images."""

    def __init__(self, device, batch: int, precision: str, channels_last: bool, compile_mode: str, height: int,
                 width: int):
        import numpy as np
        import torch

        from raysweep.model import CaptchaCNN
        from raysweep.optim import build_optimizer, build_scheduler
        from raysweep.train_loop import RankModel

        self.device, self.batch, self.precision, self.height, self.width = device, batch, precision, height, width
        self.rng = np.random.default_rng(0)
        torch.manual_seed(0)
        model = CaptchaCNN(height, width, 4, 36, 0.5)
        if channels_last:
            model = model.to(memory_format=torch.channels_last)
        model = model.to(device)
        mode = COMPILE_MODES[compile_mode]
        if mode is not None:
            torch._dynamo.reset()  # each configuration compiles its own graphs (static shapes, no shared cache limit)
        step_model = torch.compile(model, mode=mode, dynamic=False) if mode is not None else model
        opt = build_optimizer(model, 1e-3, 1e-4, device.type)
        self.sched = build_scheduler(opt, 1e-3, 1e-6, 0, 10_000)
        scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
        self.net = RankModel(step_model, model, opt, scaler, precision, device)

    def trial(self, n_steps: int):
        return one_gpu_trial(self.batch, self.precision, self.height, self.width, train_size=self.batch * n_steps)

    def shard(self, n_steps: int):
        """Exactly batch × steps images, resident on the device, sliced per step."""
        from raysweep.data import CaptchaArrays
        from raysweep.train_loop import Shard

        n = self.batch * n_steps
        arrays = CaptchaArrays(self.rng.integers(0, 256, (n, self.height, self.width), dtype="uint8"),
                               self.rng.integers(0, 36, (n, 4), dtype="uint8"))
        return Shard.build(arrays, 0, 1, 36, self.device)

    def run(self, shard, n_steps: int, epoch: int):
        from raysweep.train_loop import train_one_epoch

        return train_one_epoch(self.net, shard, self.sched, self.trial(n_steps), epoch, 0)


def measure(bench: Bench, steps: int, warmup: int) -> tuple[float, float, float]:
    """(images/s, peak allocated GiB, peak reserved GiB); raises OutOfMemoryError."""
    import torch

    cuda = bench.device.type == "cuda"
    bench.run(bench.shard(warmup), warmup, 1)
    timed = bench.shard(steps)
    if cuda:
        torch.cuda.synchronize(bench.device)
        torch.cuda.reset_peak_memory_stats(bench.device)
    t0 = time.perf_counter()
    sums = bench.run(timed, steps, 2)
    float(sums.loss_sum)  # synchronizes
    elapsed = time.perf_counter() - t0
    alloc = torch.cuda.max_memory_allocated(bench.device) / 2**30 if cuda else 0.0
    reserved = torch.cuda.max_memory_reserved(bench.device) / 2**30 if cuda else 0.0
    return bench.batch * steps / elapsed, alloc, reserved


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KERNEL_KINDS if any(k in low for k in keys)), "elementwise/other")


def profile(bench: Bench, steps: int, warmup: int, flops: float, peak: float | None) -> dict:
    """torch.profiler over `steps` timed steps: the table, GPU time by kind, GPU busy share, the limit."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    cuda = bench.device.type == "cuda"
    bench.run(bench.shard(warmup), warmup, 1)
    timed = bench.shard(steps)
    if cuda:
        torch.cuda.synchronize(bench.device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch_profile(activities=activities) as prof:
        t0 = time.perf_counter()
        float(bench.run(timed, steps, 2).loss_sum)
        wall_s = time.perf_counter() - t0
    averages = prof.key_averages()
    try:
        table = averages.table(sort_by="self_device_time_total" if cuda else "self_cpu_time_total", row_limit=25,
                               max_name_column_width=60)
    except (KeyError, AttributeError):  # torch before the "device" names
        table = averages.table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=60)
    print(table)
    step_ms = 1e3 * wall_s / steps
    rate = bench.batch * steps / wall_s
    print(f"profiled: batch {bench.batch} {bench.precision}, {steps} steps, {step_ms:.2f} ms per step, {rate:,.0f} images/s "
          f"under the profiler")
    summary = {"batch": bench.batch, "precision": bench.precision, "step_ms": step_ms, "images_per_s": rate}
    if not cuda:
        print("GPU busy: n/a (no GPU: the table above is the CPU's)")
        summary["limit"] = "cpu"
        return summary
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    busy_ms = sum(e.time_range.elapsed_us() for e in kernels) / 1e3 / steps
    by_kind: dict[str, float] = {}
    for e in kernels:
        by_kind[kernel_kind(e.name)] = by_kind.get(kernel_kind(e.name), 0.0) + e.time_range.elapsed_us() / 1e3 / steps
    busy = busy_ms / step_ms
    print(f"GPU busy {busy_ms:.2f} ms of each {step_ms:.2f} ms step ({100 * busy:.0f} %), {len(kernels) / steps:.0f} kernels "
          f"per step; GPU time by kind:")
    for kind, ms in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"  {kind:18s} {ms:8.2f} ms  {100 * ms / max(busy_ms, 1e-9):5.1f} %")
    share = rate * flops / (peak * 1e12) if peak else None
    if busy < 0.8:
        limit = (f"host: the GPU idles {100 * (1 - busy):.0f} % of the step waiting for launches "
                 f"({len(kernels) / steps:.0f} kernels per step); CUDA graphs (--compile graphs) or a larger batch")
    elif share is not None and share < 0.3:
        top = max(by_kind, key=by_kind.get)
        limit = (f"GPU memory traffic: {100 * share:.1f} % of the bf16 peak's arithmetic, the GPU busy; most time in "
                 f"{top} kernels; fusion (--compile on) cuts passes over the activations")
    else:
        limit = "GPU arithmetic: busy, and a large share of the tensor-core peak"
    print(f"limit: {limit}")
    summary.update(gpu_busy=busy, kernels_per_step=len(kernels) / steps, gpu_ms_by_kind=by_kind, limit=limit,
                   bf16_peak_share=share)
    return summary


def priority(config: tuple[int, str, bool, str]) -> tuple:
    """The goal's batch eager, then compiled in bf16 channels_last (each compile costs tens of seconds), then eager
    at the other batches, then the goal's other compiled settings, then the rest compiled."""
    batch, precision, channels_last, compile_mode = config
    at_goal, eager = batch == GOAL_BATCH, compile_mode == "off"
    tier = 0 if at_goal and eager else 1 if at_goal and precision == "bf16" and channels_last else \
        2 if eager else 3 if at_goal else 4
    return tier, precision != "bf16", not channels_last, list(COMPILE_MODES).index(compile_mode), \
        abs(math.log2(batch / GOAL_BATCH)), batch


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny grid; runs on CPU when no GPU (CI)")
    p.add_argument("--batches", default="256,512,1024,2048,4096")
    p.add_argument("--precisions", default="fp32,bf16")
    p.add_argument("--channels-last", default="on,off")
    p.add_argument("--compile", default="off,on", help="off, on (inductor), graphs (inductor + CUDA graphs)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--budget-s", type=float, default=None, help="start no configuration after this many seconds")
    p.add_argument("--json", default=None, help="also write the rows and the best figure here")
    p.add_argument("--profile", action="store_true", help="profile the first configuration instead of the grid")
    a = p.parse_args()

    import torch

    device = training_device("gpu_throughput", a.quick)
    if device is None:
        return 2
    cuda = device.type == "cuda"
    height, width = (60, 160)
    batches = [int(b) for b in a.batches.split(",")]
    precisions = a.precisions.split(",")
    layouts = [v == "on" for v in a.channels_last.split(",")]
    compiles = a.compile.split(",")
    unknown = set(compiles) - set(COMPILE_MODES)
    if unknown:
        p.error(f"--compile {a.compile}: unknown {sorted(unknown)}; expected off, on or graphs")
    steps, warmup = a.steps, a.warmup
    if a.quick:
        height, width, batches, steps, warmup = 24, 64, [8, 16], 2, 1
        compiles = ["off"] if not cuda else compiles
    if cuda:
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    name = torch.cuda.get_device_name(device) if cuda else f"CPU ({os.cpu_count()} cores)"
    flops = flops_per_image(height, width)
    peak = peak_tflops(name)
    print(f"gpu_throughput on {name}, torch {torch.__version__}; images {width}×{height}; "
          f"{flops / 1e6:.0f} MFLOP per image forward+backward (FlopCounterMode); "
          f"bf16 dense peak {peak or '?'} TFLOP/s; {steps} timed steps after {warmup} warm-up", flush=True)
    grid = sorted(((b, pr, cl, c) for b in batches for pr in precisions for cl in layouts for c in compiles), key=priority)
    if a.profile:
        batch, precision, cl, comp = grid[0]
        summary = profile(Bench(device, batch, precision, cl, comp, height, width), steps, warmup, flops, peak)
        if a.json:
            Path(a.json).write_text(json.dumps({"device": name, "torch": torch.__version__, **summary}, indent=1))
        return 0
    print(f"{'batch':>6s} {'precision':>9s} {'ch_last':>7s} {'compile':>7s} {'images/s':>11s} {'alloc GiB':>9s} "
          f"{'resv GiB':>8s} {'MiB/image':>9s} {'% bf16 peak':>11s}", flush=True)
    rows, best, started = [], None, time.perf_counter()

    def dump() -> None:  # after every row: a run stopped at its time limit keeps what it measured
        if a.json:
            Path(a.json).write_text(json.dumps({
                "device": name, "torch": torch.__version__, "flops_per_image": flops, "bf16_peak_tflops": peak,
                "rows": rows, "best_goal_batch_bf16": best, "goal_images_per_s": GOAL_IMAGES_PER_S}, indent=1))

    for n, (batch, precision, cl, comp) in enumerate(grid):
        if a.budget_s is not None and time.perf_counter() - started > a.budget_s:
            print(f"budget of {a.budget_s:.0f} s spent: {len(grid) - n} configurations not run "
                  f"({', '.join(f'{b}/{pr}/{cl}/{c}' for b, pr, cl, c in grid[n:][:6])}{', …' if len(grid) - n > 6 else ''})")
            break
        row = {"batch": batch, "precision": precision, "channels_last": cl, "compile": comp}
        head = f"{batch:6d} {precision:>9s} {str(cl):>7s} {comp:>7s}"
        try:
            rate, alloc, reserved = measure(Bench(device, batch, precision, cl, comp, height, width), steps, warmup)
        except torch.OutOfMemoryError:
            print(f"{head} {'OOM':>11s}", flush=True)
            rows.append({**row, "oom": True})
            torch.cuda.empty_cache()
            continue
        except Exception as e:  # noqa: BLE001 - one configuration that cannot run (a compile failure, say) costs one row
            message = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
            print(f"{head} {'error':>11s} {message}", flush=True)
            rows.append({**row, "error": message})
            if cuda:
                torch.cuda.empty_cache()
            continue
        share = rate * flops / (peak * 1e12) if peak else None
        print(f"{head} {rate:11,.0f} {alloc:9.2f} {reserved:8.2f} {1024 * alloc / batch:9.2f} "
              + (f"{100 * share:10.1f}%" if share is not None else f"{'-':>11s}"), flush=True)
        rows.append({**row, "images_per_s": rate, "alloc_gib": alloc, "reserved_gib": reserved, "bf16_peak_share": share})
        if precision == "bf16" and batch == GOAL_BATCH and (best is None or rate > best["images_per_s"]):
            best = rows[-1]
        dump()
        if cuda:
            torch.cuda.empty_cache()
    if best:
        print(f"batch {GOAL_BATCH} bf16 best: {best['images_per_s']:,.0f} images/s (channels_last {best['channels_last']}, "
              f"compile {best['compile']}); goal {GOAL_IMAGES_PER_S:,} "
              f"({'met' if best['images_per_s'] >= GOAL_IMAGES_PER_S else 'not met'})")
    dump()
    best_rate = best["images_per_s"] if best else 0.0
    print(f"RESULT gpu_throughput ratio={best_rate / SEED_IMAGES_PER_S_PER_GPU:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
