"""raysweep's training step against the seeds' loop, side by side, on the same model, PNGs and batch size.

Seed: a Dataset opening each PNG with PIL per sample, a DataLoader (num_workers 0 and 2), fp32, the
plain nn.Sequential model with nn.Dropout, `.item()` every step (tests/seed_loop.py).
raysweep: images decoded once into uint8 arrays, batches sliced from them, channels_last, cheap fused
dropout, fused AdamW, no per-step sync, and the host-memory setup of a raysweep CPU worker
(huge pages, large blocks kept in the heap: raysweep/worker/device.py, worker_env and keep_host_memory).
Both in fp32; on a CPU where raysweep's `precision: auto` picks bf16 (AVX512-BF16 or AMX), a
`raysweep-bf16` row shows what a trial runs by default (not part of the ratio).

Every measurement runs in a fresh process (the seed's with the default environment), the
configurations alternate within each repetition, and the table shows medians of steady-state
images/s: each measurement first runs 3 warm-up steps (1 with --quick), untimed. raysweep's CPU
worker keeps freed activations in its heap (keep_host_memory), which takes ~3 steps to reach its
size: steps 1-3 ran 112, 88, 152 images/s at batch 512, then 142-161; the seed's loop has no
such ramp (it maps and unmaps its activations every step). Last line: RESULT loop_vs_seed
ratio=<raysweep ÷ best seed at the largest batch>.

    python benchmarks/loop_vs_seed.py            # batch 64 and 512, 160×60, 3 repetitions
    python benchmarks/loop_vs_seed.py --quick    # seconds: tiny images, for CI
    python benchmarks/loop_vs_seed.py --profile  # also print torch.profiler's table of raysweep's step
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CHARSET = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def measure_seed(folder: str, batch: int, steps: int, num_workers: int, height: int, width: int, warmup: int) -> float:
    import torch

    sys.path.insert(0, str(HERE.parent / "tests"))  # the seeds' loop is the tests' reference too
    from seed_loop import PngCaptchas, seed_model, train_steps

    torch.manual_seed(0)
    model = seed_model(height, width, 4, len(CHARSET))
    loader = torch.utils.data.DataLoader(PngCaptchas(folder, CHARSET), batch_size=batch, shuffle=True,
                                         num_workers=num_workers, drop_last=True, persistent_workers=num_workers > 0)
    train_steps(model, loader, steps=warmup)  # (and DataLoader worker start)
    t0 = time.perf_counter()
    train_steps(model, loader, steps=steps)
    return batch * steps / (time.perf_counter() - t0)


def measure_raysweep(folder: str, batch: int, steps: int, height: int, width: int, warmup: int,
                     profile: bool = False, precision: str = "fp32") -> float:
    import torch

    from raysweep.config import ImageSpec, Knobs, ModelConfig, ScalingConfig, TrainConfig, TrialConfig
    from raysweep.data import CaptchaArrays, read_folder
    from raysweep.models import build
    from raysweep.optim import build_optimizer, build_scheduler
    from raysweep.worker.device import keep_host_memory
    from raysweep.worker.net import RankModel
    from raysweep.worker.shard import Shard
    from raysweep.worker.step import train_one_epoch

    keep_host_memory(torch.device("cpu"))  # what a raysweep CPU worker does first
    arrays = read_folder(Path(folder), CHARSET, 4, width, height)  # decoded once, outside the loop

    def trial(n_steps):
        return TrialConfig(
            knobs=Knobs(per_gpu_batch_size=batch, base_lr=1e-3, warmup_epochs=0, weight_decay=1e-4,
                        grad_accum_steps=1, lr_rule="none"),
            train=TrainConfig(epochs=2, precision=precision), model=ModelConfig(dropout=0.5),
            scaling=ScalingConfig(num_workers=1),
            image=ImageSpec(width=width, height=height, length=4, num_classes=len(CHARSET)), train_size=batch * n_steps,
        )

    def shard(n_steps):  # exactly batch × steps images: every micro-batch is `batch`
        n = batch * n_steps
        return Shard.build(CaptchaArrays(arrays.images[:n], arrays.labels[:n]), len(CHARSET), torch.device("cpu"))

    timed = trial(steps)
    torch.manual_seed(0)
    model = build(timed.model, timed.image)
    opt = build_optimizer(model, 1e-3, 1e-4, "cpu")
    sched = build_scheduler(opt, 1e-3, 1e-6, 0, 10 * steps)
    net = RankModel(model, model, opt, torch.amp.GradScaler("cpu", enabled=False), precision, torch.device("cpu"))
    train_one_epoch(net, shard(warmup), sched, trial(warmup), 1, 0)
    timed_shard = shard(steps)
    t0 = time.perf_counter()
    sums = train_one_epoch(net, timed_shard, sched, timed, 2, 0)
    float(sums.loss_sum)  # the epoch's one sync
    rate = batch * steps / (time.perf_counter() - t0)
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            train_one_epoch(net, shard(1), sched, trial(1), 3, 0)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15), file=sys.stderr)
    return rate


def run_child(args: list[str]) -> float:
    """One measurement in a fresh interpreter; returns images/s."""
    from raysweep.trainer import worker_env

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    if args[0].startswith("raysweep"):
        env.update(worker_env())  # what a raysweep worker process starts with
    proc = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"measurement {args} failed:\n{proc.stderr[-3000:]}")
    if proc.stderr.strip() and "--profile" in args:
        print(proc.stderr, file=sys.stderr)
    return json.loads(proc.stdout.strip().splitlines()[-1])["images_per_s"]


def machine() -> str:
    import torch

    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads, python {platform.python_version()}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny sizes, one repetition (CI)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--child", nargs="*", help=argparse.SUPPRESS)
    a, rest = p.parse_known_args()
    if a.child is not None:
        kind, folder, *numbers = a.child[:8]
        batch, steps, workers, height, width, warmup = map(int, numbers)
        if kind == "seed":
            rate = measure_seed(folder, batch, steps, workers, height, width, warmup)
        else:
            rate = measure_raysweep(folder, batch, steps, height, width, warmup, profile="--profile" in sys.argv,
                                    precision="bf16" if kind == "raysweep-bf16" else "fp32")
        print(json.dumps({"images_per_s": rate}))
        return 0

    sys.path.insert(0, str(HERE.parent))
    from raysweep.data import write_captcha_folder

    if a.quick:
        height, width, batches, repeats, warmup = 24, 64, {8: 2, 16: 2}, 1, 1
    else:
        height, width, batches, repeats, warmup = 60, 160, {64: 8, 512: 3}, a.repeats, 3
    import torch

    from raysweep.worker.device import resolve_precision

    # the ratio is fp32 against fp32; where `precision: auto` picks bf16 on this CPU, a row shows that too
    kinds = [("seed", 0), ("seed", 2), ("raysweep", 0)]
    if resolve_precision("auto", torch.device("cpu")) == "bf16":
        kinds.append(("raysweep-bf16", 0))
    configs = [(kind, b, nw) for b in batches for kind, nw in kinds]
    with tempfile.TemporaryDirectory() as tmp:
        n_images = max(b * max(s, warmup) for b, s in batches.items())
        write_captcha_folder(Path(tmp), n_images, CHARSET, 4, width, height)
        rates: dict[tuple, list[float]] = {c: [] for c in configs}
        for rep in range(repeats):
            for kind, b, nw in configs:  # alternate within each repetition
                extra = ["--profile"] if (a.profile and kind == "raysweep" and rep == 0 and b == max(batches)) else []
                numbers = [b, batches[b], nw, height, width, warmup]
                rates[(kind, b, nw)].append(run_child([kind, tmp, *map(str, numbers), *extra]))
                print(f"  rep {rep + 1}/{repeats} {kind:13s} batch {b:4d} workers {nw}: "
                      f"{rates[(kind, b, nw)][-1]:8.1f} images/s", file=sys.stderr, flush=True)
    print(f"loop_vs_seed on {machine()}; images {width}×{height}, medians of {repeats} alternating repetitions, "
          f"{warmup} warm-up steps each")
    print(f"{'loop':13s} {'batch':>6s} {'loader workers':>15s} {'images/s':>10s} {'vs best seed':>13s}")
    ratio = 0.0
    for b in batches:
        best_seed = max(statistics.median(rates[("seed", b, nw)]) for nw in (0, 2))
        for kind, bb, nw in configs:
            if bb != b:
                continue
            med = statistics.median(rates[(kind, b, nw)])
            print(f"{kind:13s} {b:6d} {nw if kind == 'seed' else '-':>15} {med:10.1f} {med / best_seed:12.2f}×")
            if kind == "raysweep":
                ratio = med / best_seed
    print(f"RESULT loop_vs_seed ratio={ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
