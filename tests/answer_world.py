"""A made-up sweep in a world that is *not* the LR fit's own model (raysweep/answer/): the best LR moves with the
budget (2× higher early than at the end), the bowl is asymmetric with a divergence cliff, the sweep runs under a
time budget whose trials end below ASHA's max_t, ASHA promotes on noisy values, and the clock of the budget counts
evaluation that the throughput does not. The best LR grows as B^EXPONENT (√B) unless a world is made with another
exponent. tests/test_answer_world.py holds the answer to it; tests/test_confirm_fitted.py, tests/test_report_reuse.py,
benchmarks/report_rebuild.py and benchmarks/fit_worlds.py use it too."""

from __future__ import annotations

import math

import numpy as np

from raysweep.metrics import TAG_BASELINE, RunRecord, SweepRecord, run_ending

SPEC = """name: w
scaling: {num_workers: 2, use_gpu: false, cpus_per_worker: 1}
train: {epochs: 500, time_budget_s: 20, reference_batch_size: 64, lr_rule: sqrt, min_lr: 1.0e-6}
search:
  per_gpu_batch_size: {choice: [16, 32, 64, 128], default: 32}
  base_lr: {loguniform: [1.0e-4, 1.0e-2], default: 1.0e-3}
  warmup_epochs: 1
  weight_decay: {loguniform: [1.0e-5, 1.0e-2], default: 1.0e-4}
tune:
  num_samples: 60
  metric: val_loss
  asha: {grace_period: 2, reduction_factor: 3, unit: seconds}
"""
TRAIN_SIZE, BUDGET_S, EVAL_SHARE = 4096, 20.0, 0.1  # train_seconds = training seconds × (1 + EVAL_SHARE)
CLIFF = math.log(5.0)  # a peak LR 5× past the final best diverges
EXPONENT = 0.5  # the best LR grows as B^EXPONENT: the square-root rule's world


def final_best(batch: float, exponent: float = EXPONENT) -> float:
    """The world's best peak LR at the end of the budget: 1e-3 at global batch 64, growing as B^exponent (√B)."""
    return 1e-3 * (batch / 64) ** exponent


def best_at(batch: float, progress: float, exponent: float = EXPONENT) -> float:
    """The best peak LR after `progress` (0 to 1) of the budget: 2× the final one at the start."""
    return final_best(batch, exponent) * 2 ** (1 - progress)


def value(batch: float, lr: float, progress: float, steeper: float = 3.0, exponent: float = EXPONENT) -> float:
    """A bowl in log LR, `steeper` times steeper above the best than below, better with training."""
    d = math.log(lr / best_at(batch, progress, exponent))
    return 0.2 + 0.3 / (1 + 5 * progress) + 0.01 * math.log2(batch / 32) + 0.05 * (1 if d < 0 else steeper) * d * d


def rate(batch: float) -> float:
    """Training samples/s (metrics' samples_per_s: training alone)."""
    return 200.0 * batch ** 0.5


def in_warmup(peak: float) -> float:
    """A value read at the end of the first epoch, its warmup: the LR has only just reached its peak, and the
    larger the peak the further training got (answer_check's CPU task: its first rung's values fall with the LR)."""
    return 0.45 - 0.03 * math.log(peak / 1e-3)


def _trial(i, per_gpu, base_lr, wd, rng, steeper=3.0, budget_s=BUDGET_S, warmup: bool = False,
           exponent: float = EXPONENT) -> dict:
    """A trial's whole course under the budget, before ASHA cuts it: every epoch's report. `budget_s` changes the
    clock alone (the throughput with it): the same epochs in fewer seconds; `warmup`: its first epoch's value is
    in_warmup's."""
    batch = 2 * per_gpu
    peak = base_lr * (batch / 64) ** 0.5
    steps = TRAIN_SIZE // batch
    speed = BUDGET_S / budget_s
    epoch_s = steps * batch / (rate(batch) * speed) * (1 + EVAL_SHARE)
    resolved = int(budget_s // epoch_s)
    own = 0.003 * rng.standard_normal()
    reports = []
    for e in range(1, resolved + 1):
        t = e * epoch_s
        diverged = math.log(peak / final_best(batch, exponent)) > CLIFF
        read = in_warmup(peak) if warmup and e == 1 else value(batch, peak, t / budget_s, steeper, exponent) + own
        reports.append({"epoch": float(e), "train_seconds": t, "samples_seen": float(e * steps * batch),
                        "samples_per_s": rate(batch) * speed, "grad_noise_scale": 400.0,
                        "val_loss": math.nan if diverged else read + 0.003 * rng.standard_normal()})
        if diverged:
            break
    return {"i": i, "per_gpu": per_gpu, "base_lr": base_lr, "wd": wd, "peak": peak, "batch": batch,
            "resolved": resolved, "reports": reports}


def _asha(courses: list[dict], rungs=(2.0, 6.0, 18.0), keep=1 / 3) -> dict[int, int]:
    """How many reports each trial makes under ASHA (synchronous halving on the noisy values at each rung)."""
    alive = {c["i"]: len(c["reports"]) for c in courses}
    for rung in rungs:
        at = {}
        for c in courses:
            if c["i"] not in alive:
                continue
            first = next((n for n, r in enumerate(c["reports"]) if r["train_seconds"] >= rung), None)
            if first is None or first >= alive[c["i"]]:
                continue
            at[c["i"]] = (c["reports"][first]["val_loss"], first)
        ranked = sorted((v for v in at.items() if not math.isnan(v[1][0])), key=lambda kv: kv[1][0])
        survivors = {i for i, _ in ranked[: max(1, math.ceil(len(ranked) * keep))]}
        for i, (_, first) in at.items():
            if i not in survivors:
                alive[i] = min(alive[i], first + 1)
    return alive


def _record(c: dict, reports: int) -> RunRecord:
    rows = c["reports"][:reports]
    diverged = math.isnan(rows[-1]["val_loss"])
    history = {k: {int(r["epoch"]): r[k] for r in rows if not (k == "val_loss" and math.isnan(r[k]))}
               for k in rows[0]}
    status = "failed" if diverged else "finished" if reports == c["resolved"] else "pruned"
    params = {"per_gpu_batch_size": str(c["per_gpu"]), "world_size": "2", "grad_accum_steps": "1",
              "global_batch_size": str(c["batch"]), "base_lr": str(c["base_lr"]), "peak_lr": str(c["peak"]),
              "lr_rule": "sqrt", "reference_batch_size": "64", "warmup_epochs": "1.0", "weight_decay": str(c["wd"]),
              "train_size": str(TRAIN_SIZE), "resolved_epochs": str(c["resolved"]), "seed": "0"}
    tags = {"trial_id": f"t{c['i']}", **run_ending(status, reports, "diverged" if diverged else None,
                                                   "loss is nan" if diverged else None).tags}
    return RunRecord(f"run{c['i']}", f"t{c['i']}", status, params, history, tags, 20.0, c["i"] == 0)


def world(n: int = 60, seed: int = 0, batches=(16, 32, 64, 128), spec: str = SPEC, steeper: float = 3.0,
          budget_s: float = BUDGET_S, warmup: bool = False, exponent: float = EXPONENT) -> SweepRecord:
    """n trials of random batch, LR (over 2.5 decades, so some diverge) and decay, cut by ASHA on noisy values.
    `budget_s`: the same courses on a faster clock, for a spec whose time budget and ASHA rungs are that much
    shorter (tests/test_confirm_fitted.py: a spec a confirmation trains for real); `exponent`: the best LR grows as
    B^exponent."""
    rng = np.random.default_rng(seed)
    draws = [(int(rng.choice(batches)), float(np.exp(rng.uniform(math.log(1e-4), math.log(1e-2)))),
              float(np.exp(rng.uniform(math.log(1e-5), math.log(1e-2))))) for _ in range(n)]
    courses = [_trial(i, *d, rng, steeper, budget_s, warmup, exponent) for i, d in enumerate(draws)]
    cut = _asha(courses, rungs=tuple(r * budget_s / BUDGET_S for r in (2.0, 6.0, 18.0)))
    return SweepRecord("sqlite:///mlflow.db", "w", "1", "parent", "w 2026-11-28", "val_loss", "min", spec,
                       [_record(c, cut[c["i"]]) for c in courses])


STATUS = {"finished": "FINISHED", "pruned": "KILLED", "failed": "FAILED"}


def write_world(record: SweepRecord, uri: str, artifacts: str) -> str:
    """The made-up sweep in an MLflow store as `tune` leaves one: a parent run tagged raysweep.kind=tune with its
    spec.yaml, a child run per trial with its params, its per-epoch metrics and its ending."""
    from mlflow import MlflowClient
    from mlflow.entities import Metric, Param

    client = MlflowClient(uri)
    experiment = client.create_experiment(record.experiment, artifact_location=artifacts)
    parent = client.create_run(experiment, run_name=record.parent_name, tags={
        "raysweep.kind": "tune", "raysweep.metric": record.metric, "raysweep.mode": record.mode}).info.run_id
    client.log_text(parent, record.spec_text, "spec.yaml")
    for t in record.trials:
        tags = {"mlflow.parentRunId": parent, **t.tags, **({TAG_BASELINE: "true"} if t.baseline else {})}
        run = client.create_run(experiment, run_name=t.trial_id, tags=tags).info.run_id
        metrics = [Metric(name, value, 0, step) for name, steps in t.history.items() for step, value in steps.items()]
        client.log_batch(run, metrics=metrics, params=[Param(k, v) for k, v in t.params.items()])
        client.set_terminated(run, STATUS[t.status])
    client.set_terminated(parent, "FINISHED")
    return parent


def answer_to(record):
    """The answer to a made-up sweep, as `raysweep answer` reads it."""
    from raysweep.answer import answer_of
    from raysweep.report import recommendation

    return answer_of(record, "w.yaml", recommendation(record))


def predict_at(record, batch):
    """The recipe for global batch `batch`, as `raysweep answer --batch` predicts it."""
    from raysweep.answer import predict
    from raysweep.report import recommendation

    return predict(record, batch, "w.yaml", recommendation(record))


def left_out_clauses(exponent: float, seed: int, searched=(16, 32, 64), left_out: int = 256) -> dict[str, bool]:
    """A made-up sweep over per-GPU `searched` (two workers) in the B^exponent world, and which of
    benchmarks/answer_check.py's clauses its prediction at global batch `left_out` meets against the world's best LR
    there: `within` 1.25×, `beats_rules` (closer than keeping the answer's LR and than the square-root rule from it),
    `nearest` (as near as the nearest of those and the fit's own exponent, used or not); `fit_used` (the check chose
    the fit) and `fit_own_within` (the fit's own exponent's LR within 1.25×); `fit_bottom_low`: the fit's bottom at
    the answer's batch below the world's best there by more than 1.1× (the asymmetric bowl pulls it to the flat
    side)."""
    from raysweep.answer.fit import scaled

    record = world(seed=seed, batches=searched, exponent=exponent)
    answer = answer_to(record)
    r, fit = answer.recipe, answer.lr_fit
    predicted = predict_at(record, left_out).recipe.peak_lr
    truth = final_best(left_out, exponent)

    def off(lr: float) -> float:
        return abs(math.log(lr / truth))

    keep, sqrt_rule = r.peak_lr, r.peak_lr * (left_out / r.global_batch) ** 0.5
    own = (scaled(r.peak_lr, r.global_batch, left_out, fit.exponent, fit.b_noise) if fit.exponent is not None
           else None)  # the fit's own exponent, as a prediction moves the answer's LR (held past B_noise)
    return {"within": off(predicted) <= math.log(1.25),
            "beats_rules": off(predicted) < min(off(keep), off(sqrt_rule)),
            "nearest": off(predicted) <= min(off(x) for x in (keep, sqrt_rule, own) if x is not None) + 1e-12,
            "fit_used": bool(fit.check and fit.check.used == "fit"),
            "fit_own_within": own is not None and off(own) <= math.log(1.25),
            "fit_bottom_low": fit.fitted and fit.optimum(r.global_batch) < final_best(r.global_batch, exponent) / 1.1}
