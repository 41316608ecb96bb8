"""What Ray Train costs a raysweep trial: steady-state epoch time in a TorchTrainer against the same
loop run bare in one process, and seconds from `fit()` to the first reported epoch.

Both sides run the same `TrainingRun` (build, then per epoch: train, evaluate, reduce) on the same
data with 1 worker, neither checkpointing (a trial on its own group keeps no checkpoints since warm
groups; a warm slot's own checkpoint costs the same either way). Bare: epochs timed back to back; a
run's figure is the mean of epochs 2... Ray: a `UserCallback` in the controller stamps each
report, so the interval between reports includes everything Ray adds (the report barrier, the
controller's poll); a run's figure is (last stamp − first) ÷ intervals. The controller sees reports only when
it polls (every 0.2 s), so a single interval is off by up to 0.2 s while the span is off by that much
only at its two ends (a median of intervals would pick one side of the poll grid).

Two configurations, alternating bare / Ray within each repetition. Each repetition's ratio pairs its own bare and
Ray runs; the figure is the median of those paired ratios, printed with their spread (the lowest and highest): on
a 2-vCPU VM one repetition's ratio moves ±12 % (0.89-1.13 in five repetitions of one run), so a figure from three
repetitions can land anywhere in that band:
- all cores: the worker holds both CPUs (2 threads), so Ray's own processes (raylet, GCS,
  dashboard, the Train controller and its helper actors) share those cores with training;
- a core spare: the worker holds 1 CPU (1 thread; bare on 1 thread too, half the images so an
  epoch lasts about as long), so what is left is Ray Train's own per-epoch cost.
fit() → first report (all cores) is the median over repetitions, each listed: the first on a fresh
cluster also starts what a cluster starts once (raysweep's trainers start no AutoscalingCoordinator:
trainer._trainer_class); later ones are what every further trial of a sweep pays. Where the CPU
goes during the Ray trial's steady epochs (all cores, every process of this benchmark's cluster,
psutil): the worker's share and each of Ray's other processes'.
Last lines: RESULT ray_overhead ratio=<Ray ÷ bare, all cores>, RESULT ray_overhead_spare_core
ratio=<the same with a core spare>, RESULT ray_first_report_s value=<seconds>.

    python benchmarks/ray_overhead.py            # 64×24 images, 8 epochs, 5 repetitions (~8 min)
    python benchmarks/ray_overhead.py --quick    # seconds (CI)
    python benchmarks/ray_overhead.py --timeline # which processes a trial starts, when, at what CPU cost
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
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # raysweep, and the tests' one-trial worker (tests/one_trial.py)


def spec(train_size: int, epochs: int, tmp: Path, cpus_per_worker: int = 2):
    from raysweep.config import load_config

    text = f"""
name: overhead
storage_path: {tmp / 'runs'}
data: {{width: 64, height: 24, synthetic: {{train_size: {train_size}, val_size: 256, seed: 0}}}}
scaling: {{num_workers: 1, cpus_per_worker: {cpus_per_worker}}}
train: {{epochs: {epochs}, precision: fp32, checkpoint_every: 1}}
search: {{per_gpu_batch_size: 64, base_lr: 1.0e-3, warmup_epochs: 1, weight_decay: 1.0e-4}}
tune: {{asha: {{grace_period: 1}}}}
"""
    path = tmp / f"spec-{cpus_per_worker}.yaml"
    path.write_text(text)
    return load_config(path)


def bare(config, data) -> list[float]:
    """The trial's loop in this process: returns seconds per epoch."""
    import torch

    from raysweep.metrics import report_dict
    from raysweep.worker.device import keep_host_memory
    from raysweep.worker.run import TrainingRun

    keep_host_memory(torch.device("cpu"))  # as the worker does
    torch.set_num_threads(int(config.scaling.cpus_per_worker))  # what Ray gives the worker (OMP_NUM_THREADS)
    trial = config.trials.trial(config.trials.default_knobs(), len(data.train))
    run = TrainingRun.build(trial, data, 0, 1, torch.device("cpu"))
    times = []
    for epoch in range(1, trial.train.epochs + 1):
        t0 = time.perf_counter()
        report_dict(run.epoch(epoch), run.worker_params())
        times.append(time.perf_counter() - t0)
    return times


class CpuShare:
    """CPU seconds of every process of this benchmark's cluster (its descendants: the raylet, the GCS, the
    dashboard, the workers), sampled every 0.5 s while a trial runs, for a window between two report stamps."""

    def __init__(self):
        import threading

        import psutil

        self.me, self.samples, self.done = psutil.Process(), [], threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def _poll(self):
        while not self.done.is_set():
            self.samples.append(self._sample())
            self.done.wait(0.5)

    def _sample(self) -> tuple[float, dict]:
        import psutil

        row = {}
        for p in self.me.children(recursive=True):
            try:
                with p.oneshot():
                    t = p.cpu_times()
                    row[p.pid] = (" ".join(p.cmdline()), p.name(), t.user + t.system)
            except psutil.Error:  # a process that exited mid-walk
                pass
        return time.time(), row

    def window(self, t0: float, t1: float) -> tuple[float, list[tuple[float, str]]]:
        """(seconds between the last sample at or before t0 and the first at or after t1, [(CPU seconds, process),
        ...] most first): the samples that bracket the window, so a window shorter than the sampling interval
        (--quick's epochs, or a loaded machine's) still spans one. (0, []) where fewer than two samples bracket it.
        Each process counts up to the last sample it is in: the trial's worker often exits before the sample after
        the last report, and a process missing from that sample alone was left out (its CPU with it)."""
        self.done.set()
        self.thread.join()
        if not self.samples or self.samples[-1][0] < t1:  # fit() returned within one interval of its last report
            self.samples.append(self._sample())
        first = max((i for i, s in enumerate(self.samples) if s[0] <= t0), default=None)
        last = min((i for i, s in enumerate(self.samples) if s[0] >= t1), default=None)
        if first is None or last is None:
            return 0.0, []
        start = self.samples[first][1]
        seen = titled([row for _, row in self.samples[first:last + 1]], start)
        used = [(cpu - start[pid][2], name) for pid, (name, cpu) in seen.items()]
        return self.samples[last][0] - self.samples[first][0], sorted(used, reverse=True)


def titled(rows: list[dict], start: dict) -> dict[int, tuple[str, float]]:
    """pid → (its title, its last CPU seconds) over sampled rows of pid → (command line, name, CPU seconds), for the
    processes in `start`. An actor's title once read is kept: a process that is exiting shows ray::IDLE, or an empty
    command line, where only the kernel's name is left, cut to 15 characters (`ray::RayTrainWo`): that name once
    split the trial's worker in two in the CPU line."""
    seen: dict[int, tuple[str, float]] = {}
    for row in rows:
        for pid, (cmdline, name, cpu) in row.items():
            if pid not in start:
                continue
            if pid not in seen:
                title = cmdline or name
            elif cmdline.startswith("ray::") and not cmdline.startswith("ray::IDLE"):
                title = cmdline
            else:
                title = seen[pid][0]
            seen[pid] = (title, cpu)
    return seen


def process_label(cmdline: str) -> str:
    """`ray::TrainController.run` → `TrainController`; a Python program by its script (`dashboard.py`, `agent.py`),
    the others (raylet, gcs_server) by their program's name."""
    if cmdline.startswith("ray::"):
        return cmdline.split()[0][5:].split(".")[0]
    words = cmdline.split()
    script = next((w for w in words[1:] if w.endswith(".py")), None)
    return (script or words[0]).rsplit("/", 1)[-1]


def in_ray(config, data_ref, train_size: int, name: str, log: Path,
           share: CpuShare | None = None) -> tuple[list[float], float, float, list[float]]:
    """The trial in a TorchTrainer: (seconds between reports, fit() → first report, the first epoch's own
    time, the worker's own epoch times from epoch 2 on). `share`: sampling the processes' CPU meanwhile (its
    window is the reports' span)."""
    import ray.train

    from raysweep.trainer import make_trainer

    class Stamp(ray.train.UserCallback):
        def after_report(self, run_context, metrics, checkpoint):
            with open(log, "a") as f:
                f.write(json.dumps({"t": time.time(), "epoch_time_s": metrics[0]["epoch_time_s"]}) + "\n")

    log.unlink(missing_ok=True)
    trial = config.trials.trial(config.trials.default_knobs(), train_size)
    from one_trial import one_trial_worker

    trainer = make_trainer(trial, data_ref, str(config.storage_path), name, [Stamp()], worker_fn=one_trial_worker)
    t_fit = time.time()
    trainer.fit()
    stamps = [json.loads(line) for line in log.read_text().splitlines()]
    intervals = [b["t"] - a["t"] for a, b in zip(stamps, stamps[1:])]
    own = [s["epoch_time_s"] for s in stamps[1:]]
    if share is not None:
        share.span = share.window(stamps[0]["t"], stamps[-1]["t"])
    return intervals, stamps[0]["t"] - t_fit, stamps[0]["epoch_time_s"], own


CORES = 2  # the local cluster's CPUs (ray.init's num_cpus): the CI and dev VMs' two
CONFIGS = {"all cores": (CORES, 2048), "a core spare": (CORES - 1, 1024)}  # name: (CPUs for the worker, images)


def timeline(config, data_ref, train_size: int, log: Path, label: str) -> None:
    """One 1-epoch trial: every process that starts from fit() to the end, by its Ray title (last seen), with
    its start time relative to fit() and the CPU seconds it used; then the first report. Polls every 50 ms
    (the polling itself takes some CPU: figures a little above the benchmark's)."""
    import threading

    import psutil
    import ray
    from ray.util.state import list_actors

    def title(p):
        cmd = " ".join(p.cmdline())
        return cmd.split(" ")[0][:48] if cmd.startswith("ray::") else "(python worker starting)"

    # this benchmark's own processes: the local cluster ray.init() started is its descendants (the raylet, the GCS
    # and the workers the raylet forks), so a process elsewhere on the machine (another test's cluster, the test
    # hosts of tests/test_ray_up.py) never enters the table
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    gcs = ray.get_runtime_context().gcs_address  # this cluster's: without one the State API looks for every Ray
    # instance on the machine, and fails when it finds two
    actors_before = {a.actor_id for a in list_actors(address=gcs, limit=10_000)}
    seen: dict[int, list] = {}  # pid → [create_time, title, cpu seconds]
    done = threading.Event()

    def poll():
        while not done.is_set():
            try:
                ours = me.children(recursive=True)
            except psutil.Error:  # a child that exited mid-walk
                continue
            for p in ours:
                if p.pid in before:
                    continue
                try:
                    with p.oneshot():
                        t = p.cpu_times()
                        row = seen.setdefault(p.pid, [p.create_time(), "", 0.0])
                        name = title(p)
                        # keep the actor's title once seen: an exiting process shows IDLE or no ray:: title
                        if not row[1] or (name.startswith("ray::") and name != "ray::IDLE"):
                            row[1] = name
                        row[2] = t.user + t.system
                except psutil.Error:
                    pass
            done.wait(0.05)

    thread = threading.Thread(target=poll, daemon=True)
    one_epoch = config.model_copy(update={"train": config.train.model_copy(update={"epochs": 1})})
    t_fit = time.time()
    thread.start()
    _, _, first_epoch, _ = in_ray(one_epoch, data_ref, train_size, f"timeline-{label}", log)
    done.set()
    thread.join()
    # Which actor ran in which process comes from Ray's State API: a process title sampled every 50 ms can miss
    # a short-lived actor's, and an actor placed in a worker process started earlier has no new pid at all.
    for actor in list_actors(address=gcs, detail=True, limit=10_000):
        if actor.actor_id in actors_before:
            continue
        if not actor.pid:  # the State API may hold no pid for an actor already gone: listed all the same
            seen[actor.actor_id] = [t_fit, f"ray::{actor.class_name} (its process not seen)", float("nan")]
        elif actor.pid in seen:
            seen[actor.pid][1] = f"ray::{actor.class_name}"
        else:
            seen[actor.pid] = [t_fit, f"ray::{actor.class_name} (in a process started before fit)", float("nan")]
    first = json.loads(log.read_text().splitlines()[0])["t"] - t_fit
    print(f"timeline of a 1-epoch trial, {label} (0 s: the trainer is built and fit() called; processes started "
          "since):")
    print(f"{'start s':>8s} {'CPU s':>6s}  process")
    for created, name, cpu in sorted(seen.values()):
        print(f"{created - t_fit:8.2f} {cpu:6.2f}  {name}")
    print(f"{first:8.2f} {'':6s}  first report reaches the controller (the epoch itself {first_epoch:.2f} s)")


def cpu_line(shares: list) -> None:
    """Where the two cores went during the all-cores trials' reports: the worker's share, and the rest by process."""
    span = sum(s for s, _ in shares)
    if span <= 0:
        print("CPU during the Ray trials' epochs: not measured (no two samples, 0.5 s apart, bracket their reports)")
        return
    by: dict[str, float] = {}
    for _, used in shares:
        for cpu, name in used:
            by[process_label(name)] = by.get(process_label(name), 0.0) + cpu
    worker = by.pop("RayTrainWorker", 0.0)
    others = sorted(by.items(), key=lambda kv: -kv[1])
    cores = CORES * span
    print(f"CPU during the Ray trials' epochs (all cores, {span:.0f} s): the worker {100 * worker / cores:.1f} % of "
          f"the {CORES} cores; Ray's other processes {100 * sum(by.values()) / cores:.1f} %: "
          + ", ".join(f"{k} {100 * v / cores:.1f}" for k, v in others[:8] if v > 0))


def main() -> int:
    from raysweep.trainer import worker_env

    if os.environ.get("GLIBC_TUNABLES") != worker_env()["GLIBC_TUNABLES"]:
        # the bare loop must run in the environment a raysweep worker starts with
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **worker_env()})
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--timeline", action="store_true",
                   help="only: which processes a trial starts, when, at what CPU cost (two trials)")
    p.add_argument("--and-timeline", action="store_true",
                   help="the timeline's two trials first, then the overhead figures, on one cluster (the tests' way)")
    a = p.parse_args()
    scale, epochs, repeats = (16, 3, 1) if a.quick else (1, 8, a.repeats)

    import ray

    from raysweep.cluster import ray_init_kwargs
    from raysweep.data import load_data

    runs = {name: {"bare": [], "ray": [], "own": [], "first": [], "first_epoch": [], "ratio": []} for name in CONFIGS}
    shares = []  # CpuShare windows of the all-cores trials
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        setups = {}
        for name, (cpus, images) in CONFIGS.items():
            config = spec(images // scale, epochs, tmp, cpus)
            setups[name] = (config, load_data(config.data))
        t0 = time.time()
        ray.init(num_cpus=CORES, **ray_init_kwargs())
        init_s = time.time() - t0
        refs = {name: ray.put(data) for name, (_, data) in setups.items()}
        if a.timeline or a.and_timeline:
            try:
                config, data = setups["all cores"]
                time.sleep(2)  # let the cluster's own start-up settle
                for label in ("the first on this cluster", "a later one"):
                    timeline(config, refs["all cores"], len(data.train), tmp / "stamps.jsonl", label)
            finally:
                if a.timeline:
                    ray.shutdown()
            if a.timeline:
                return 0
        try:
            for rep in range(repeats):
                for name, (config, data) in setups.items():
                    r = runs[name]
                    b = bare(config, data)
                    r["bare"].append(statistics.mean(b[1:]))
                    share = CpuShare() if name == "all cores" else None
                    intervals, first, first_epoch, own = in_ray(config, refs[name], len(data.train),
                                                                f"overhead-{rep}-{config.scaling.cpus_per_worker}",
                                                                tmp / "stamps.jsonl", share)
                    if share is not None:
                        shares.append(share.span)
                    r["ray"].append(statistics.mean(intervals))  # = (last stamp − first) / intervals
                    r["ratio"].append(r["ray"][-1] / r["bare"][-1])
                    r["own"].append(statistics.mean(own))
                    r["first"].append(first)
                    r["first_epoch"].append(first_epoch)
                    print(f"  rep {rep + 1}/{repeats} {name:12s}: bare {r['bare'][-1]:.3f} s/epoch, ray "
                          f"{r['ray'][-1]:.3f} s/epoch (ratio {r['ray'][-1] / r['bare'][-1]:.3f}), first report "
                          f"{first:.1f} s", file=sys.stderr, flush=True)
        finally:
            ray.shutdown()

    import torch

    med = {name: {k: statistics.median(v) for k, v in r.items()} for name, r in runs.items()}
    print(f"ray_overhead on {os.cpu_count()} CPUs, torch {torch.__version__}; 1 worker, gloo; images 64×24, batch 64, "
          f"{epochs} epochs × {repeats} repetitions; medians over repetitions")
    print(f"{'configuration':13s} {'images':>6s} {'bare s/epoch':>12s} {'Ray s/epoch':>11s} {'worker own':>10s} "
          f"{'Ray ÷ bare':>10s} {'first report s':>14s}  (Ray ÷ bare: the median of each repetition's own; its spread)")
    for name, (_, images) in CONFIGS.items():
        m, ratios = med[name], runs[name]["ratio"]
        print(f"{name:13s} {images // scale:6d} {m['bare']:12.3f} {m['ray']:11.3f} {m['own']:10.3f} "
              f"{m['ratio']:10.3f} {m['first']:14.1f}  ({min(ratios):.3f}-{max(ratios):.3f})")
    cpu_line(shares)
    m = med["all cores"]
    print(f"fit() → first report, all cores: {m['first']:.1f} s median (each: "
          f"{', '.join(f'{f:.1f}' for f in runs['all cores']['first'])}); first epoch itself {m['first_epoch']:.1f} s, "
          f"so start-up {m['first'] - m['first_epoch']:.1f} s; ray.init() of the local cluster {init_s:.1f} s")
    print(f"RESULT ray_overhead_spare_core ratio={med['a core spare']['ratio']:.3f}")
    print(f"RESULT ray_first_report_s value={m['first']:.2f}")
    print(f"RESULT ray_overhead ratio={m['ratio']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
