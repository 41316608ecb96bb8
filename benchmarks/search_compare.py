"""Random search against TPE (tune.search) on the same problem at the same trial budget, several seeds each, side
by side in one run: the best metric after N trials (median and spread over the seeds) and the trials TPE took to
reach the random search's final best of the same seed. Two bests, each over the trials in start order:

- finished: the best final value of the trials that ran to ASHA's max_t (a pruned trial's last value is a
  lower-budget one), what a user takes home; when ASHA lets few trials finish, this rarely moves;
- at the first rung: the best value any trial (finished or pruned) had at its first report at or past ASHA's first
  rung, the budget every trial gets: what the search found, read where ASHA judges it.

    python benchmarks/search_compare.py                                  # quickstart, 12 trials, seeds 0 1 2
    python benchmarks/search_compare.py --trials 16 --seeds 0 1 2 3 4 --spec search_spaces/quickstart.yaml

Every sweep is `raysweep tune SPEC --set tune.search=... --set tune.seed=... --set tune.num_samples=N`, run in this
process on one local Ray, in a folder of its own (its MLflow store, its results; its console output in out.txt).
The two searches alternate within each seed, so a machine that slows down mid-run slows both alike. Figures come
from each sweep's store (tracking.load_sweep): a trial counts toward "best" only when it finished (ran to ASHA's
max_t): a pruned trial's value is a lower-budget one. "Trials to random's best" is the first trial, in start
order, after which the best finished value is at least as good as random's best after N trials ("-": never).
Prints one RESULT line.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from raysweep.cli import main  # noqa: E402
from raysweep.metrics import FINISHED, PRUNED  # noqa: E402
from raysweep.report.importance import time_attr, value_at  # noqa: E402
from raysweep.search import startup_trials  # noqa: E402

SEARCHES = ("random", "tpe")


def run_sweep(spec: Path, search: str, seed: int, trials: int, folder: Path, sets: list[str]):
    """One sweep in `folder`; returns (its record from the store, wall seconds)."""
    from raysweep.config import load_config
    from raysweep.tracking import load_sweep

    folder.mkdir(parents=True)
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    args = [f"tune.search={search}", f"tune.seed={seed}", f"tune.num_samples={trials}",
            f"storage_path={folder / 'results'}", f"mlflow.tracking_uri={uri}", *sets]
    t0 = time.monotonic()
    with open(folder / "out.txt", "w") as out, contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        rc = main(["tune", str(spec), *(a for s in args for a in ("--set", s))])
    wall = time.monotonic() - t0
    if rc != 0:
        sys.exit(f"{search} seed {seed}: tune exited {rc}; see {folder / 'out.txt'}")
    config = load_config(spec, args, sweep=False)
    return load_sweep(uri, config.experiment_name), wall


def best_so_far(record, first_rung: float | None = None) -> list[float | None]:
    """After each trial (start order): the best final value among the finished trials so far, or (`first_rung`)
    the best value at the first rung among the finished and pruned ones (None: none yet)."""
    sign = -1.0 if record.mode == "max" else 1.0
    clock = time_attr(record.spec_text)
    best, out = None, []
    for t in record.trials:
        if first_rung is None:
            value = t.last(record.metric) if t.status == FINISHED else None
        else:
            value = value_at(t, record.metric, clock, first_rung) if t.status in (FINISHED, PRUNED) else None
        if value is not None and (best is None or sign * value < sign * best):
            best = value
        out.append(best)
    return out


def trials_to(curve: list[float | None], target: float, mode: str) -> int | None:
    """The first trial (1-based) after which `curve` is at least as good as `target`."""
    for i, value in enumerate(curve, 1):
        if value is not None and (value >= target if mode == "max" else value <= target):
            return i
    return None


def main_benchmark() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", default=str(ROOT / "search_spaces" / "quickstart.yaml"))
    parser.add_argument("--trials", type=int, default=12)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--set", dest="sets", action="append", default=[], help="more --set overrides for every sweep")
    parser.add_argument("--searches", nargs="+", default=list(SEARCHES), choices=SEARCHES)
    args = parser.parse_args()

    import ray

    from raysweep.cluster import ray_init_kwargs
    from raysweep.config import load_config

    ray.init(**ray_init_kwargs(60.0))
    rung = float(load_config(args.spec, args.sets).tune.asha.grace_period)  # ASHA's first rung, in its unit
    kinds = {"finished": None, "first rung": rung}
    curves: dict = {}
    failed_late: dict = {}  # (search, seed) → trials drawn after the start-up ones that failed (oom, diverged, …)
    fastest: dict = {}  # (search, seed) → the fastest time to tune.target (None: no target, or none reached it)
    with tempfile.TemporaryDirectory(prefix="search_compare-") as tmp:
        for seed in args.seeds:
            for search in args.searches:
                record, wall = run_sweep(Path(args.spec), search, seed, args.trials, Path(tmp) / f"{search}-{seed}",
                                         args.sets)
                counts = {s: sum(t.status == s for t in record.trials) for s in ("finished", "pruned", "failed")}
                print(f"{search:6} seed {seed}: {args.trials} trials ({counts['finished']} finished, "
                      f"{counts['pruned']} pruned, {counts['failed']} failed) in {wall:.0f} s", flush=True)
                late = record.trials[startup_trials(args.trials):]  # what TPE drew from its model
                kinds_failed = [t.failure for t in late if t.status == "failed"]
                reached = [t.last("time_to_target_s") for t in record.trials if t.last("time_to_target_s") is not None]
                print(f"    after the {startup_trials(args.trials)} start-up trials: {len(late)} drawn, "
                      f"{len(kinds_failed)} failed ({', '.join(sorted(map(str, kinds_failed))) or 'none'})"
                      + (f"; target reached by {len(reached)} of {len(record.trials)}, fastest "
                         f"{min(reached):.1f} s" if record.target else ""), flush=True)
                failed_late[search, seed] = len(kinds_failed)
                fastest[search, seed] = min(reached) if reached else None
                for kind, at in kinds.items():
                    curve = best_so_far(record, at)
                    curves[kind, search, seed] = (curve, wall)
                    print(f"    best {record.metric} ({kind}) after each trial: "
                          f"{' '.join(f'{v:.3f}' if v is not None else '-' for v in curve)}", flush=True)
                mode, metric = record.mode, record.metric
    ray.shutdown()

    result = [f"RESULT search_compare trials={args.trials} seeds={len(args.seeds)} metric={metric}"]
    for search in args.searches:
        result.append(f"{search}_failed_after_startup={sum(failed_late[search, seed] for seed in args.seeds)}")
        times = [fastest[search, seed] for seed in args.seeds if fastest[search, seed] is not None]
        if times:
            result.append(f"{search}_fastest_to_target_median={statistics.median(times):.1f}")
    for kind in kinds:
        print(f"\n{metric} ({kind}) after {args.trials} trials, seeds {args.seeds}:")
        for search in args.searches:
            finals = [curves[kind, search, seed][0][-1] for seed in args.seeds]
            finals = [v for v in finals if v is not None]
            walls = [curves[kind, search, seed][1] for seed in args.seeds]
            base = "random" if "random" in args.searches else search
            reach = [trials_to(curves[kind, search, seed][0], curves[kind, base, seed][0][-1], mode)
                     if curves[kind, base, seed][0][-1] is not None else None for seed in args.seeds]
            median = statistics.median(finals) if finals else float("nan")
            print(f"  {search:6}: median {median:.4f} (range {min(finals, default=math.nan):.4f}-"
                  f"{max(finals, default=math.nan):.4f}); trials to random's best, per seed: "
                  f"{' '.join(str(r) if r else '-' for r in reach)}; median sweep {statistics.median(walls):.0f} s")
            tag = kind.replace(" ", "_")
            result.append(f"{search}_{tag}_median={median:.4f}")
            if search == "tpe":
                reached = [r for r in reach if r]
                result.append(f"tpe_{tag}_reached_random_best={len(reached)}/{len(reach)}")
                result.append(f"tpe_{tag}_trials_to_it_median={statistics.median(reached) if reached else '-'}")
    print(" ".join(result))


if __name__ == "__main__":
    main_benchmark()
