"""What measuring the gradient noise scale costs a training step: the step with and without `GradNoiseMeter`.

Two cases, each in fresh processes, the two models built side by side in the same processes and their
epochs alternating (so both see the same machine state):
- DDP: 2 gloo ranks (1 thread each), the communication hook that squares-and-sums each bucket before its
  all-reduce, against DDP's default all-reduce;
- one rank, 2 micro-batches per step: each micro-batch's backward alone, its |gradient|² and the hand-made
  sum, against autograd's accumulation;
- one rank, one micro-batch: every 4th step adds a backward of half the micro-batch (its gradient's |·|²,
  the step's gradient, BatchNorm's statistics and the RNG put back), against the plain step.
The captcha model at 160×60 (9.4 M parameters: the first linear layer holds most), fp32, per-rank batch 32.
Prints the median step time of each and the ratios; last line: RESULT noise_hook_cost ratio=<DDP step with
the hook ÷ without>. The goal is ≤ 1.02.

    python benchmarks/noise_cost.py            # 7 alternating repetitions of 8 steps
    python benchmarks/noise_cost.py --quick    # seconds: small images, for CI
"""

from __future__ import annotations

import argparse
import socket
import statistics
import time

import torch
import torch.distributed as dist

CHARSET = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def _trial(batch: int, accum: int, steps: int, world: int, width: int, height: int):
    from raysweep.config import ImageSpec, Knobs, ModelConfig, ScalingConfig, TrainConfig, TrialConfig

    return TrialConfig(
        knobs=Knobs(per_gpu_batch_size=batch, base_lr=1e-3, warmup_epochs=0, weight_decay=1e-4, grad_accum_steps=accum,
                    lr_rule="none"),
        train=TrainConfig(epochs=100, precision="fp32"), model=ModelConfig(dropout=0.5),
        scaling=ScalingConfig(num_workers=world),
        image=ImageSpec(width=width, height=height, length=4, num_classes=len(CHARSET)),
        train_size=batch * accum * steps * world)


def _measure(rank: int, world: int, accum: int, args) -> dict[str, float]:
    """Median seconds per optimizer step, with and without the meter (same process, alternating)."""
    import numpy as np

    from raysweep.data import CaptchaArrays
    from raysweep.optim import build_scheduler
    from raysweep.worker.device import keep_host_memory
    from raysweep.worker.net import RankModel
    from raysweep.worker.shard import Shard
    from raysweep.worker.step import train_one_epoch

    torch.set_num_threads(1 if world > 1 else 2)
    device = torch.device("cpu")
    keep_host_memory(device)
    micro = args.batch // accum
    trial = _trial(micro, accum, args.steps, world, args.width, args.height)
    # every rank holds the whole training set, as a worker does (each epoch deals it its share: shard.epoch_plan)
    rng = np.random.default_rng(0)
    n = trial.train_size
    arrays = CaptchaArrays(rng.integers(0, 255, (n, args.height, args.width), dtype=np.uint8),
                           rng.integers(0, len(CHARSET), (n, 4), dtype=np.uint8))
    shard = Shard.build(arrays, len(CHARSET), device)
    wrap = (lambda m: torch.nn.parallel.DistributedDataParallel(m)) if world > 1 else None
    runs = {}
    for measured in (False, True):
        net = RankModel.build(trial, device, wrap=wrap, measure_noise=measured)
        runs[measured] = (net, build_scheduler(net.optimizer, trial.peak_lr, 1e-6, 0, 10**6))
    times: dict[bool, list[float]] = {False: [], True: []}
    for rep in range(args.reps + 1):  # the first repetition warms up, untimed
        for measured in ((False, True) if rep % 2 else (True, False)):
            net, sched = runs[measured]
            if world > 1:
                dist.barrier()
            t0 = time.perf_counter()
            train_one_epoch(net, shard, sched, trial, rep + 1, rank)
            if rep:
                times[measured].append((time.perf_counter() - t0) / args.steps)
    # the hook's own work, alone: one squared norm over every gradient (what the buckets hold), 1 thread
    params = [q for q in runs[True][0].core.parameters()]
    flat = torch.cat([q.detach().flatten() for q in params])
    norm_s = []
    for _ in range(21):
        t0 = time.perf_counter()
        torch.linalg.vector_norm(flat).square().item()
        norm_s.append(time.perf_counter() - t0)
    return {"without": statistics.median(times[False]), "with": statistics.median(times[True]),
            "norm": statistics.median(norm_s), "params": flat.numel()}


def _rank_main(rank: int, world: int, port: int, args, out) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        result = _measure(rank, world, 1, args)
        if rank == 0:
            out.put(result)
    finally:
        dist.destroy_process_group()


def ddp_case(args) -> dict[str, float]:
    ctx = torch.multiprocessing.get_context("spawn")
    out = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.start_processes(_rank_main, args=(2, port, args, out), nprocs=2, start_method="spawn")
    return out.get(timeout=60)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small images, 2 repetitions of 2 steps (CI)")
    a = p.parse_args()
    a.batch, a.width, a.height, a.steps, a.reps = (32, 160, 60, 8, 7) if not a.quick else (8, 64, 24, 2, 2)
    ddp = ddp_case(a)
    one = _measure(0, 1, 2, a)
    half = _measure(0, 1, 1, a)
    print(f"gradient noise scale measurement, per-rank batch {a.batch}, {a.width}×{a.height}, fp32, "
          f"median of {a.reps} alternating repetitions of {a.steps} steps")
    print(f"{'case':<44s} {'without s/step':>14s} {'with s/step':>12s} {'ratio':>7s}")
    for name, r in (("DDP, 2 gloo ranks (comm hook)", ddp), ("1 rank, 2 micro-batches per step", one),
                    ("1 rank, 1 micro-batch (a half, 1 step in 4)", half)):
        print(f"{name:<44s} {r['without']:14.4f} {r['with']:12.4f} {r['with'] / r['without']:7.3f}")
    print(f"the hook's own work alone (one squared norm over {ddp['params'] / 1e6:.1f} M gradients, "
          f"one rank's thread): {ddp['norm'] * 1e3:.2f} ms = {ddp['norm'] / ddp['without']:.2%} of the DDP step")
    print(f"RESULT noise_hook_cost ratio={ddp['with'] / ddp['without']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
