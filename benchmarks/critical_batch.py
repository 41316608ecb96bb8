"""Does the gradient noise scale predict what a bigger batch costs? Checked against reality on this machine.

The captcha model trains on the spec's synthetic set at several global batch sizes, each from the same
initial weights to the same target loss, with its peak LR scaled from the spec's base_lr by the spec's rule
(constant after the step it reaches: no schedule to tie to a length). One process, each optimizer step
of 2 micro-batches, so `GradNoiseMeter` measures B_noise in every run (b = B/2) through the training loop's
own code (worker.step.train_one_epoch). Every `--eval-every` samples (or every step, for bigger batches)
the loss on a fixed 512-image slice of the training set is measured (eval mode); the crossing of the
target is interpolated between two measurements.

McCandlish et al. 2018: E(B) = E_min (1 + B/B_noise) samples and S(B) = S_min (1 + B_noise/B) steps.
E_min is anchored at the smallest batch (E_min = E(B₀) / (1 + B₀/B_noise)), B_noise is the smallest
batch's own measurement up to its crossing; every other batch is then a prediction. Last line:
RESULT critical_batch ratio=<measured ÷ predicted samples at the largest batch>.

    python benchmarks/critical_batch.py                     # quickstart spec, 4,096 images, B = 16 … 1024
    python benchmarks/critical_batch.py --quick             # seconds: tiny images, for CI (no meaning)
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent


@dataclass
class Run:
    batch: int
    peak_lr: float
    curve: list[tuple[int, int, float]] = field(default_factory=list)  # (samples, steps, loss) per evaluation
    noise_small: float = 0.0  # Σ |G_b|² up to the crossing (meter sums)
    noise_big: float = 0.0
    noise_steps: float = 0.0
    samples: float | None = None  # to the target, interpolated (None: not reached)
    steps: float | None = None
    wall_s: float = 0.0

    def noise_scale(self) -> float | None:
        from raysweep.noise import estimate

        if not self.noise_steps:
            return None
        e = estimate(self.noise_small / self.noise_steps, self.noise_big / self.noise_steps, self.batch / 2, self.batch)
        return e.grad_noise_scale if e else None


def train_to_target(config, data, batch: int, target: float, max_samples: int, eval_every: int, seed: int,
                    lr_factor: float = 1.0) -> Run:
    from raysweep.data import CaptchaArrays
    from raysweep.optim import build_scheduler
    from raysweep.worker.device import keep_host_memory
    from raysweep.worker.evaluate import evaluate
    from raysweep.worker.net import RankModel
    from raysweep.worker.shard import Shard
    from raysweep.worker.step import train_one_epoch

    device = torch.device("cpu")
    keep_host_memory(device)
    chunk = max(batch, eval_every)  # samples between evaluations: whole steps
    knobs = config.trials.default_knobs()
    trial = config.trials.trial({**knobs, "per_gpu_batch_size": batch // 2, "grad_accum_steps": 2,
                          "base_lr": knobs["base_lr"] * lr_factor}, chunk)
    assert trial.global_batch_size == batch and trial.steps_per_epoch == chunk // batch
    net = RankModel.build(trial, device)  # same seed → the same initial weights for every batch size
    scheduler = build_scheduler(net.optimizer, trial.peak_lr, trial.peak_lr, 0, 10**9)  # constant peak LR
    classes = trial.image.num_classes
    images, labels = data.train.images, data.train.labels
    probe = Shard.build(CaptchaArrays(images[:512], labels[:512]), classes, device)
    order = np.random.default_rng(seed).permutation(len(labels))
    run, t0, samples, steps, position, chunk_no = Run(batch, trial.peak_lr), time.perf_counter(), 0, 0, 0, 0

    def loss_now() -> float:
        val = evaluate(net.core, probe, trial, net.precision)
        return float(val.loss_sum) / val.samples

    run.curve.append((0, 0, loss_now()))
    while samples < max_samples:
        if position + chunk > len(order):  # a fresh pass over the set
            order, position = np.random.default_rng([seed, samples]).permutation(len(labels)), 0
        idx = np.sort(order[position:position + chunk])
        position += chunk
        chunk_no += 1
        shard = Shard.build(CaptchaArrays(images[idx], labels[idx]), classes, device)
        sums = train_one_epoch(net, shard, scheduler, trial, chunk_no, 0)
        samples, steps = samples + sums.samples, steps + sums.optimizer_steps
        run.noise_small += float(sums.noise_small)
        run.noise_big += float(sums.noise_big)
        run.noise_steps += float(sums.noise_steps)
        loss = loss_now()
        run.curve.append((samples, steps, loss))
        if not math.isfinite(loss):
            break
        if loss <= target:
            (s0, k0, l0), (s1, k1, l1) = run.curve[-2], run.curve[-1]
            f = (l0 - target) / (l0 - l1) if l0 > l1 else 1.0
            run.samples, run.steps = s0 + f * (s1 - s0), k0 + f * (k1 - k0)
            break
    run.wall_s = time.perf_counter() - t0
    return run


def main() -> int:
    from raysweep.config import load_config
    from raysweep.data import load_data

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--spec", default=str(HERE.parent / "search_spaces" / "quickstart.yaml"))
    p.add_argument("--batches", default="16,64,256,1024", help="global batch sizes (even), smallest first")
    p.add_argument("--target", type=float, default=0.12, help="loss on the fixed training slice to reach")
    p.add_argument("--train-size", type=int, default=4096, help="synthetic training images")
    p.add_argument("--max-samples", type=int, default=60_000, help="give up on a batch size after this many samples")
    p.add_argument("--eval-every", type=int, default=256, help="samples between loss measurements (at least a step)")
    p.add_argument("--lr-factors", default="1",
                   help="each batch runs at these multiples of its rule's peak LR and keeps its best (fewest samples "
                        "to the target): the model assumes every batch at its own best LR; 1 = the rule's LR alone")
    p.add_argument("--quick", action="store_true", help="tiny images and batches, a loose target: checks the plumbing")
    a = p.parse_args()
    overrides = ["scaling.num_workers=1", f"data.synthetic.train_size={a.train_size}", "data.synthetic.val_size=8"]
    if a.quick:
        overrides += ["data.width=64", "data.height=24"]
        a.batches, a.target, a.max_samples, a.eval_every, a.train_size = "4,8,16,32", 0.3, 2048, 32, 512
        a.lr_factors = "1,2" if a.lr_factors != "1" else "1"
        overrides[1] = f"data.synthetic.train_size={a.train_size}"
    config = load_config(a.spec, overrides, sweep=False)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    data = load_data(config.data)
    batches = [int(b) for b in a.batches.split(",")]
    print(f"critical batch: {config.name} spec, {len(data.train.labels)} synthetic images "
          f"{config.data.width}×{config.data.height}, lr_rule {config.train.lr_rule} from base_lr "
          f"{config.trials.default_knobs()['base_lr']:.2e} at {config.train.reference_batch_size}, "
          f"target loss {a.target} "
          f"(fixed 512-image training slice, eval mode), {torch.get_num_threads()} threads", flush=True)
    factors = [float(f) for f in a.lr_factors.split(",")]
    runs = []
    for batch in batches:
        tried = []
        for factor in factors:
            run = train_to_target(config, data, batch, a.target, a.max_samples, a.eval_every, seed=0, lr_factor=factor)
            tried.append(run)
            reached = f"{run.samples:,.0f} samples, {run.steps:,.1f} steps" if run.samples else "not reached"
            print(f"  B={batch:<5d} peak LR {run.peak_lr:.2e} (×{factor:g}): {reached} in {run.wall_s:.0f}s; "
                  f"B_noise measured {run.noise_scale() or float('nan'):,.0f}; loss curve "
                  + " ".join(f"{s}:{loss:.3f}" for s, _, loss in run.curve[:: max(1, len(run.curve) // 8)]), flush=True)
        # the batch's best LR: the fewest samples to the target (a run that never got there ranks last)
        runs.append(min(tried, key=lambda r: r.samples if r.samples is not None else math.inf))
    if len(factors) > 1:
        print("best LR per batch: " + ", ".join(f"B={r.batch} {r.peak_lr:.2e}" for r in runs), flush=True)
    base = runs[0]
    noise = base.noise_scale()
    if base.samples is None or not noise:
        print("the smallest batch did not reach the target (or measured no B_noise): no prediction; "
              "raise --max-samples or the target")
        return 1
    e_min = base.samples / (1 + base.batch / noise)
    s_min = e_min / noise
    print(f"\nB_noise {noise:,.0f} (smallest batch, up to the target); E_min {e_min:,.0f} samples, "
          f"S_min {s_min:,.1f} steps")
    print(f"{'global_batch':>12s} {'samples':>9s} {'predicted':>9s} {'ratio':>6s} {'steps':>8s} {'predicted':>9s} "
          f"{'ratio':>6s} {'B_noise':>8s}")
    ratio = float("nan")
    for run in runs:
        e_pred, s_pred = e_min * (1 + run.batch / noise), s_min * (1 + noise / run.batch)
        if run.samples is None:
            print(f"{run.batch:12d} {'>' + format(a.max_samples, ','):>9s} {e_pred:9,.0f} {'-':>6s} {'-':>8s} "
                  f"{s_pred:9,.1f} {'-':>6s} {run.noise_scale() or float('nan'):8,.0f}")
            ratio = a.max_samples / e_pred  # a lower bound
            continue
        ratio = run.samples / e_pred
        print(f"{run.batch:12d} {run.samples:9,.0f} {e_pred:9,.0f} {ratio:6.2f} {run.steps:8,.1f} {s_pred:9,.1f} "
              f"{run.steps / s_pred:6.2f} {run.noise_scale() or float('nan'):8,.0f}")
    print(f"RESULT critical_batch ratio={ratio:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
