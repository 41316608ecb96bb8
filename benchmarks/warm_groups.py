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
run's end (trials run one at a time on 2 cores). Prints one RESULT line.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEFORE_WARM_GROUPS = "46d03a6"


def run_sweep(code: Path, spec: Path, sets: list[str], folder: Path, label: str) -> float:
    """`python -m raysweep tune` with `code` first on the path, in `folder`; returns its wall seconds."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(code), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    command = [sys.executable, "-m", "raysweep", "tune", str(spec), *(a for s in sets for a in ("--set", s))]
    t0 = time.monotonic()
    with open(folder / "out.txt", "w") as out:
        rc = subprocess.run(command, cwd=folder, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    wall = time.monotonic() - t0
    if rc not in (0, 1):
        sys.exit(f"{label}: tune exited {rc}; see {folder / 'out.txt'}")
    return wall


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
        epoch_time = next(m.value for m in client.get_metric_history(r.info.run_id, "epoch_time_s") if m.step == first.step)
        startup = client.get_metric_history(r.info.run_id, "startup_s")
        trials[index] = {"status": r.info.status, "epochs": int(max(m.step for m in client.get_metric_history(
            r.info.run_id, "epoch"))), "first_step_s": (first.timestamp - r.info.start_time) / 1000 - epoch_time,
            "startup_s": startup[0].value if startup else None}
    gaps = [(b.info.start_time - a.info.end_time) / 1000 for a, b in zip(children, children[1:])]
    return {"trials": trials, "gaps": gaps, "best": parent.data.tags.get("best_trial_id", "?").rsplit("_", 1)[-1],
            "busy": parent.data.metrics.get("busy_share")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default=BEFORE_WARM_GROUPS, help="the commit to compare with")
    parser.add_argument("--spec", default=str(ROOT / "search_spaces" / "quickstart.yaml"))
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    spec = Path(args.spec).resolve()
    with tempfile.TemporaryDirectory(prefix="warm-groups-") as tmp:
        tmp = Path(tmp)
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
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base_code)], capture_output=True)
            shutil.rmtree(base_code, ignore_errors=True)
    (base_label, (base_wall, base)), (warm_label, (warm_wall, warm)) = results.items()
    print(f"\n{'trial':<6} {'status (per-trial / warm)':<28} {'epochs':<8} {'start → first step, s':<24} warm startup_s")
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
    print(f"RESULT warm_groups wall_ratio={base_wall / warm_wall:.2f} first_step_s={after_first(warm):.1f} "
          f"base_first_step_s={after_first(base):.1f} gap_s={statistics.median(warm['gaps']):.1f} "
          f"base_gap_s={statistics.median(base['gaps']):.1f} same_trials_pruned={int(same)} "
          f"same_best={int(base['best'] == warm['best'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
