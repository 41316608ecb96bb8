"""The answer's records: the recipe (what to train with, whole), what it is expected to reach, the LR fit and its
check, and the answer that holds them (answer.json, the `answer.*` params and metrics)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from raysweep.metrics import ConfirmationRecord
from raysweep.metrics import names as M

ANSWER_FILE = "answer.json"  # in the sweep's report folder (layout.REPORT), beside report.html
# why a sweep over several batches has no check (answer.fit._checked)
UNPLACED = ("fewer than two of its global batches have a best LR it could place (a bottom of the sweep's bowl "
            "inside the LRs the batch ran, or a best trial that ran its whole budget)")
# what places the fitted recipe's LR at the answer's batch (answer.recipe.better_lr)
FROM_FIT = "the checked fit"
FROM_BOTTOM = "the sweep's bowl with a bottom per batch (the check's measure of each batch's best LR)"
RULES = {"linear": 1.0, "sqrt": 0.5, "none": 0.0}  # train.lr_rule's exponents: the rules a fit can support
# the clock of every second the answer gives (train_seconds, the budget, ASHA, the time to the target)
CLOCK = ("train_seconds: the epochs' training and evaluation, start-up and compiling excluded (ASHA's, the time "
         "budget's and the time to the target's clock)")
# the loss every trial trained on (raysweep/worker/step.py LOSS_FN)
LOSS = "MultiLabelSoftMarginLoss on one-hot (position, character) targets: mean over images and classes"
# every number Answer.metrics can log: a later answer without one logs NaN there (tracking.published.log_answer)
METRIC_KEYS = ("global_batch", "peak_lr", "weight_decay", "warmup_epochs", "expected_value",
               "expected_time_to_target_s", "lr_exponent", "lr_exponent_low", "lr_exponent_high",
               "lr_exponent_used", "confirmed_value", "confirmed_time_to_target_s")


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
    resolved_epochs: int | None = None  # the epochs it trains: `epochs`, or what fills time_budget_s
    train_size: int | None = None  # training samples an epoch draws from
    image: dict = field(default_factory=dict)  # height, width, channels, length, charset size (num_classes)
    seed: int | None = None  # train.seed of the run it comes from

    @property
    def steps_per_epoch(self) -> int | None:
        """Whole optimizer steps an epoch (config.TrialConfig.steps_per_epoch: drop_last)."""
        return self.train_size // self.global_batch if self.train_size else None

    @property
    def total_steps(self) -> int | None:
        """Optimizer steps over resolved_epochs: where the cosine ends."""
        return self.resolved_epochs * self.steps_per_epoch if self.resolved_epochs and self.train_size else None

    @property
    def warmup_steps(self) -> int | None:
        return round(self.warmup_epochs * self.steps_per_epoch) if self.train_size else None

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
        ran = (f", {self.resolved_epochs} epoch{'s' if self.resolved_epochs != 1 else ''} here" if self.resolved_epochs
               else "")
        end = (f"the end of {self.time_budget_s:g} training seconds (at most {self.epochs} epochs{ran})"
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
    """What a recipe is expected to reach: the ranking metric's value and, with a target, the time to it; for a
    predicted batch, the samples and seconds to the answer's value (McCandlish et al.'s E(B)). `at`: the budget the
    value is at, in words (`the whole budget`, or where a pruned trial stopped)."""

    metric: str
    value: float | None  # tune.metric at `at` (predicted: the answer's, reached after `samples`)
    time_to_target_s: float | None = None  # training seconds to tune.target (None: no target, or not reached)
    samples: float | None = None  # predicted batch: training samples to reach `value` (or the target)
    seconds: float | None = None  # predicted batch: those samples at the batch's throughput (CLOCK)
    source: str = ""  # where the figures come from, in words
    at: str = "the whole budget"
    train_seconds: float | None = None  # the seconds the run behind `value` trained (CLOCK)


@dataclass(frozen=True)
class FitCheck:
    """The sweep's check of its own LR fit: each global batch left out in turn, its best trial's peak LR predicted
    from the other batches by each predictor (the fit, the square-root rule, keeping the anchor's LR), and each
    predictor's mean |log(predicted / measured)| over the left-out batches."""

    errors: dict  # predictor (`fit`, `sqrt`, `none`) → mean |ln(predicted / measured best LR)|; absent: not checked
    batches: tuple[int, ...]  # the left-out batches
    used: str  # the predictor the predictions use: `fit` only where it beat both rules, else the better rule
    exponent: float  # the exponent `used` scales the answer's LR with
    # the left-out batches without which the fit, refitted on the others, had no minimum: the fit is then not checked
    # (no `fit` in errors), though the whole sweep's fit has one
    unfitted: tuple[int, ...] = ()

    def as_dict(self) -> dict:
        return {"errors": {k: round(v, 4) for k, v in self.errors.items()}, "left_out": list(self.batches),
                "used": self.used, "exponent": self.exponent, "fit_unchecked_without": list(self.unfitted)}


@dataclass(frozen=True)
class LrFit:
    """How the best peak LR grows with the global batch in this sweep (answer.fit's docstring)."""

    exponent: float | None  # α: best peak LR ∝ B^α (None: not fitted)
    interval: tuple[float, float] | None  # its 90 % bootstrap interval
    supports: str  # the one rule of RULES its interval holds; "inconclusive" (several), "neither", "undetermined"
    trials: int  # trials in the fit
    batches: tuple[int, ...]  # their global batches
    budget: str  # where each trial's metric was read: `epochs 2, 4 and where each finished trial ended`
    b_noise: float | None  # the measured gradient noise scale: predictions stop growing there
    reason: str  # how it was fitted, or why it was not
    consistent: tuple[str, ...] = ()  # every rule of RULES the interval holds
    coef: tuple[float, ...] = ()  # (c1, c2, c3) of the bowl at its reference budget, in centred logs (`center`)
    center: tuple[float, float] = (0.0, 0.0)  # (mean log B, mean log peak LR) of the fitted trials
    lr_range: tuple[float, float] = (0.0, 0.0)  # the peak LRs the fitted trials ran
    check: FitCheck | None = None  # the leave-one-batch-out check (None: fewer than two batches)
    ceilings: tuple[tuple[int, float], ...] = ()  # (global batch, peak LR) of trials that diverged or ran out of memory
    edge: str | None = None  # the best LR lies at the searched range's edge: that, and the range to search next
    # (global batch, best peak LR) where the sweep's bowl with a bottom per batch places one inside the LRs the batch
    # ran (answer.fit._bottoms): the check's measure of each batch's best LR
    bottoms: tuple[tuple[int, float], ...] = ()

    @property
    def fitted(self) -> bool:
        return self.exponent is not None

    @property
    def used_exponent(self) -> float:
        """The exponent predictions scale the answer's LR with: the checked fit's, else the better rule's (the
        square-root rule unchecked)."""
        return self.check.exponent if self.check else RULES["sqrt"]

    def optimum(self, batch: float) -> float | None:
        """The peak LR at which the fitted bowl is lowest at global batch `batch` at the fit's reference budget
        (held at B_noise past it); None without a fit."""
        if not self.fitted:
            return None
        c1, c2, c3 = self.coef
        x = math.log(min(batch, self.b_noise) if self.b_noise else batch) - self.center[0]
        # a bowl almost flat puts its bottom past any float's range: kept finite, it lies past every LR range
        return math.exp(min(self.center[1] - (c1 + c3 * x) / (2 * c2), 700.0))

    def as_dict(self) -> dict:
        return {"exponent": self.exponent, "interval": list(self.interval) if self.interval else None,
                "supports": self.supports, "consistent_with": list(self.consistent), "trials": self.trials,
                "batches": list(self.batches), "budget": self.budget, "b_noise": self.b_noise, "reason": self.reason,
                "rules": dict(RULES), "check": self.check.as_dict() if self.check else None,
                "used_exponent": self.used_exponent, "ceilings": [list(c) for c in self.ceilings], "edge": self.edge,
                "bottoms": {str(b): lr for b, lr in self.bottoms}}


@dataclass(frozen=True)
class Answer:
    """The sweep's one answer (answer/__init__'s docstring): `answer.json`, the `answer.*` params and metrics, the
    sweep's last block and the top of report.html."""

    recipe: Recipe
    expected: Expected
    ran: bool  # this recipe ran as a trial for its whole budget (or to the target)
    predicted: bool  # not (yet) measured at its whole budget: `confirm_command` measures it
    trial_id: str | None  # the trial that ran it (the sweep's best); None for another batch's prediction
    trials: list[dict]  # the trials that support it, each with its role
    lr_fit: LrFit
    tau: float | None  # AdamW's timescale τ = B / (η λ D) of the answer, D the samples of its whole budget
    confirm_command: str
    confirmed: ConfirmationRecord | None = None  # the newest complete confirmation of this very recipe
    notes: tuple[str, ...] = ()  # what a reader must know: the LR's source, an extrapolation, other confirmations
    confirmations: list[ConfirmationRecord] = field(default_factory=list)  # every confirmation of this sweep
    samples: float | None = None  # D: training samples the recipe trains over its whole budget
    better: Recipe | None = None  # the fitted recipe at this batch, where the sweep puts the best LR elsewhere

    @property
    def better_source(self) -> str:
        """What placed `better`'s LR (answer.recipe.better_lr): the checked fit where the check used it, else the
        bowl's bottom at the answer's batch; "" without `better`."""
        if self.better is None:
            return ""
        return FROM_FIT if self.lr_fit.check and self.lr_fit.check.used == "fit" else FROM_BOTTOM

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
            "min_lr": r.min_lr, "epochs": r.epochs, "time_budget_s": r.time_budget_s,
            "resolved_epochs": r.resolved_epochs, "steps_per_epoch": r.steps_per_epoch, "total_steps": r.total_steps,
            "warmup_steps": r.warmup_steps, "train_size": r.train_size, "samples": self.samples,
            "train_seconds": self.expected.train_seconds if self.ran else self.expected.seconds, "clock": CLOCK,
            "precision": r.precision, "grad_clip": r.grad_clip, "model": r.model, "image": r.image,
            "loss": LOSS, "seed": r.seed,
            "expected": asdict(self.expected), "trial_id": self.trial_id, "trials": self.trials, "tau": self.tau,
            "confirm_command": self.confirm_command, "notes": list(self.notes),
            "confirmations": [c.as_dict() for c in self.confirmations],
            "better": None if self.better is None else {
                "peak_lr": self.better.peak_lr, "base_lr": self.better.base_lr,
                "weight_decay": self.better.weight_decay, "source": self.better_source,
                "confirm_command": f"{self.confirm_command} --fitted"},
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
        """The parent run's `answer.*` metrics (numbers only, keys of METRIC_KEYS; a confirmation's where one ran)."""
        r, e, fit = self.recipe, self.expected, self.lr_fit
        out = {"global_batch": r.global_batch, "peak_lr": r.peak_lr, "weight_decay": r.weight_decay,
               "warmup_epochs": r.warmup_epochs, "expected_value": e.value, "expected_time_to_target_s":
               e.time_to_target_s, "lr_exponent": fit.exponent,
               "lr_exponent_low": fit.interval[0] if fit.interval else None,
               "lr_exponent_high": fit.interval[1] if fit.interval else None,
               "lr_exponent_used": fit.used_exponent}
        if self.confirmed is not None:
            for key in ("value", "time_to_target_s"):
                out[f"confirmed_{key}"] = self.confirmed.measured(key)
        return {f"answer.{k}": float(v) for k, v in out.items() if v is not None and math.isfinite(float(v))}
