"""What a trial's Ray processes cost the cores beside training, with Train V2's PlacementGroupCleaner and without it.

Each case is a fresh process that starts a local cluster as raysweep does (2 CPUs, `cluster.ray_init_kwargs`) and
fits one trainer of one worker that only sleeps and reports every 2 s, so that what the cluster's other processes
use is all there is to see. After `--settle` s it reads every process's CPU time over `--seconds` (psutil; the
worker and this driver left out) and prints them by process, as a share of the 2 cores. The cases alternate,
`--repeats` times each:
- `ray`: Train V2's trainer with its PlacementGroupCleaner (it asks the State API every 1 s whether the controller
  lives: ray/train/v2/_internal/execution/controller/placement_group_cleaner.py) and without its DatasetManager, as
  raysweep's was before it dropped the cleaner;
- `raysweep`: raysweep's trainer class (trainer._trainer_class), which starts no cleaner and no DatasetManager;
- `pool`: the same on a cluster with Ray's worker pool as Ray sets it (one idle worker prestarted and kept per
  CPU), without raysweep's `cluster.WORKER_POOL`;
- `coordinator`: raysweep's trainer class with Train V2's fixed scaling policy as Ray builds it, whose resource
  requests create the cluster's detached AutoscalingCoordinator (raysweep's trainers make none: the docstring of
  trainer._trainer_class).
Each case also times its fit() from the call to the worker function's start on the fresh cluster (`to worker`).
Also, once: the threads of one idle actor (Ray's core worker wakes its main thread every 10 ms to check for signals:
`RunTaskExecutionLoop`, src/ray/core_worker/core_worker.cc), the floor every Ray process of a trial pays.
Last lines: RESULT ray_idle_background ratio=<raysweep's ÷ Ray's, the median background share>, RESULT
ray_idle_pool ratio=<raysweep's ÷ the same with Ray's worker pool>, RESULT ray_idle_coordinator ratio=<raysweep's ÷
the same with the coordinator>, RESULT ray_idle_coordinator_start ratio=<raysweep's ÷ the coordinator's, the median
time to the worker>.

    python benchmarks/ray_idle.py            # 60 s windows after 25 s, 2 repeats (~14 min)
    python benchmarks/ray_idle.py --quick    # 5 s windows after 15 s, 1 repeat: the code path

Figures in benchmarks/RESULTS.md (A trial's idle Ray processes).
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _idle(config):
    import ray.train

    Path(config["stamp"]).write_text(str(time.time()))
    started = time.monotonic()
    while time.monotonic() - started < config["seconds"]:
        time.sleep(2.0)
        ray.train.report({"at": time.monotonic() - started})


def _process_cpu() -> dict:
    """(pid, start time) → (title, CPU s) for every process under this one (Ray's daemons and workers)."""
    import psutil

    out = {}
    for p in psutil.Process().children(recursive=True):
        try:
            line, times = p.cmdline(), p.cpu_times()
        except psutil.Error:
            continue
        title = line[0] if line and line[0].startswith("ray::") else next(
            (a.rsplit("/", 1)[-1] for a in line[1:] if a.endswith(".py")), p.name())
        out[(p.pid, p.create_time())] = (title, times.user + times.system)
    return out


def _with_cleaner():
    """raysweep's trainer class as it was before it dropped the cleaner: Train V2's callbacks but the
    DatasetsCallback (whose DatasetManager, starting inside the window, would swamp the comparison)."""
    from ray.train.torch import TorchTrainer
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback

    class WithCleaner(TorchTrainer):
        def _create_default_callbacks(self):
            return [c for c in super()._create_default_callbacks() if not isinstance(c, DatasetsCallback)]

    return WithCleaner


def _with_coordinator(base):
    """`base` with the scaling policy Train V2 builds (its requests create the cluster's AutoscalingCoordinator)."""
    from ray.train.torch import TorchTrainer

    class WithCoordinator(base):
        def _initialize_and_run_controller(self, **controller_kwargs):
            return TorchTrainer._initialize_and_run_controller(self, **controller_kwargs)

    return WithCoordinator


def one_case(case: str, settle: float, seconds: float) -> dict:
    import ray
    from ray.train import RunConfig, ScalingConfig

    from raysweep.cluster import ray_init_kwargs
    from raysweep.trainer import _trainer_class

    kwargs = ray_init_kwargs()
    if case == "pool":
        kwargs.pop("_system_config")  # Ray's own worker pool
    ray.init(num_cpus=2, **kwargs)
    trainer_class = {"ray": _with_cleaner, "coordinator": lambda: _with_coordinator(_trainer_class())}.get(
        case, _trainer_class)()
    stamp = Path(tempfile.mkdtemp(prefix="ray_idle_stamp_")) / "worker"
    window: dict = {}

    def measure():
        time.sleep(settle)
        before, started = _process_cpu(), time.monotonic()
        time.sleep(seconds)
        after, window["s"] = _process_cpu(), time.monotonic() - started
        by = collections.Counter()
        for key, (title, cpu) in after.items():
            if title != "ray::RayTrainWorker":
                by[title] += cpu - before.get(key, (title, 0.0))[1]
        window["by"] = by

    watch = threading.Thread(target=measure)
    watch.start()
    called = time.time()
    trainer_class(_idle, train_loop_config={"seconds": settle + seconds + 6, "stamp": str(stamp)},
                  scaling_config=ScalingConfig(num_workers=1, resources_per_worker={"CPU": 1}),
                  run_config=RunConfig(storage_path=tempfile.mkdtemp(prefix="ray_idle_"), name="idle")).fit()
    watch.join()
    ray.shutdown()
    return {"share": sum(window["by"].values()) / window["s"] / 2, "to_worker": float(stamp.read_text()) - called,
            "by": {k: v / window["s"] / 2 for k, v in window["by"].items()}}


def idle_actor_threads(seconds: float) -> list[tuple[str, float]]:
    """CPU s per second of each thread of one idle actor, most first."""
    import ray

    from raysweep.cluster import ray_init_kwargs

    ray.init(num_cpus=2, **ray_init_kwargs())

    @ray.remote(num_cpus=0)
    class Idle:
        def pid(self) -> int:
            return os.getpid()

    idle = Idle.remote()  # held: an actor without a handle is gone
    pid = ray.get(idle.pid.remote(), timeout=120)
    time.sleep(5.0)

    def threads() -> dict:
        out = {}
        for task in glob.glob(f"/proc/{pid}/task/*"):
            try:
                fields = Path(task, "stat").read_text().rsplit(")", 1)[1].split()
                name = Path(task, "comm").read_text().strip()
            except OSError:
                continue
            out[task] = (name, (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"))
        return out

    before = threads()
    time.sleep(seconds)
    after = threads()
    ray.shutdown()
    rows = [(name, (cpu - before.get(task, (name, 0.0))[1]) / seconds) for task, (name, cpu) in after.items()]
    return sorted(rows, key=lambda r: -r[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--settle", type=float)
    parser.add_argument("--seconds", type=float)
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--case", choices=("ray", "raysweep", "pool", "coordinator", "actor"),
                        help=argparse.SUPPRESS)  # the child's
    args = parser.parse_args()
    settle = args.settle or (15.0 if args.quick else 25.0)
    seconds = args.seconds or (5.0 if args.quick else 60.0)
    if args.case == "actor":
        print("CASE " + json.dumps(idle_actor_threads(seconds)))
        return
    if args.case:
        print("CASE " + json.dumps(one_case(args.case, settle, seconds)))
        return

    def child(case: str):
        done = subprocess.run([sys.executable, __file__, "--case", case, "--settle", str(settle), "--seconds",
                               str(seconds)], capture_output=True, text=True, timeout=900)
        line = next((ln for ln in done.stdout.splitlines() if ln.startswith("CASE ")), None)
        if done.returncode != 0 or line is None:
            sys.exit(f"ray_idle: the {case} case failed: {done.stderr.strip()[-2000:]}")
        return json.loads(line.removeprefix("CASE "))

    runs: dict[str, list[dict]] = {"ray": [], "raysweep": [], "pool": [], "coordinator": []}
    for _ in range(args.repeats or (1 if args.quick else 2)):
        for case in runs:
            runs[case].append(child(case))
    names = {"ray": "with Train V2's cleaner", "raysweep": "raysweep's trainer (no cleaner)",
             "pool": "the same, Ray's worker pool", "coordinator": "the same, the coordinator"}
    print(f"a trial's Ray processes beside one sleeping worker: % of the 2 cores over {seconds:.0f} s windows, "
          f"{settle:.0f} s after the start")
    for case, results in runs.items():
        last = results[-1]["by"]
        top = ", ".join(f"{k} {100 * v:.2f}" for k, v in sorted(last.items(), key=lambda kv: -kv[1])[:8])
        shares = " ".join(f"{100 * r['share']:.2f}" for r in results)
        starts = " ".join(f"{r['to_worker']:.1f}" for r in results)
        print(f"{names[case]:<32} median {100 * statistics.median(r['share'] for r in results):5.2f} % (runs: "
              f"{shares}); to worker {statistics.median(r['to_worker'] for r in results):.1f} s (runs: {starts}); "
              f"the last run's largest: {top}")
    actor = child("actor")
    print("one idle actor's threads, CPU s per s: " + ", ".join(f"{name} {cpu:.4f}" for name, cpu in actor[:4]))
    share = {case: statistics.median(r["share"] for r in results) for case, results in runs.items()}
    print(f"RESULT ray_idle_background ratio={share['raysweep'] / max(share['ray'], 1e-9):.3f}")
    print(f"RESULT ray_idle_pool ratio={share['raysweep'] / max(share['pool'], 1e-9):.3f}")
    print(f"RESULT ray_idle_coordinator ratio={share['raysweep'] / max(share['coordinator'], 1e-9):.3f}")
    start = {case: statistics.median(r["to_worker"] for r in results) for case, results in runs.items()}
    print(f"RESULT ray_idle_coordinator_start ratio={start['raysweep'] / start['coordinator']:.3f}")


if __name__ == "__main__":
    main()
