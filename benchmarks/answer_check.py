"""The sweep's answer checked against ground truth: a grid of global batch × peak LR, each trained for the same
training seconds on two seeds near each batch's optimum, then an ordinary sweep (ASHA in seconds) and its
confirmation on the same task.

    python benchmarks/answer_check.py            # CPU: 64×24 captchas, 4 batches, 20 s a run, ~40 min on 2 cores
    python benchmarks/answer_check.py --gpu      # one GPU: 50,000 at 160×60, bf16
    python benchmarks/answer_check.py --quick    # the code path in about two minutes (CI): the sweep fits its LR
    python benchmarks/answer_check.py --trials 32 --keep /tmp/ac   # a larger sweep; its store kept to read back
    python benchmarks/answer_check.py --grid /tmp/ac.json --sweep-seed 1   # another sweep, an earlier --out's grid

The ground truth is benchmarks/answer_grid.py's grid (its docstring: the cells, the seeds, the left-out
batch's window and how its best LR is resampled over the seeds); a goal is met (missed) where it holds in 90 % of
those resamples, else undecided. The sweep is `python -m raysweep tune SPEC --confirm` in a fresh folder:
the same task, its search over the grid's batches but one (left out) and the grid's LR range, its answer and
confirmation as any user gets them. Reported, as RESULT lines, with the goal each is held to:

- the answer's value (the confirmation's mean over two seeds) against the grid's best seed-mean (goal: within 5 %),
  and the grid's seed-mean at the answer's batch and nearest LR;
- the predicted peak LR for the batch the sweep left out (`raysweep answer SPEC --batch N`) against that batch's
  best grid LR (goal: within 1.25×, and closer than both trivial predictors: keeping the answer's LR, and the
  square-root rule from it; in 90 % of the resamples of the window's seeds, and the argmin's ratio beside it), and
  the goal's clauses apart (`left_out_clauses`), with the fit's own exponent's LR beside the rules' whether the
  check used it or not: where the check picks a rule, the prediction is that rule and cannot beat it;
- the prediction's expected value against its own confirmation at the left-out batch (goal: within 10 %; not in
  --quick);
- the grid's epochs beside the sweep's answer's (both fill the same seconds).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or loaded by path (tests): its sibling
from answer_grid import Earlier, Trainer, best_lr, grid, mean, resampled_bests  # noqa: E402

MODES = {  # the task, the grid and the sweep of each mode; `window`, `left_seeds`: the left-out batch's cells;
    # `grace`: ASHA's grace period as a share of the seconds (task_spec)
    "cpu": dict(width=64, height=24, train=4096, val=512, workers_cpus=2, gpu=False, precision="auto", seconds=20.0,
                batches=(32, 64, 128, 256), lrs=(2.5e-4, 5e-4, 1e-3, 2e-3, 4e-3, 8e-3), left_out=256, trials=16,
                seeds=(0, 1), window=5, left_seeds=tuple(range(8)), grace=1 / 3),
    "gpu": dict(width=160, height=60, train=50_000, val=5_000, workers_cpus=4, gpu=True, precision="bf16",
                seconds=10.0, batches=(256, 512, 1024, 2048), lrs=(1e-3, 2e-3, 4e-3, 8e-3), left_out=2048, trials=12,
                seeds=(0, 1), window=5, left_seeds=(0, 1, 2, 3), grace=1 / 3),
    "quick": dict(width=64, height=24, train=512, val=128, workers_cpus=1, gpu=False, precision="fp32", seconds=2.0,
                  batches=(16, 32, 64), lrs=(1e-3, 4e-3), left_out=64, trials=10, seeds=(0,), window=3,
                  left_seeds=(0,), grace=1 / 9),
}
DECIDED = 0.9  # a goal met (missed) in at least this share of the resamples is met (missed); between, undecided


def task_spec(mode: dict, work: Path) -> dict:
    """The task as a raysweep spec: one rank, a time budget, the LR given as the peak LR itself (lr_rule none), warmup
    and weight decay fixed (the grid is batch × LR alone); its search: the grid's batches but the left-out one. ASHA's
    first rung comes after the warmup (one epoch): at a ninth of the seconds (2.2 s, until 2026-12-02) it read every
    CPU trial inside its first epoch, pruned on values from before the LR peaked, and the fit could use 23-25 of 64
    trials (benchmarks/RESULTS.md). --quick keeps a ninth: its two seconds are the code path, not the fit's evidence."""
    searched = [b for b in mode["batches"] if b != mode["left_out"]]
    seconds = mode["seconds"]
    return {
        "name": "answer_check",
        "storage_path": str(work / "results"),
        "data": {"width": mode["width"], "height": mode["height"],
                 "synthetic": {"train_size": mode["train"], "val_size": mode["val"], "seed": 0}},
        "scaling": {"num_workers": 1, "use_gpu": mode["gpu"], "cpus_per_worker": mode["workers_cpus"]},
        "train": {"epochs": 10_000, "time_budget_s": seconds, "precision": mode["precision"], "lr_rule": "none",
                  "reference_batch_size": 256, "checkpoint_every": 10_000, "seed": 0},
        "search": {"per_gpu_batch_size": {"choice": searched, "default": searched[len(searched) // 2]},
                   "base_lr": {"loguniform": [min(mode["lrs"]), max(mode["lrs"])], "default": 1.0e-3},
                   "warmup_epochs": 1, "weight_decay": 1.0e-4},
        "tune": {"num_samples": mode["trials"], "metric": "val_loss", "seed": 0,
                 "asha": {"unit": "seconds", "grace_period": round(seconds * mode["grace"], 3), "reduction_factor": 3}},
        "mlflow": {"tracking_uri": f"sqlite:///{work / 'mlflow.db'}"},
    }



def ln_off(x: float, best: float) -> float:
    """How far an LR lies from a best LR: |ln(x / best)|."""
    return abs(math.log(x / best))


def left_out_goal(predicted: float, keep: float, sqrt_rule: float, bests: list[float]) -> tuple[float, str]:
    """The share of the resampled best LRs the prediction meets the goal against (within 1.25×, and closer than both
    trivial predictors), and the verdict: met or missed in DECIDED of them, else undecided."""
    held = [ln_off(predicted, b) <= math.log(1.25) and ln_off(predicted, b) < min(ln_off(keep, b), ln_off(sqrt_rule, b))
            for b in bests]
    share = sum(held) / len(held)
    return share, "met" if share >= DECIDED else "missed" if share <= 1 - DECIDED else "undecided"


def left_out_clauses(predicted: float, rules: dict[str, float], bests: list[float]) -> dict[str, float]:
    """The goal's clauses apart, each as the share of the resampled best LRs it holds in: `within` (1.25×),
    `beats_rules` (closer than both trivial predictors) and `chose_nearest` (the prediction is as near as the nearest
    of `rules`: the trivial predictors and the fit's own exponent, used or not). Where the sweep's check picks a rule
    the prediction is that rule, so `beats_rules` is 0 however near it lies: `within` and `chose_nearest` say
    whether the check chose well."""
    trivial = [rules[k] for k in ("keep", "sqrt")]
    return {"within": sum(ln_off(predicted, b) <= math.log(1.25) for b in bests) / len(bests),
            "beats_rules": sum(ln_off(predicted, b) < min(ln_off(x, b) for x in trivial) for b in bests) / len(bests),
            "chose_nearest": sum(ln_off(predicted, b) <= min(ln_off(x, b) for x in rules.values()) + 1e-12
                                 for b in bests) / len(bests)}


def arguments() -> tuple[argparse.Namespace, dict]:
    """The command line, and the mode it selects with its overrides."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the code path only: 3 batches, 10 trials of 2 s, a fit")
    parser.add_argument("--gpu", action="store_true", help="one GPU: 50,000 images at 160×60, bf16")
    parser.add_argument("--seconds", type=float, default=None, help="training seconds per run (default: the mode's)")
    parser.add_argument("--trials", type=int, default=None, help="the sweep's trials (default: the mode's)")
    parser.add_argument("--grace", type=float, default=None,
                        help="ASHA's grace period as a share of the seconds (default: the mode's; 0.111 before "
                             "2026-12-02)")
    parser.add_argument("--keep", default=None, help="work in this new folder and keep it (the store)")
    parser.add_argument("--out", default=None, help="write the figures as JSON here too")
    parser.add_argument("--grid", default=None, help="the grid of an earlier run's --out on this machine, not rerun: "
                                                     "another sweep against the same ground truth")
    parser.add_argument("--sweep-seed", type=int, default=0, help="the sweep's tune.seed (its draws; default 0)")
    args = parser.parse_args()
    args.mode_name = "quick" if args.quick else "gpu" if args.gpu else "cpu"
    mode = dict(MODES[args.mode_name])
    for key in ("seconds", "trials", "grace"):
        if getattr(args, key):
            mode[key] = getattr(args, key)
    return args, mode


def raysweep(work: Path, *argv: str, timeout: int = 3600) -> subprocess.CompletedProcess:
    """`python -m raysweep ARGV` in the work folder, as a user runs it there; its stdout printed (the tail)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    done = subprocess.run([sys.executable, "-m", "raysweep", *argv], cwd=work, env=env, capture_output=True,
                          text=True, timeout=timeout)
    print(done.stdout[-6000:], flush=True)
    if done.returncode != 0:
        print(done.stderr[-3000:], file=sys.stderr)
    return done


def sweep_and_predict(work: Path, mode: dict, quick: bool) -> tuple[dict, str, tuple | None] | None:
    """The sweep (`tune --confirm`; --quick: no confirmation, the quickstart's test runs one already), its
    answer.json, `answer --batch` for the left-out batch and, but in --quick, that prediction's confirmation (its
    mean and expected value). None where a command failed."""
    spec = str(work / "spec.yaml")
    left = str(mode["left_out"])
    if raysweep(work, "tune", spec, *([] if quick else ["--confirm"]), "--progress-every", "600").returncode:
        return None
    answer = json.loads((work / "results" / "answer_check" / "report" / "answer.json").read_text())
    predicted = raysweep(work, "answer", spec, "--batch", left, timeout=600)
    if predicted.returncode:
        return None
    left_confirmed = None
    if not quick:
        run = raysweep(work, "confirm", spec, "--batch", left, "--progress-every", "600")
        found = re.search(r"; mean (\S+) against (\S+) expected", run.stdout)
        left_confirmed = (float(found.group(1)), float(found.group(2))) if found else None
    return answer, predicted.stdout, left_confirmed


def main() -> int:
    args, mode = arguments()
    import yaml

    from raysweep.config import load_config

    started = time.monotonic()
    if args.keep:
        Path(args.keep).mkdir(parents=True, exist_ok=False)  # a fresh folder: never a store of an earlier run
    with (contextlib.nullcontext(args.keep) if args.keep else tempfile.TemporaryDirectory(prefix="answer-check-")
          ) as tmp:
        work = Path(tmp).resolve()
        spec = task_spec(mode, work)
        spec["tune"]["seed"] = args.sweep_seed
        (work / "spec.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
        if args.grid:
            trainer, truth = Earlier.load(args.grid)
        else:
            trainer = Trainer(load_config(work / "spec.yaml"), mode)
            truth = grid(trainer, mode)
        grid_s = time.monotonic() - started
        ran = sweep_and_predict(work, mode, args.quick)
    if ran is None:
        return 1
    figures = report(mode, truth, trainer, *ran)
    figures.update(grid_s=grid_s, total_s=time.monotonic() - started, trials=mode["trials"], mode=args.mode_name,
                   sweep_seed=args.sweep_seed, grid_from=args.grid,
                   grace_period_s=spec["tune"]["asha"]["grace_period"])
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=1))
    return 0


def report(mode: dict, truth: dict, trainer: Trainer, answer: dict, predicted: str, left_confirmed) -> dict:
    """The figures against the grid, printed as RESULT lines with their goals (the module's docstring)."""
    figures = figures_of(mode, truth, trainer, answer, predicted, left_confirmed)
    print_context(figures, mode, trainer)
    print_results(figures)
    return figures


def figures_of(mode: dict, truth: dict, trainer: Trainer, answer: dict, predicted: str, left_confirmed) -> dict:
    """What the sweep's answer and prediction were, and what the grid says of them (the --out JSON)."""
    seeds = len(mode["seeds"])
    means = {k: mean(v) for k, v in truth.items()}
    full = {k: m for k, m in means.items() if len(truth[k]) >= seeds}  # the cells measured on every seed
    best_at = min(full, key=full.get)
    spreads = [max(v) / min(v) for v in truth.values() if len(v) > 1 and all(map(math.isfinite, v))]
    batch, lr = answer["global_batch"], answer["peak_lr"]
    nearest = min((k for k in means if k[0] == batch), key=lambda k: abs(math.log(k[1] / lr)), default=None)
    confirmed = (answer.get("confirmed") or {}).get("measured", {}).get("value")
    argmin, vertex = best_lr({k[1]: means[k] for k in means if k[0] == mode["left_out"]})
    most = max(len(v) for k, v in truth.items() if k[0] == mode["left_out"])  # its window: every left-out seed
    cells = {k[1]: v for k, v in truth.items() if k[0] == mode["left_out"] and len(v) == most}
    bests = resampled_bests(cells)
    low, high = (sorted(bests)[round(q * (len(bests) - 1))] for q in (0.05, 0.95))
    lr_left = float(re.search(r"peak LR (\S+),", predicted).group(1))
    # the rules at the precision `answer --batch` prints (3 figures), as the prediction is read: the keep rule's own
    # prediction is then the keep rule, never nearer than it by a rounding
    keep, sqrt_rule = (float(f"{x:.2e}") for x in (lr, lr * (mode["left_out"] / batch) ** 0.5))
    share, verdict = left_out_goal(lr_left, keep, sqrt_rule, bests)
    exponent = answer["lr_fit"]["exponent"]  # the fit's own, used or not (no B_noise cap: the noise scale is far past)
    fit_lr = float(f"{lr * (mode['left_out'] / batch) ** exponent:.2e}") if exponent is not None else None
    best_trial = next(t for t in answer["trials"] if t["role"] == "the answer")
    return {
        "grid_best_seed_mean": full[best_at], "grid_best_batch": best_at[0], "grid_best_lr": best_at[1],
        "grid_seeds": seeds, "grid_seed_spread_max": max(spreads, default=None), "answer_batch": batch,
        "answer_peak_lr": lr, "answer_trial_val_loss": answer["expected"]["value"],
        "answer_confirmed_val_loss": confirmed, "answer_grid_lr": nearest[1] if nearest else None,
        "answer_grid_seed_mean": means.get(nearest) if nearest else None, "lr_fit": answer["lr_fit"],
        "left_out_batch": mode["left_out"], "left_out_predicted_lr": lr_left, "left_out_keep_lr": keep,
        "left_out_sqrt_lr": sqrt_rule, "left_out_grid_argmin_lr": argmin, "left_out_grid_vertex_lr": vertex,
        "left_out_grid_best_lr": bests[0], "left_out_grid_best_interval": [low, high],
        "left_out_resamples": len(bests) - 1, "left_out_window_cells": len(cells),
        "left_out_goal_share": share, "left_out_goal": verdict, "left_out_seeds": most,
        "left_out_fit_lr": fit_lr, "left_out_clauses": left_out_clauses(
            lr_left, {"keep": keep, "sqrt": sqrt_rule, **({"fit": fit_lr} if fit_lr else {})}, bests),
        "left_out_confirmed": left_confirmed,
        "grid_epochs": {f"{b} {x!r}": e for (b, x), e in trainer.epochs.items()}, "grid_batch_epochs": trainer.fixed,
        "answer_epochs": answer.get("resolved_epochs"), "answer_trial_epoch": best_trial.get("epoch"),
        "grid": {f"{b} {x!r}": v for (b, x), v in sorted(truth.items())},
    }


def print_context(f: dict, mode: dict, trainer: Trainer) -> None:
    """The grid's best, the answer, the epochs, the fit and the left-out batch's LRs, in words."""
    batch, fit = f["answer_batch"], f["lr_fit"]
    confirmed, at_grid = f["answer_confirmed_val_loss"], f["answer_grid_seed_mean"]
    low, high = f["left_out_grid_best_interval"]
    epochs_at = sorted({e for (b, _), e in trainer.epochs.items() if b == batch})
    print(f"\ngrid: best seed-mean val_loss {f['grid_best_seed_mean']:.4f} at batch {f['grid_best_batch']}, peak LR "
          f"{f['grid_best_lr']:.2e} ({f['grid_seeds']} seed(s) a cell near each optimum; the largest spread between "
          f"seeds {f['grid_seed_spread_max'] or 1:.4f}×)")
    print(f"answer: batch {batch}, peak LR {f['answer_peak_lr']:.2e}: its trial {f['answer_trial_val_loss']:.4f}, "
          f"confirmed {confirmed if confirmed is None else f'{confirmed:.4f}'}; the grid at batch {batch}, LR "
          f"{f['answer_grid_lr'] or float('nan'):.2e}: {at_grid or float('nan'):.4f}")
    print(f"epochs: the grid's runs at batch {batch} held {epochs_at} epochs in {mode['seconds']:g} s; the answer "
          f"resolved {f['answer_epochs']}")
    print(f"LR fit: {fit['supports']}, exponent {fit['exponent']}, check {fit.get('check')} ({fit['reason']})")
    print(f"left-out batch {f['left_out_batch']}: predicted peak LR {f['left_out_predicted_lr']:.2e}; keeping the "
          f"answer's {f['left_out_keep_lr']:.2e}; the square-root rule {f['left_out_sqrt_lr']:.2e}; the grid's best "
          f"{f['left_out_grid_best_lr']:.2e} (the bowl through its {f['left_out_window_cells']} window cells on "
          f"{f['left_out_seeds']} seeds; 90 % of {f['left_out_resamples']} resamples of the seeds {low:.2e} to "
          f"{high:.2e}), {f['left_out_grid_argmin_lr']:.2e} (argmin), {f['left_out_grid_vertex_lr']:.2e} (parabola "
          f"through the argmin)")


def print_results(f: dict) -> None:
    """The RESULT lines: each ratio against the grid, with its goal where it has one."""
    confirmed, best_value = f["answer_confirmed_val_loss"], f["grid_best_seed_mean"]
    measured = confirmed if confirmed is not None else f["answer_trial_val_loss"]
    best, argmin, vertex = f["left_out_grid_best_lr"], f["left_out_grid_argmin_lr"], f["left_out_grid_vertex_lr"]
    lr_left, clauses, fit_lr = f["left_out_predicted_lr"], f["left_out_clauses"], f["left_out_fit_lr"]

    def ratio(x: float, truth: float) -> float:
        return max(x / truth, truth / x)

    value = measured / best_value
    print(f"RESULT answer_vs_grid_best ratio={value:.4f} goal=1.05 {'met' if value <= 1.05 else 'missed'}")
    if f["answer_grid_seed_mean"] is not None:
        print(f"RESULT answer_grid_point_vs_grid_best ratio={f['answer_grid_seed_mean'] / best_value:.4f}")
    print(f"RESULT left_out_lr_vs_grid_best ratio={ratio(lr_left, best):.4f} goal=1.25 {f['left_out_goal']} "
          f"resamples_met={f['left_out_goal_share']:.3f}")
    print(f"RESULT left_out_lr_within_1.25 resamples={clauses['within']:.3f} closer_than_both_rules="
          f"{clauses['beats_rules']:.3f} nearest_of_fit_and_rules={clauses['chose_nearest']:.3f}")
    if fit_lr:
        check = f["lr_fit"]["check"]
        print(f"RESULT left_out_fit_lr_vs_grid_best ratio={ratio(fit_lr, best):.4f} (the fit's own "
              f"B^{f['lr_fit']['exponent']:.2f}, {'used' if check and check['used'] == 'fit' else 'not used'})")
    for name, key in (("keep", "left_out_keep_lr"), ("sqrt", "left_out_sqrt_lr")):
        print(f"RESULT left_out_{name}_lr_vs_grid_best ratio={ratio(f[key], best):.4f}")
    for name, key in (("", "left_out_predicted_lr"), ("keep_", "left_out_keep_lr"), ("sqrt_", "left_out_sqrt_lr")):
        print(f"RESULT left_out_{name}lr_vs_grid_argmin ratio={ratio(f[key], argmin):.4f}")
    print(f"RESULT left_out_lr_vs_grid_vertex ratio={ratio(lr_left, vertex):.4f}")
    if f["left_out_confirmed"]:
        got, expected = f["left_out_confirmed"]
        print(f"RESULT left_out_confirmed_vs_expected ratio={got / expected:.4f} goal=1.10 "
              f"{'met' if abs(got / expected - 1) <= 0.10 else 'missed'}")


if __name__ == "__main__":
    sys.exit(main())
