"""The same sweep on warm worker groups (this checkout) and on a worker group per trial (an older commit), side by
side in one run: wall time, trial start → first training step, the gap between trials, and whether both pruned
the same trials and found the same best one.

    python benchmarks/warm_groups.py                     # the quickstart, against 46d03a6 (before warm groups)
    python benchmarks/warm_groups.py --base COMMIT --spec search_spaces/quickstart.yaml --set tune.num_samples=4

Both sweeps run as users run them (`python -m raysweep tune SPEC`), one after the other, each in a folder of its
own with its own local Ray; the older commit from a `git worktree`, put first on PYTHONPATH (Ray's workers inherit
it from the raylet the driver starts). Figures come from each sweep's MLflow store, measured the same way for
both: a trial's start is its child run's start (the driver's `on_trial_start`), its first training step is when
its first epoch was logged minus that epoch's `epoch_time_s`, and the gap is one run's start minus the previous
run's end (trials run one at a time on 2 cores). Training is Σ epoch_time_s over the sweep's trials: a sweep's
wall time cannot fall below it, so the best ratio warm groups could reach is printed beside the measured one.

Before the sweeps, the bare anchors on the same machine and Ray: `ray.init`; a plain Ray actor
that imports torch and touches the device (what a process costs); an empty `TorchTrainer` with the spec's
workers (device, one all-reduce, one report), from `fit()` to its worker function and to `fit()`'s return
(what a Ray Train group costs). The warm sweep's start-up phases (its MLflow `startup_*` metrics) are printed
beside them, as ratios. Prints one RESULT line.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from raysweep.config import load_config  # noqa: E402  (this checkout's; the base commit's runs in its own process)
from raysweep.metrics import STARTUP_NAMES  # noqa: E402

BEFORE_WARM_GROUPS = "46d03a6"


def run_sweep(code: Path, spec: Path, sets: list[str], folder: Path, label: str) -> float:
    """`python -m raysweep tune` with `code` first on the path, in `folder`; returns its wall seconds."""
    path = os.pathsep.join([str(code), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env = {**os.environ, "PYTHONPATH": path}
    command = [sys.executable, "-m", "raysweep", "tune", str(spec), *(a for s in sets for a in ("--set", s))]
    t0 = time.monotonic()
    with open(folder / "out.txt", "w") as out:
        rc = subprocess.run(command, cwd=folder, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    wall = time.monotonic() - t0
    if rc not in (0, 1):
        sys.exit(f"{label}: tune exited {rc}; see {folder / 'out.txt'}")
    return wall


def anchors(workers: int, cpus_per_worker: int, tmp: Path, repeats: int = 3) -> dict:
    """Bare Ray on this machine, before any sweep: seconds of `ray.init`, of a plain actor importing torch (from
    `.remote()` to its answer), and of an empty TorchTrainer (`fit()` → its worker function, and → return)."""
    import ray
    import ray.train
    from ray.train.torch import TorchTrainer

    from raysweep.cluster import ray_init_kwargs

    @ray.remote(num_cpus=1)
    class Bare:
        def ready(self) -> float:
            import torch

            torch.zeros(1).add_(1)  # the device touched
            return time.time()

    def empty(config):
        import torch
        import torch.distributed as dist

        started = time.time()
        x = torch.ones(1)
        dist.all_reduce(x)
        ray.train.report({"sum": float(x)})
        if ray.train.get_context().get_world_rank() == 0:  # V2 keeps no metrics without a checkpoint: a file
            Path(config["stamp"]).write_text(str(started))

    t0 = time.monotonic()
    ray.init(num_cpus=os.cpu_count(), **ray_init_kwargs())
    out = {"init": time.monotonic() - t0, "actor": [], "to_fn": [], "fit": []}
    try:
        for rep in range(repeats):
            t0 = time.time()
            actor = Bare.remote()
            out["actor"].append(ray.get(actor.ready.remote()) - t0)
            ray.kill(actor)
            stamp = tmp / f"started-{rep}"
            trainer = TorchTrainer(
                empty, train_loop_config={"stamp": str(stamp)},
                scaling_config=ray.train.ScalingConfig(num_workers=workers,
                                                       resources_per_worker={"CPU": cpus_per_worker}),
                run_config=ray.train.RunConfig(name=f"empty-{rep}", storage_path=str(tmp / "empty")))
            t0 = time.time()
            trainer.fit()
            out["fit"].append(time.time() - t0)
            out["to_fn"].append(float(stamp.read_text()) - t0)
            print(f"  anchors {rep + 1}/{repeats}: actor {out['actor'][-1]:.1f}s, empty TorchTrainer: worker "
                  f"function after {out['to_fn'][-1]:.1f}s, fit() {out['fit'][-1]:.1f}s", flush=True)
    finally:
        ray.shutdown()
    return out


def figures(folder: Path) -> dict:
    """Per trial (by its index in the sweep): status, start → first step, and the gaps between trials."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{folder / 'mlflow.db'}")
    (experiment,) = [e for e in client.search_experiments() if e.name != "Default"]
    runs = client.search_runs([experiment.experiment_id])
    parent = next(r for r in runs if "mlflow.parentRunId" not in r.data.tags)
    children = sorted((r for r in runs if "mlflow.parentRunId" in r.data.tags), key=lambda r: r.info.start_time)
    trials = {}
    for r in children:
        index = r.data.tags["trial_id"].rsplit("_", 1)[-1]
        first = min(client.get_metric_history(r.info.run_id, "epoch"), key=lambda m: m.step)
        epoch_time = next(m.value for m in client.get_metric_history(r.info.run_id, "epoch_time_s")
                          if m.step == first.step)
        phases = {name: h[0].value for name in STARTUP_NAMES if (h := client.get_metric_history(r.info.run_id, name))}
        trials[index] = {"status": r.info.status, "epochs": int(max(m.step for m in client.get_metric_history(
            r.info.run_id, "epoch"))), "first_step_s": (first.timestamp - r.info.start_time) / 1000 - epoch_time,
            "startup_s": phases.get("startup_s"), "phases": phases,
            "train_s": sum(m.value for m in client.get_metric_history(r.info.run_id, "epoch_time_s"))}
    gaps = [(b.info.start_time - a.info.end_time) / 1000 for a, b in itertools.pairwise(children)]
    return {"trials": trials, "gaps": gaps, "train_s": sum(t["train_s"] for t in trials.values()),
            "best": parent.data.tags.get("best_trial_id", "?").rsplit("_", 1)[-1],
            "busy": parent.data.metrics.get("busy_share")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default=BEFORE_WARM_GROUPS, help="the commit to compare with")
    parser.add_argument("--spec", default=str(ROOT / "search_spaces" / "quickstart.yaml"))
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    spec = Path(args.spec).resolve()
    scaling = load_config(spec, args.sets).scaling
    with tempfile.TemporaryDirectory(prefix="warm-groups-") as tmp:
        tmp = Path(tmp)
        bare = anchors(scaling.num_workers, int(scaling.cpus_per_worker), tmp)
        base_code = tmp / "base-code"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base_code), args.base],
                       check=True, capture_output=True)
        try:
            results = {}
            for label, code in ((f"per-trial groups ({args.base})", base_code), ("warm groups (this checkout)", ROOT)):
                folder = tmp / label.split()[0]
                folder.mkdir()
                wall = run_sweep(code, spec, args.sets, folder, label)
                results[label] = (wall, figures(folder))
                print(f"{label}: {wall:.0f}s", flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base_code)],
                           capture_output=True)
            shutil.rmtree(base_code, ignore_errors=True)
    (base_label, (base_wall, base)), (warm_label, (warm_wall, warm)) = results.items()
    print(f"\n{'trial':<6} {'status (per-trial / warm)':<28} {'epochs':<8} {'start → first step, s':<24} "
          f"warm startup_s")
    for index in sorted(base["trials"]):
        b, w = base["trials"][index], warm["trials"].get(index, {})
        print(f"{index:<6} {b['status'] + ' / ' + w.get('status', '-'):<28} {b['epochs']} / {w.get('epochs', '-'):<4} "
              f"{b['first_step_s']:>6.1f} / {w.get('first_step_s', float('nan')):>6.1f}            "
              f"{w.get('startup_s') or float('nan'):.1f}")

    def after_first(f):
        return statistics.median(t["first_step_s"] for i, t in sorted(f["trials"].items())[1:])

    same = ({i: (t["status"], t["epochs"]) for i, t in base["trials"].items()}
            == {i: (t["status"], t["epochs"]) for i, t in warm["trials"].items()})
    print(f"\nwall: {base_wall:.0f}s / {warm_wall:.0f}s; median start → first step after the first trial: "
          f"{after_first(base):.1f}s / {after_first(warm):.1f}s; median gap between trials: "
          f"{statistics.median(base['gaps']):.1f}s / {statistics.median(warm['gaps']):.1f}s; best trial "
          f"{base['best']} / {warm['best']}; busy (warm) {warm['busy'] or 0:.0%}")
    overhead = warm_wall - warm["train_s"]
    print(f"training (Σ epoch_time_s): {base['train_s']:.0f}s / {warm['train_s']:.0f}s; wall − training: "
          f"{base_wall - base['train_s']:.0f}s / {overhead:.0f}s")

    first_trial, *later = [t["phases"] for _, t in sorted(warm["trials"].items())]
    actor, to_fn, fit = (statistics.median(bare[k]) for k in ("actor", "to_fn", "fit"))
    print(f"\nbare anchors (medians of {len(bare['fit'])}): ray.init {bare['init']:.1f}s; a plain actor "
          f"importing torch {actor:.1f}s; an empty TorchTrainer ({scaling.num_workers} workers): worker function "
          f"after {to_fn:.1f}s, fit() {fit:.1f}s")
    print(f"{'start-up phase, s':<20} {'first trial':>11} {'warm trials (median)':>21}")
    for name in STARTUP_NAMES:
        print(f"{name:<20} {first_trial.get(name, float('nan')):>11.2f} "
              f"{statistics.median(p.get(name, float('nan')) for p in later):>21.2f}")
    warm_startup = statistics.median(p["startup_s"] for p in later)
    print(f"first trial's startup_s ÷ empty TorchTrainer's fit() → worker function: "
          f"{first_trial['startup_s'] / to_fn:.2f}; a warm trial's startup_s ÷ a plain actor's start: "
          f"{warm_startup / actor:.2f}; ÷ the empty TorchTrainer's: {warm_startup / to_fn:.3f}")
    floor = bare["init"] + to_fn + warm["train_s"]
    print(f"floor: ray.init + an empty TorchTrainer to its worker function + training = {floor:.0f}s, so at most "
          f"{base_wall / floor:.2f}× with everything else (imports, MLflow, Tune, the report) at zero")
    print(f"RESULT warm_groups wall_ratio={base_wall / warm_wall:.2f} first_step_s={after_first(warm):.1f} "
          f"base_first_step_s={after_first(base):.1f} gap_s={statistics.median(warm['gaps']):.1f} "
          f"base_gap_s={statistics.median(base['gaps']):.1f} same_trials_pruned={int(same)} "
          f"same_best={int(base['best'] == warm['best'])} train_s={warm['train_s']:.0f} "
          f"wall_ratio_if_no_overhead={base_wall / warm['train_s']:.2f} "
          f"startup_over_empty_trainer={first_trial['startup_s'] / to_fn:.2f} "
          f"warm_startup_over_actor={warm_startup / actor:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
