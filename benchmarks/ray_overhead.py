"""What Ray Train costs a raysweep trial: steady-state epoch time in a TorchTrainer against the same
loop run bare in one process, and seconds from `fit()` to the first reported epoch.

Both sides run the same `TrainingRun` (build, then per epoch: train, evaluate, reduce, checkpoint)
on the same data with 1 worker holding both CPUs. Bare: epochs timed back to back, a torch.save of
the checkpoint each epoch. Ray: a `UserCallback` in the controller stamps each report, so the
interval between reports includes everything Ray adds (report collective, checkpoint upload).
Repetitions alternate bare / Ray; medians over epochs 2.. of each run.
Last line: RESULT ray_overhead ratio=<Ray ÷ bare steady-state epoch time>.

    python benchmarks/ray_overhead.py            # 2,048 images 64×24, 6 epochs, 2 repetitions
    python benchmarks/ray_overhead.py --quick    # seconds (CI)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "token")
os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def spec(train_size: int, epochs: int, tmp: Path):
    from raysweep.config import load_config

    text = f"""
name: overhead
storage_path: {tmp / 'runs'}
data: {{width: 64, height: 24, synthetic: {{train_size: {train_size}, val_size: 256, seed: 0}}}}
scaling: {{num_workers: 1, cpus_per_worker: 2}}
train: {{epochs: {epochs}, precision: fp32, checkpoint_every: 1}}
search: {{per_gpu_batch_size: 64, base_lr: 1.0e-3, warmup_epochs: 1, weight_decay: 1.0e-4}}
tune: {{asha: {{grace_period: 1}}}}
"""
    path = tmp / "spec.yaml"
    path.write_text(text)
    return load_config(path)


def bare(config, data) -> list[float]:
    """The trial's loop in this process: returns seconds per epoch."""
    import torch

    from raysweep.train_loop import TrainingRun, keep_host_memory

    keep_host_memory(torch.device("cpu"))  # as the worker does
    torch.set_num_threads(int(config.scaling.cpus_per_worker))  # what Ray gives the worker (OMP_NUM_THREADS)
    trial = config.trial(config.default_knobs(), len(data.train))
    run = TrainingRun.build(trial, data, 0, 1, torch.device("cpu"))
    times = []
    with tempfile.TemporaryDirectory() as d:
        for epoch in range(1, trial.train.epochs + 1):
            t0 = time.perf_counter()
            run.epoch(epoch)
            torch.save(run.state(epoch), os.path.join(d, "state.pt"))
            times.append(time.perf_counter() - t0)
    return times


def in_ray(config, data_ref, train_size: int, name: str, log: Path) -> tuple[list[float], float, float]:
    """The trial in a TorchTrainer: (seconds between reports, fit() → first report, first epoch's own time)."""
    import ray.train

    from raysweep.train_loop import make_trainer

    class Stamp(ray.train.UserCallback):
        def after_report(self, run_context, metrics, checkpoint):
            with open(log, "a") as f:
                f.write(json.dumps({"t": time.time(), "epoch_time_s": metrics[0]["epoch_time_s"]}) + "\n")

    log.unlink(missing_ok=True)
    trial = config.trial(config.default_knobs(), train_size)
    trainer = make_trainer(trial, data_ref, str(config.storage_path), name, [Stamp()])
    t_fit = time.time()
    trainer.fit()
    stamps = [json.loads(line) for line in log.read_text().splitlines()]
    intervals = [b["t"] - a["t"] for a, b in zip(stamps, stamps[1:])]
    own = [s["epoch_time_s"] for s in stamps[1:]]
    return intervals, stamps[0]["t"] - t_fit, stamps[0]["epoch_time_s"], own


def main() -> int:
    from raysweep.train_loop import worker_env

    if os.environ.get("GLIBC_TUNABLES") != worker_env()["GLIBC_TUNABLES"]:
        # the bare loop must run in the environment a raysweep worker starts with
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **worker_env()})
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--repeats", type=int, default=2)
    a = p.parse_args()
    train_size, epochs, repeats = (128, 3, 1) if a.quick else (2048, 6, a.repeats)

    import ray

    from raysweep.data import load_data
    from raysweep.sweep import ray_init_kwargs

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        config = spec(train_size, epochs, tmp)
        data = load_data(config.data, progress=False)
        t0 = time.time()
        ray.init(num_cpus=2, **ray_init_kwargs())
        init_s = time.time() - t0
        data_ref = ray.put(data)
        bare_epochs, ray_epochs, first, first_epoch, ray_own = [], [], [], [], []
        try:
            for rep in range(repeats):
                b = bare(config, data)
                bare_epochs += b[1:]
                r, f, fe, own = in_ray(config, data_ref, len(data.train), f"overhead-{rep}", tmp / "stamps.jsonl")
                ray_epochs += r
                ray_own += own
                first.append(f)
                first_epoch.append(fe)
                print(f"  rep {rep + 1}/{repeats}: bare {statistics.median(b[1:]):.2f} s/epoch, "
                      f"ray {statistics.median(r):.2f} s/epoch, first report {f:.1f} s", file=sys.stderr, flush=True)
        finally:
            ray.shutdown()

    import torch

    bare_s, ray_s = statistics.median(bare_epochs), statistics.median(ray_epochs)
    first_s, first_epoch_s = statistics.median(first), statistics.median(first_epoch)
    print(f"ray_overhead on {os.cpu_count()} CPUs, torch {torch.__version__}; 1 worker × 2 CPUs, gloo; "
          f"{train_size} images 64×24, batch 64, {epochs} epochs × {repeats} repetitions")
    print(f"{'measure':44s} {'value':>10s}")
    print(f"{'bare loop, s/epoch (median, epochs 2..)':44s} {bare_s:10.3f}")
    print(f"{'TorchTrainer, s between reports (median)':44s} {ray_s:10.3f}")
    own_label = "  of which the worker's own epoch (median), s"
    print(f"{own_label:44s} {statistics.median(ray_own):10.3f}")
    print(f"{'ratio Ray ÷ bare':44s} {ray_s / bare_s:10.3f}")
    print(f"{'ray.init() (local cluster start), s':44s} {init_s:10.1f}")
    print(f"{'fit() → first report, s':44s} {first_s:10.1f}")
    print(f"{'  of which the first epoch itself, s':44s} {first_epoch_s:10.1f}")
    print(f"{'  so start-up before epoch 1, s':44s} {first_s - first_epoch_s:10.1f}")
    print(f"RESULT ray_overhead ratio={ray_s / bare_s:.3f}")
    print(f"RESULT ray_first_report_s value={first_s:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
