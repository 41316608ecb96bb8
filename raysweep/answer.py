"""The sweep's one answer: the recipe to train with (global batch = per-GPU batch × workers × accumulation, peak LR,
warmup, weight decay and the schedule), the value it is expected to reach, the trials that support it, and the
command that confirms it. From the store alone (metrics.SweepRecord and the spec it logged): `tune`, `report` and
`confirm` build the same answer.

- **The answer is the sweep's best trial** by the sweep's own ranking (metrics.rank: the time to tune.target, then
  tune.metric), so it never contradicts the trials. It `ran` when that trial ran its whole budget (or reached the
  target); otherwise it is marked `predicted`: what it reaches at the full budget is not known yet.
- **The LR for a batch the sweep did not run** (`fit_lr`, `predict`): how the best peak LR grows with the global
  batch, fitted from the trials across batches. McCandlish et al. 2018 (arXiv 1812.06162, eq. 2.6): for SGD the
  best LR is ε_max / (1 + B_noise / B), linear in B well below B_noise and flat past it; for Adam it rises about as
  √B and peaks near B_noise, then falls (Malladi et al. 2022, arXiv 2205.10287; Li et al. 2024, arXiv 2405.14578).
  The fit: each trial's ranking metric at a budget many of them reached, as a bowl in log LR whose bottom moves
  with log B (one intercept per batch, so the batch's own effect on the metric is not read as the LR's):
      v ≈ a_B + c1·y + c2·y² + c3·x·y,   x = log B, y = log peak LR
  The best LR at batch B is where the bowl is lowest: y*(x) = −(c1 + c3·x) / (2·c2), so it grows as B^α with
  α = −c3 / (2·c2): 1 is the linear rule, ½ the square-root rule. The interval is a bootstrap over the trials.
  Past the measured B_noise the prediction holds the LR at B_noise's (it stops growing there; for Adam it falls).
  Without a fit (too few trials, one batch, no bowl in the searched LRs) the prediction scales the answer's LR by
  AdamW's square-root rule, and says so.
- **Weight decay** through AdamW's timescale τ = B / (η·λ·D) (the fraction of the run over which the weights are
  averaged; Wang & Aitchison 2024, arXiv 2405.13698; Bergsma et al. 2025, arXiv 2505.13738: at fixed data the best
  λ grows with B, τ stays): λ(B) = B / (η(B)·τ·D(B)), with τ the answer's and D the samples the run trains.
- **The expected value** of a predicted batch: the same value of the metric as the answer, after E(B)/E(B_answer)
  of its samples, E(B) = E_min (1 + B / B_noise) (McCandlish et al.), at that batch's measured throughput: the time
  to the target, or to the answer's value when the sweep has no target.
- **Confirmations** (`raysweep confirm`): the recipe run outside ASHA for its whole budget on two seeds; each run's
  measured value beside the predicted one (metrics.ConfirmationRecord, as the store holds it).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from raysweep.metrics import (
    FINISHED,
    MODEL_FACTORY,
    MODEL_KWARGS,
    MODEL_PARAMETERS,
    PRUNED,
    ConfirmationRecord,
    RunRecord,
    SweepRecord,
)
from raysweep.metrics import names as M
from raysweep.optim import LR_RULE_POWER

ANSWER_FILE = "answer.json"  # in the sweep's report folder (layout.REPORT), beside report.html
MIN_FIT_TRIALS = 8  # trials at one budget, across two global batches at least, for the LR fit
BOOTSTRAPS = 400  # resamples of the trials for the exponent's interval
INTERVAL = (0.05, 0.95)  # its quantiles: a 90 % interval
PRIOR_EXPONENT = 0.5  # AdamW's square-root rule (Malladi et al. 2022): where the sweep cannot fit one
RULES = {"linear": 1.0, "sqrt": 0.5, "none": 0.0}  # train.lr_rule's exponents: the rules a fit can support


# ---------------------------------------------------------------------------------------------
# The records


@dataclass(frozen=True)
class Recipe:
    """What to train with, whole: a trial's knobs and the spec's schedule, with the derived values spelled out."""

    global_batch: int  # per_gpu_batch_size × num_workers × grad_accum_steps
    per_gpu_batch_size: int
    num_workers: int
    grad_accum_steps: int
    peak_lr: float  # base_lr × (global_batch / reference_batch_size) ** p
    base_lr: float
    lr_rule: str
    reference_batch_size: int
    warmup_epochs: float
    weight_decay: float
    min_lr: float  # the cosine's floor
    epochs: int  # train.epochs: the most a run trains
    time_budget_s: float | None  # train.time_budget_s: training seconds (then `epochs` is the cap)
    precision: str
    grad_clip: float | None
    model: dict = field(default_factory=dict)  # the network it is for: factory, kwargs, parameters (model_of)

    @property
    def model_line(self) -> str:
        """`mynet:build(width=8), 20,812 trainable parameters`: which network the recipe is for."""
        m = self.model
        kwargs = ", ".join(f"{k}={v!r}" for k, v in (m.get("kwargs") or {}).items())
        count = f", {m['parameters']:,} trainable parameters" if m.get("parameters") else ""
        return f"{m.get('factory', '?')}({kwargs}){count}"

    @property
    def schedule(self) -> str:
        """The schedule in words: `linear warmup over 1 epoch to 5.00e-04, then cosine to 1e-06 by the end of 6
        epochs` (or of 90 training seconds)."""
        end = (f"the end of {self.time_budget_s:g} training seconds (at most {self.epochs} epochs)"
               if self.time_budget_s else f"the end of {self.epochs} epochs")
        warm = (f"linear warmup over {self.warmup_epochs:g} epoch{'s' if self.warmup_epochs != 1 else ''} to "
                f"{self.peak_lr:.2e}, then" if self.warmup_epochs else f"from {self.peak_lr:.2e},")
        return f"{warm} cosine to {self.min_lr:g} by {end}"

    def knobs(self) -> dict:
        """The spec's search knobs that run this recipe (each a fixed value)."""
        return {M.per_gpu_batch_size: self.per_gpu_batch_size, M.base_lr: self.base_lr,
                M.warmup_epochs: self.warmup_epochs, M.weight_decay: self.weight_decay,
                M.grad_accum_steps: self.grad_accum_steps, M.lr_rule: self.lr_rule}


@dataclass(frozen=True)
class Expected:
    """What a recipe is expected to reach: the ranking metric's value at the budget and, with a target, the time to
    it; for a predicted batch, the samples and seconds to the answer's value (McCandlish et al.'s E(B))."""

    metric: str
    value: float | None  # tune.metric at the end of the budget (predicted: the answer's, reached after `samples`)
    time_to_target_s: float | None = None  # training seconds to tune.target (None: no target, or not reached)
    samples: float | None = None  # predicted batch: training samples to reach `value` (or the target)
    seconds: float | None = None  # predicted batch: those samples at the batch's throughput
    source: str = ""  # where the figures come from, in words


@dataclass(frozen=True)
class LrFit:
    """How the best peak LR grows with the global batch in this sweep (the module's docstring)."""

    exponent: float | None  # α: best peak LR ∝ B^α (None: not fitted)
    interval: tuple[float, float] | None  # its 90 % bootstrap interval
    supports: str  # the one rule of RULES its interval holds; "inconclusive" (several), "neither", "undetermined"
    trials: int  # trials in the fit
    batches: tuple[int, ...]  # their global batches
    budget: str  # where each trial's metric was read: `epoch 2`, `30.0 training seconds`
    b_noise: float | None  # the measured gradient noise scale: predictions stop growing there
    reason: str  # how it was fitted, or why it was not
    consistent: tuple[str, ...] = ()  # every rule of RULES the interval holds
    coef: tuple[float, ...] = ()  # (c1, c2, c3) of the bowl, in centred logs (`center`)
    center: tuple[float, float] = (0.0, 0.0)  # (mean log B, mean log peak LR) of the fitted trials
    lr_range: tuple[float, float] = (0.0, 0.0)  # the peak LRs the fitted trials ran

    @property
    def fitted(self) -> bool:
        return self.exponent is not None

    def optimum(self, batch: float) -> float | None:
        """The peak LR at which the fitted bowl is lowest at global batch `batch` (held at B_noise past it); None
        without a fit."""
        if not self.fitted:
            return None
        c1, c2, c3 = self.coef
        x = math.log(min(batch, self.b_noise) if self.b_noise else batch) - self.center[0]
        return math.exp(self.center[1] - (c1 + c3 * x) / (2 * c2))

    def as_dict(self) -> dict:
        return {"exponent": self.exponent, "interval": list(self.interval) if self.interval else None,
                "supports": self.supports, "consistent_with": list(self.consistent), "trials": self.trials,
                "batches": list(self.batches), "budget": self.budget, "b_noise": self.b_noise, "reason": self.reason,
                "rules": dict(RULES)}


@dataclass(frozen=True)
class Answer:
    """The sweep's one answer (the module's docstring): `answer.json`, the `answer.*` params and metrics, the
    sweep's last block and the top of report.html."""

    recipe: Recipe
    expected: Expected
    ran: bool  # this recipe ran as a trial for its whole budget (or to the target)
    predicted: bool  # not (yet) measured at its whole budget: `confirm_command` measures it
    trial_id: str | None  # the trial that ran it (the sweep's best); None for another batch's prediction
    trials: list[dict]  # the trials that support it, each with its role
    lr_fit: LrFit
    tau: float | None  # AdamW's timescale τ = B / (η λ D) of the answer
    confirm_command: str
    confirmed: ConfirmationRecord | None = None  # the newest confirmation of this very recipe
    notes: tuple[str, ...] = ()  # what a reader must know: the LR's source, an extrapolation, other confirmations
    confirmations: list[ConfirmationRecord] = field(default_factory=list)  # every confirmation of this sweep

    def as_json(self) -> dict:
        """answer.json: the recipe's keys at the top, then the evidence."""
        r = self.recipe
        return {
            "global_batch": r.global_batch, "per_gpu_batch_size": r.per_gpu_batch_size,
            "num_workers": r.num_workers, "grad_accum_steps": r.grad_accum_steps, "peak_lr": r.peak_lr,
            "base_lr": r.base_lr, "warmup_epochs": r.warmup_epochs, "weight_decay": r.weight_decay,
            "ran": self.ran, "predicted": self.predicted, "lr_fit": self.lr_fit.as_dict(),
            "confirmed": self.confirmed.as_dict() if self.confirmed else None,
            "lr_rule": r.lr_rule, "reference_batch_size": r.reference_batch_size, "schedule": r.schedule,
            "min_lr": r.min_lr, "epochs": r.epochs, "time_budget_s": r.time_budget_s, "precision": r.precision,
            "grad_clip": r.grad_clip, "model": r.model, "expected": asdict(self.expected), "trial_id": self.trial_id,
            "trials": self.trials, "tau": self.tau, "confirm_command": self.confirm_command, "notes": list(self.notes),
            "confirmations": [c.as_dict() for c in self.confirmations],
        }

    def params(self) -> dict[str, str]:
        """The parent run's `answer.*` params."""
        r = self.recipe
        return {f"answer.{k}": str(v) for k, v in {
            "global_batch": r.global_batch, "per_gpu_batch_size": r.per_gpu_batch_size, "num_workers": r.num_workers,
            "grad_accum_steps": r.grad_accum_steps, "peak_lr": r.peak_lr, "base_lr": r.base_lr,
            "lr_rule": r.lr_rule, "warmup_epochs": r.warmup_epochs, "weight_decay": r.weight_decay,
            "schedule": r.schedule, "model": r.model_line, "ran": self.ran, "predicted": self.predicted,
            "trial_id": self.trial_id, "lr_fit": self.lr_fit.supports}.items()}

    def metrics(self) -> dict[str, float]:
        """The parent run's `answer.*` metrics (numbers only; a confirmation's where it ran)."""
        r, e, fit = self.recipe, self.expected, self.lr_fit
        out = {"global_batch": r.global_batch, "peak_lr": r.peak_lr, "weight_decay": r.weight_decay,
               "warmup_epochs": r.warmup_epochs, "expected_value": e.value, "expected_time_to_target_s":
               e.time_to_target_s, "lr_exponent": fit.exponent,
               "lr_exponent_low": fit.interval[0] if fit.interval else None,
               "lr_exponent_high": fit.interval[1] if fit.interval else None}
        if self.confirmed is not None:
            for key in ("value", "time_to_target_s"):
                out[f"confirmed_{key}"] = self.confirmed.measured(key)
        return {f"answer.{k}": float(v) for k, v in out.items() if v is not None and math.isfinite(float(v))}


# ---------------------------------------------------------------------------------------------
# The answer


def spec_of(record: SweepRecord):
    """The sweep's spec (config.SweepConfig) from the text it logged; None when it cannot be read (a store from
    before a schema change)."""
    import yaml
    from pydantic import ValidationError

    from raysweep.config import SweepConfig

    try:
        return SweepConfig.model_validate(yaml.safe_load(record.spec_text or "") or {})
    except (yaml.YAMLError, ValidationError, TypeError):
        return None


def answer_of(record: SweepRecord, spec_file: str | None, advice) -> Answer | None:
    """The sweep's answer: its best trial's recipe (the module's docstring); None when no trial ranked or the spec
    cannot be read. `spec_file`: the spec's path (and --set overrides), for the confirm command; `advice`:
    report.recommendation's noise.Recommendation (B_noise and the throughput per batch), or None."""
    spec = spec_of(record)
    ranked = _ranked(record)
    if spec is None or not ranked:
        return None
    best = ranked[0]
    recipe = recipe_of(best, spec)
    target = record.target is not None
    reached = best.last(M.time_to_target_s) is not None
    ran = best.status == FINISHED or (target and reached)
    budget = _budget_words(best, spec)
    expected = Expected(record.metric, best.last(record.metric), best.last(M.time_to_target_s),
                        source=f"trial {best.trial_id}, {budget}")
    notes = []
    if not ran:
        notes.append(f"trial {best.trial_id} did not run its whole budget ({best.status} at epoch {best.epoch}): "
                     f"its value at the full budget is a prediction until `confirm` measures it")
    fit = fit_lr(record, spec, advice.noise_scale if advice else None)
    answer = Answer(recipe, expected, ran, not ran, best.trial_id, _support(record, ranked, best), fit,
                    _tau(best), confirm_command(spec_file, None))
    return _with_confirmations(record, answer, notes)


def _ranked(record: SweepRecord) -> list[RunRecord]:
    """The sweep's own ranking, the summary table's (report/table.ranked: metrics.rank over the trials that did not
    fail, best first), so that the answer is the table's first row."""
    from raysweep.report.table import ranked

    return ranked(record)


def recipe_of(t: RunRecord, spec) -> Recipe:
    """A trial's recipe: its knobs and derived values as logged, the spec's schedule."""
    train = spec.train
    per_gpu, workers = int(t.number(M.per_gpu_batch_size)), int(t.number(M.world_size) or spec.scaling.num_workers)
    accum = int(t.number(M.grad_accum_steps) or 1)
    return Recipe(int(t.number(M.global_batch_size) or per_gpu * workers * accum), per_gpu, workers, accum,
                  t.number(M.peak_lr), t.number(M.base_lr), t.params.get(M.lr_rule, train.lr_rule),
                  int(t.number(M.reference_batch_size) or train.reference_batch_size), t.number(M.warmup_epochs),
                  t.number(M.weight_decay), train.min_lr, train.epochs, train.time_budget_s,
                  t.params.get(M.precision_used, train.precision), train.grad_clip, model_of(t, spec))


def model_of(t: RunRecord, spec) -> dict:
    """The network a trial trained, as its run logged it (metrics.MODEL_FACTORY, ...; a store from before the
    model plug-in: the spec's, the built-in CNN)."""
    import json

    kwargs = t.params.get(MODEL_KWARGS)
    count = t.params.get(MODEL_PARAMETERS)
    return {"factory": t.params.get(MODEL_FACTORY, spec.model.name),
            "kwargs": json.loads(kwargs) if kwargs else spec.model.factory_kwargs(),
            "parameters": int(count) if count else None}


def _budget_words(t: RunRecord, spec) -> str:
    seconds = t.last(M.train_seconds)
    clock = f", {seconds:.1f} training seconds" if seconds else ""
    return f"epoch {t.epoch} of {int(t.number(M.resolved_epochs) or spec.train.epochs)}{clock}"


def _support(record: SweepRecord, ranked: list[RunRecord], best: RunRecord) -> list[dict]:
    """The trials behind the answer: it, the others of its global batch (how its LR and decay fared), and the best
    of every other batch (what the other batches reached)."""
    def row(t: RunRecord, role: str) -> dict:
        return {"trial_id": t.trial_id, "role": role, "status": t.status,
                "global_batch": int(t.number(M.global_batch_size) or 0), "peak_lr": t.number(M.peak_lr),
                "weight_decay": t.number(M.weight_decay), "warmup_epochs": t.number(M.warmup_epochs),
                "epoch": t.epoch, record.metric: t.last(record.metric),
                "time_to_target_s": t.last(M.time_to_target_s)}

    batch = best.number(M.global_batch_size)
    rows = [row(best, "the answer")]
    rows += [row(t, "same global batch") for t in ranked[1:] if t.number(M.global_batch_size) == batch]
    seen = {batch}
    for t in ranked:
        other = t.number(M.global_batch_size)
        if other not in seen:
            seen.add(other)
            rows.append(row(t, "best of its global batch"))
    return rows


def _tau(t: RunRecord) -> float | None:
    """AdamW's timescale τ = B / (η λ D) of a trial's run: D its training samples (the fraction of the run its
    weights average over)."""
    batch, lr, wd, samples = (t.number(M.global_batch_size), t.number(M.peak_lr), t.number(M.weight_decay),
                              t.last(M.samples_seen))
    if not (batch and lr and wd and samples):
        return None
    return batch / (lr * wd * samples)


def confirm_command(spec_file: str | None, batch: int | None) -> str:
    spec = spec_file or "SPEC"
    return f"python -m raysweep confirm {spec}" + (f" --batch {batch}" if batch else "")


# ---------------------------------------------------------------------------------------------
# The LR fit


def fit_lr(record: SweepRecord, spec, b_noise: float | None, seed: int = 0) -> LrFit:
    """How the best peak LR grows with the global batch (the module's docstring). Every finished and pruned trial
    counts at every ASHA rung (and max_t) it reached, its value read where ASHA read it, with an intercept per rung
    (a trial ASHA cut early still tells where the bowl lies; the bowl's place is assumed the same at every rung);
    its exponent's interval is a bootstrap over the trials (a trial's rows go together); the rule the interval
    supports. It needs MIN_FIT_TRIALS trials across two global batches."""
    import numpy as np

    from raysweep.report.importance import value_at  # report/importance.py: metrics alone, never the report

    b_noise = b_noise if b_noise and math.isfinite(b_noise) and b_noise > 0 else None
    clock, budgets = _budgets(spec)
    rows, trials = [], 0  # (trial, batch, peak LR, rung, value)
    for t in record.trials:
        batch, lr = t.number(M.global_batch_size), t.number(M.peak_lr)
        if t.status not in (FINISHED, PRUNED) or not (batch and lr):
            continue
        mine = []
        for rung, budget in enumerate(budgets):
            value = value_at(t, record.metric, clock, budget)
            if value is not None and math.isfinite(value):
                mine.append((trials, batch, lr, rung, -value if record.mode == "max" else value))
        if mine:
            rows += mine
            trials += 1
    used = sorted({budgets[r[3]] for r in rows})
    unit = "epoch" if clock == M.epoch else "training seconds"
    words = (f"{'epochs' if clock == M.epoch else 'training seconds'} {', '.join(f'{b:g}' for b in used)} (each "
             f"trial at every one it reached)" if used else f"ASHA's rungs in {unit}")
    batches = tuple(sorted({int(r[1]) for r in rows}))

    def undetermined(reason: str) -> LrFit:
        return LrFit(None, None, "undetermined", trials, batches, words, b_noise, reason)

    if trials < MIN_FIT_TRIALS or len(batches) < 2:
        return undetermined(f"{trials} finished and pruned trials over {len(batches)} global batch(es): the fit needs "
                            f"{MIN_FIT_TRIALS} across 2 batches or more")
    data = np.array(rows, dtype=np.float64)
    center = (float(np.log(data[:, 1]).mean()), float(np.log(data[:, 2]).mean()))
    coef = _bowl(data, center)
    if coef is None:
        return undetermined(f"no minimum in peak LR within the {trials} trials' LRs (the best LR of a batch lies at "
                            f"the edge of the searched range: widen search.base_lr)")
    rng = np.random.default_rng(seed)
    by_trial = [data[data[:, 0] == i] for i in range(trials)]
    exponents, bowls = [], 0
    for _ in range(BOOTSTRAPS):
        sample = np.concatenate([by_trial[i] for i in rng.integers(0, trials, trials)])
        again = _bowl(sample, center) if len(np.unique(sample[:, 1])) >= 2 else None
        if again is not None:
            bowls += 1
            exponents.append(-again[2] / (2 * again[1]))
    if bowls < BOOTSTRAPS / 2:
        return undetermined(f"a minimum in peak LR in only {bowls} of {BOOTSTRAPS} resamples of the {trials} trials: "
                            f"too few or too noisy to place the best LR")
    alpha = -coef[2] / (2 * coef[1])
    low, high = (float(q) for q in np.quantile(exponents, INTERVAL))
    holds = tuple(name for name, value in RULES.items() if low <= value <= high)
    supports = "inconclusive" if len(holds) > 1 else holds[0] if holds else "neither"
    reason = (f"the bowl v ≈ a_B + a_rung + c1·log η + c2·log² η + c3·log B·log η fitted to {trials} trials "
              f"({len(rows)} rung values; tune.metric{', negated' if record.mode == 'max' else ''}); the interval "
              f"from {bowls} bootstrap resamples of the trials")
    return LrFit(float(alpha), (low, high), supports, trials, batches, words, b_noise, reason, holds, coef, center,
                 (float(data[:, 2].min()), float(data[:, 2].max())))


def _budgets(spec) -> tuple[str, list[float]]:
    """ASHA's clock and where it reads trials: its rungs and its horizon (max_t), ascending."""
    from raysweep.asha import AshaPlan

    plan = AshaPlan.of(spec)
    points = {*plan.rungs}
    if math.isfinite(plan.max_t):
        points.add(plan.max_t)
    return plan.time_attr, sorted(points)


def _bowl(data, center) -> tuple[float, float, float] | None:
    """Least squares of v on one intercept per batch and per rung (the first rung's folded into the batches'), y, y²
    and x·y (x, y: log B and log peak LR, centred); (c1, c2, c3), or None where the fit is not a bowl in y (c2 ≤ 0)
    or the design is singular. `data` rows: (trial, batch, peak LR, rung, value)."""
    import numpy as np

    x, y, v = np.log(data[:, 1]) - center[0], np.log(data[:, 2]) - center[1], data[:, 4]
    batches, rungs = np.unique(data[:, 1]), np.unique(data[:, 3])
    design = np.column_stack([*(data[:, 1] == b for b in batches), *(data[:, 3] == r for r in rungs[1:]),
                              y, y * y, x * y]).astype(np.float64)
    if np.linalg.matrix_rank(design) < design.shape[1]:
        return None
    coef, *_ = np.linalg.lstsq(design, v, rcond=None)
    c1, c2, c3 = (float(c) for c in coef[-3:])
    return (c1, c2, c3) if c2 > 0 else None


# ---------------------------------------------------------------------------------------------
# A batch the sweep did not run


def predict(record: SweepRecord, batch: int, spec_file: str | None, advice) -> Answer:
    """The predicted recipe at global batch `batch` (`raysweep answer SPEC --batch N`): the answer's workers and
    accumulation, its per-GPU batch made up to `batch`; the peak LR from the fit (or the square-root rule from the
    answer's), the weight decay from the answer's τ, its warmup in epochs, and the time to the answer's value from
    E(B) and the batch's throughput. A batch the workers × accumulation cannot make is a UserError naming the
    nearest that can."""
    from raysweep.errors import UserError

    base = answer_of(record, spec_file, advice)
    if base is None:
        raise UserError(f"answer: the sweep {record.parent_name} has no trial to start from (none finished or was "
                        f"pruned); run `tune` first")
    spec, r = spec_of(record), base.recipe
    step = r.num_workers * r.grad_accum_steps
    if batch <= 0 or batch % step:
        below, above = max(step, batch // step * step), (batch // step + 1) * step
        raise UserError(f"--batch {batch}: a global batch is per-GPU batch × {r.num_workers} workers × "
                        f"{r.grad_accum_steps} accumulation steps, a multiple of {step}; the nearest are {below} and "
                        f"{above}")
    per_gpu = batch // step
    fit = base.lr_fit
    b_noise = fit.b_noise
    notes = []
    lr = fit.optimum(batch)
    if lr is not None:
        source = f"the sweep's fit (best peak LR ∝ B^{fit.exponent:.2f}, {fit.supports})"
        low, high = fit.lr_range
        if not low / 2 <= lr <= 2 * high:
            notes.append(f"the fitted LR {lr:.2e} lies outside twice the range of LRs the fit saw ({low:.2e} to "
                         f"{high:.2e}): an extrapolation")
    else:
        capped = (min(batch, b_noise) / min(r.global_batch, b_noise)) if b_noise else batch / r.global_batch
        lr = r.peak_lr * capped ** PRIOR_EXPONENT
        source = f"the answer's peak LR scaled by AdamW's square-root rule ({fit.reason})"
    if b_noise and batch > b_noise:
        notes.append(f"global batch {batch} is past B_noise ≈ {b_noise:,.0f}: the LR is held at B_noise's (Adam's best "
                     f"LR peaks near it), and each sample buys less")
    notes.insert(0, f"peak LR from {source}")
    rule = r.lr_rule
    base_lr = lr / (batch / r.reference_batch_size) ** LR_RULE_POWER[rule]
    samples = _samples_run(record, spec, batch, advice)
    wd = r.weight_decay
    if base.tau and samples:
        wd = batch / (lr * base.tau * samples)
        notes.append(f"weight decay from the answer's AdamW timescale τ = B/(ηλD) = {base.tau:.3g} over {samples:,.0f} "
                     f"training samples")
    recipe = Recipe(batch, per_gpu, r.num_workers, r.grad_accum_steps, lr, base_lr, rule, r.reference_batch_size,
                    r.warmup_epochs, wd, r.min_lr, r.epochs, r.time_budget_s, r.precision, r.grad_clip, r.model)
    expected = _expected_at(record, base, batch, advice)
    if expected.samples and samples and expected.samples > samples:
        what = "the target" if expected.time_to_target_s is not None else f"{expected.metric} {expected.value:.4g}"
        notes.append(f"its budget trains about {samples:,.0f} samples, fewer than the {expected.samples:,.0f} it needs "
                     f"for {what}: expect it to end short of that (raise train.epochs or train.time_budget_s)")
    ran = next((t for t in _ranked(record) if t.number(M.global_batch_size) == batch
                and _close(t.number(M.peak_lr), lr) and _close(t.number(M.weight_decay), wd)), None)
    if ran is not None:
        notes.append(f"trial {ran.trial_id} ran close to this recipe (peak LR and weight decay within 10 %)")
    answer = Answer(recipe, expected, False, True, None, base.trials, fit, base.tau, confirm_command(spec_file, batch),
                    notes=tuple(notes))
    return _with_confirmations(record, answer, [])


def _close(a: float | None, b: float, within: float = 0.1) -> bool:
    return a is not None and abs(a / b - 1) <= within


def throughput_at(batch: int, rates: dict[int, float]) -> float | None:
    """Samples/s at a global batch: measured, else interpolated (log-log) between the measured batches around it,
    else the nearest measured one's (flat past the ends); None with no measurement."""
    if not rates:
        return None
    if batch in rates:
        return rates[batch]
    below = [b for b in rates if b < batch]
    above = [b for b in rates if b > batch]
    if below and above:
        b0, b1 = max(below), min(above)
        f = math.log(batch / b0) / math.log(b1 / b0)
        return math.exp(math.log(rates[b0]) + f * (math.log(rates[b1]) - math.log(rates[b0])))
    return rates[max(below)] if below else rates[min(above)]


def _samples_run(record: SweepRecord, spec, batch: int, advice) -> float | None:
    """Training samples a run at `batch` gets: its epochs' whole steps (train.epochs), or under train.time_budget_s
    the budget at its throughput."""
    if spec is None:
        return None
    train_size = next((t.number(M.train_size) for t in record.trials if t.number(M.train_size)), None)
    if spec.train.time_budget_s:
        rate = throughput_at(batch, {c.global_batch: c.samples_per_s for c in advice.candidates} if advice else {})
        return rate * spec.train.time_budget_s if rate else None
    if not train_size:
        return None
    return spec.train.epochs * (int(train_size) // batch) * batch


def _expected_at(record: SweepRecord, base: Answer, batch: int, advice) -> Expected:
    """What a run at `batch` is expected to reach: the answer's value (or the target) after E(batch)/E(answer) of the
    samples the answer took to get there (McCandlish et al.: E(B) = E_min (1 + B / B_noise)), at the batch's
    throughput."""
    e, r = base.expected, base.recipe
    answer_trial = next((t for t in record.trials if t.trial_id == base.trial_id), None)
    if answer_trial is None or advice is None:
        return Expected(e.metric, e.value, source="no B_noise or throughput measured: not predicted")
    rates = {c.global_batch: c.samples_per_s for c in advice.candidates}
    rate = throughput_at(batch, rates)
    ratio = (1 + batch / advice.noise_scale) / (1 + r.global_batch / advice.noise_scale)
    if e.time_to_target_s is not None:
        samples = answer_trial.last(M.samples_to_target) * ratio
        seconds = samples / rate if rate else None
        return Expected(e.metric, e.value, seconds, samples, seconds,
                        f"the answer's {answer_trial.last(M.samples_to_target):,.0f} samples to the target × E(B) "
                        f"ratio {ratio:.2f} (B_noise ≈ {advice.noise_scale:,.0f}), at {rate or 0:,.0f} samples/s")
    samples = answer_trial.last(M.samples_seen) * ratio
    seconds = samples / rate if rate else None
    return Expected(e.metric, e.value, None, samples, seconds,
                    f"the answer's {e.metric} {e.value:.4g} after its {answer_trial.last(M.samples_seen):,.0f} "
                    f"samples × E(B) ratio {ratio:.2f} (B_noise ≈ {advice.noise_scale:,.0f}), at {rate or 0:,.0f} "
                    f"samples/s")


# ---------------------------------------------------------------------------------------------
# Confirmations


def _with_confirmations(record: SweepRecord, answer: Answer, notes: list[str]) -> Answer:
    """The answer with the sweep's confirmations (`record.confirmations`): the newest of this very recipe (same
    global batch, peak LR and weight decay) is `confirmed`; one of another recipe is said."""
    import dataclasses

    r = answer.recipe
    runs = list(getattr(record, "confirmations", []) or [])
    mine = [c for c in runs if c.global_batch == r.global_batch and _close(c.peak_lr, r.peak_lr, 1e-6)]
    confirmed = mine[-1] if mine else None
    if runs and confirmed is None and answer.ran:
        notes.append(f"{len(runs)} confirmation(s) of other recipes; none of this one yet")
    return dataclasses.replace(answer, confirmed=confirmed, confirmations=runs, notes=(*answer.notes, *notes))
