"""Where a CPU worker's loop thread allocates: glibc's arena per thread (before) against the main arena (now).

Ray Train runs a worker's loop on a thread of the worker process, and glibc gives each new thread an arena of its
own whose heaps hold at most 64 MB (HEAP_MAX_SIZE, glibc's malloc/arena.c): a tensor above that is mapped fresh and
unmapped when freed, every step, whatever worker.device.keep_host_memory set (M_MMAP_MAX keeps blocks in the main
arena's heap only). raysweep's workers start with `glibc.malloc.arena_max=1` (trainer.worker_env).

One local cluster; per repetition, one trial with each environment (the order alternating), each a `TorchTrainer`
as raysweep builds it (trainer.make_trainer; tests/one_trial.py's loop). A trial's figure is the mean of its
worker's own epoch times from epoch 2 on (rank 0's `epoch_time_s`); the peak resident memory of its workers is
sampled every 0.1 s (psutil). The figure is the median over repetitions of each one's ratio (main arena ÷ arenas
per thread), with the spread. Last line: RESULT worker_arena ratio=<the batches' median of those figures>.

    python benchmarks/worker_arena.py            # the quickstart's images and workers, per-GPU 64 and 192 (~6 min)
    python benchmarks/worker_arena.py --quick    # seconds (CI)
    python benchmarks/worker_arena.py --shape overhead  # ray_overhead.py's trial: 64×24, 1 worker × 2 threads

Precision is the spec's `auto` (bf16 where the CPU has it; ray_overhead.py trains fp32).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # raysweep, and the tests' one-trial worker (tests/one_trial.py)

BEFORE = "glibc.malloc.hugetlb=1"  # worker_env's GLIBC_TUNABLES until the main arena


def spec(tmp: Path, batch: int, train_size: int, epochs: int, width: int, height: int, workers: int, cpus: int):
    from raysweep.config import load_config

    path = tmp / f"arena-{batch}.yaml"
    path.write_text(f"""
name: arena
storage_path: {tmp / 'runs'}
data: {{width: {width}, height: {height}, synthetic: {{train_size: {train_size}, val_size: 128, seed: 0}}}}
scaling: {{num_workers: {workers}, cpus_per_worker: {cpus}}}
train: {{epochs: {epochs}, precision: auto, checkpoint_every: 1}}
search: {{per_gpu_batch_size: {batch}, base_lr: 1.0e-3, warmup_epochs: 1, weight_decay: 1.0e-4}}
""")
    return load_config(path)


def peak_rss(stop: threading.Event, peaks: dict) -> None:
    """The largest resident memory of each Ray Train worker of this process's cluster, until `stop`."""
    import psutil

    me = psutil.Process()
    while not stop.is_set():
        for p in me.children(recursive=True):
            try:
                if "RayTrainWorker" in " ".join(p.cmdline()):
                    peaks[p.pid] = max(peaks.get(p.pid, 0), p.memory_info().rss)
            except psutil.Error:  # a process that exited mid-walk
                pass
        stop.wait(0.1)


def trial(config, data_ref, train_size: int, env: dict, name: str, log: Path) -> tuple[float, float]:
    """(seconds per epoch, the worker's own from epoch 2 on; the workers' peak RSS in GiB) of one trial."""
    import ray.train

    from raysweep.trainer import make_trainer

    from one_trial import one_trial_worker

    class Stamp(ray.train.UserCallback):
        def after_report(self, run_context, metrics, checkpoint):
            with open(log, "a") as f:
                f.write(json.dumps(metrics[0]["epoch_time_s"]) + "\n")

    log.unlink(missing_ok=True)
    stop, peaks = threading.Event(), {}
    sampler = threading.Thread(target=peak_rss, args=(stop, peaks), daemon=True)
    sampler.start()
    t = config.trials.trial(config.trials.default_knobs(), train_size)
    try:
        make_trainer(t, data_ref, str(config.storage_path), name, [Stamp()], env=env,
                     worker_fn=one_trial_worker).fit()
    finally:
        stop.set()
        sampler.join()
    epochs = [json.loads(line) for line in log.read_text().splitlines()]
    return statistics.mean(epochs[1:]), max(peaks.values(), default=0) / 2**30


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--shape", choices=("quickstart", "overhead"), default="quickstart")
    a = p.parse_args()
    # per-GPU batch: (images, epochs); the quickstart's 160×60 images and workers, ray_overhead.py's trial, or --quick
    batches, width, height, workers, cpus = (
        ({16: (64, 2)}, 64, 24, 2, 1) if a.quick else
        ({64: (2048, 8)}, 64, 24, 1, 2) if a.shape == "overhead" else
        ({64: (1024, 4), 192: (1536, 4)}, 160, 60, 2, 1))
    repeats = 1 if a.quick else a.repeats

    import ray

    from raysweep.cluster import ray_init_kwargs
    from raysweep.data import load_data
    from raysweep.trainer import worker_env

    now = worker_env()
    envs = {"an arena per thread": {**now, "GLIBC_TUNABLES": BEFORE}, "the main arena": now}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        ray.init(num_cpus=2, **ray_init_kwargs())
        try:
            for batch, (images, epochs) in batches.items():
                config = spec(tmp, batch, images, epochs, width, height, workers, cpus)
                data_ref = ray.put(load_data(config.data))
                runs = {name: [] for name in envs}
                for rep in range(repeats):
                    order = list(envs) if rep % 2 == 0 else list(envs)[::-1]
                    for name in order:
                        t0 = time.time()
                        runs[name].append(trial(config, data_ref, images, envs[name], f"arena-{batch}-{rep}-{name[:5]}",
                                                tmp / "epochs.jsonl"))
                        print(f"  per-GPU {batch} rep {rep + 1}/{repeats} {name}: {runs[name][-1][0]:.3f} s/epoch, "
                              f"peak RSS {runs[name][-1][1]:.2f} GiB ({time.time() - t0:.0f} s)", file=sys.stderr,
                              flush=True)
                ratios = [n[0] / b[0] for b, n in zip(runs["an arena per thread"], runs["the main arena"])]
                rows.append((batch, runs, ratios))
        finally:
            ray.shutdown()

    print(f"worker_arena: {workers} CPU worker(s) × {cpus} thread(s), images {width}×{height}, {repeats} repetitions; "
          "s/epoch: the worker's own from epoch 2 on, median; peak RSS: the workers' largest, GiB, each run")
    print(f"{'per-GPU':>7s} {'arena per thread s':>18s} {'main arena s':>12s} {'ratio':>6s} {'(spread)':>13s}  "
          f"peak RSS per thread → main")
    for batch, runs, ratios in rows:
        before, after = runs["an arena per thread"], runs["the main arena"]
        was, now = statistics.median(r[0] for r in before), statistics.median(r[0] for r in after)
        print(f"{batch:7d} {was:18.3f} {now:12.3f} {statistics.median(ratios):6.3f} "
              f"({min(ratios):.3f}-{max(ratios):.3f})  "
              f"{' '.join(f'{r[1]:.2f}' for r in before)} → {' '.join(f'{r[1]:.2f}' for r in after)}")
    print(f"RESULT worker_arena ratio={statistics.median(statistics.median(r) for _, _, r in rows):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
