"""The sweep spec: YAML → typed, validated `SweepConfig`; `--set` overrides; derived trial values.

Key names are public API (specs, `--set`, README). Unknown keys are errors. Every bad input becomes
one `UserError` line naming the file, the dotted key, the value and the fix.
"""

from __future__ import annotations

import difflib
import math
import re
import string
from pathlib import Path
from typing import Annotated, Any, Generic, Literal, TypeVar, Union, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Strict, Tag, ValidationError, model_validator

from raysweep.errors import UserError

# Strict numbers: a bool or a quoted "1e-4" is an error, not silently a number.
Int = Annotated[int, Strict()]
Float = Annotated[float, Strict(), Field(allow_inf_nan=False)]
PosInt = Annotated[int, Strict(), Field(gt=0)]
NonNegInt = Annotated[int, Strict(), Field(ge=0)]
PosFloat = Annotated[float, Strict(), Field(gt=0, allow_inf_nan=False)]
PosNumber = Union[PosInt, PosFloat]  # a whole number stays one (specs print as they were written)
NonNegFloat = Annotated[float, Strict(), Field(ge=0, allow_inf_nan=False)]
Precision = Literal["auto", "fp32", "bf16", "fp16"]
LrRule = Literal["linear", "sqrt", "none"]
Auto = Literal["auto"]

DEFAULT_CHARSET = string.digits + string.ascii_uppercase


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# ---------------------------------------------------------------------------------------------
# Search-space distributions. A knob is a plain value (fixed) or exactly one of these.

T = TypeVar("T")


class Choice(_Section, Generic[T]):
    """`{choice: [a, b, ...], default: a}`: one of the listed values."""

    choice: list[T] = Field(min_length=1, description="candidate values")
    default: T | None = Field(None, description="value for `train` and the first tune trial")
    max: PosInt | Literal["probe"] | None = Field(
        None, description="per_gpu_batch_size only: larger samples run as max × more accumulation; probe → measure it"
    )

    @model_validator(mode="after")
    def _default_in_choices(self):
        if self.default is not None and self.default not in self.choice:
            raise ValueError(f"default {self.default!r} is not one of the choices {self.choice}")
        return self

    def first(self):
        return self.default if self.default is not None else self.choice[0]

    def largest(self):
        return max(self.choice)


class _Range(_Section):
    """A [low, high] distribution; `default` must lie inside it."""

    def bounds(self) -> tuple[float, float]:
        raise NotImplementedError

    @model_validator(mode="after")
    def _ordered(self):
        low, high = self.bounds()
        if not low < high:
            raise ValueError(f"low {low!r} must be below high {high!r}; swap them or use a fixed value")
        if self.default is not None and not low <= self.default <= high:
            raise ValueError(f"default {self.default!r} lies outside [{low!r}, {high!r}]")
        return self

    def first(self):
        return self.default if self.default is not None else self.bounds()[0]

    def largest(self):
        return self.bounds()[1]


class Uniform(_Range):
    """`{uniform: [low, high]}`: uniform float."""

    uniform: tuple[Float, Float]
    default: Float | None = None

    def bounds(self):
        return self.uniform


class LogUniform(_Range):
    """`{loguniform: [low, high]}`: log-uniform float, both bounds > 0."""

    loguniform: tuple[PosFloat, PosFloat]
    default: PosFloat | None = None

    def bounds(self):
        return self.loguniform


class RandInt(_Range):
    """`{randint: [low, high]}`: uniform integer, both bounds inclusive."""

    randint: tuple[Int, Int]
    default: Int | None = None
    max: PosInt | Literal["probe"] | None = None

    def bounds(self):
        return self.randint

    @model_validator(mode="after")
    def _ordered(self):  # inclusive bounds: low == high is allowed
        low, high = self.randint
        if low > high:
            raise ValueError(f"low {low!r} must not exceed high {high!r}")
        if self.default is not None and not low <= self.default <= high:
            raise ValueError(f"default {self.default!r} lies outside [{low!r}, {high!r}]")
        return self


DISTRIBUTIONS = {"choice": Choice, "uniform": Uniform, "loguniform": LogUniform, "randint": RandInt}
Distribution = Union[Choice, Uniform, LogUniform, RandInt]


def _knob_tag(value: Any) -> str | None:
    if isinstance(value, dict):
        kinds = [k for k in DISTRIBUTIONS if k in value]
        return kinds[0] if len(kinds) == 1 else None
    for tag, cls in DISTRIBUTIONS.items():
        if isinstance(value, cls):
            return tag
    return "value"


def Knob(value_type, *distributions: str):
    """A searchable knob: a fixed `value_type` or one of the named distributions."""
    members = [Annotated[value_type, Tag("value")]]
    for name in distributions:
        cls = Choice[value_type] if name == "choice" else DISTRIBUTIONS[name]
        members.append(Annotated[cls, Tag(name)])
    return Annotated[Union[tuple(members)], Discriminator(_knob_tag)]


def knob_first(knob) -> Any:
    """The value `train` uses: the knob's default, else the first choice / lower bound."""
    return knob.first() if isinstance(knob, BaseModel) else knob


def knob_largest(knob) -> Any:
    return knob.largest() if isinstance(knob, BaseModel) else knob


def _extremes(knob) -> list:
    """Smallest and largest value of a searched knob ([] when it is not searched)."""
    if isinstance(knob, Choice):
        return sorted({min(knob.choice), max(knob.choice)})
    if isinstance(knob, _Range):
        return sorted(set(knob.bounds()))
    return []


# ---------------------------------------------------------------------------------------------
# The spec's sections.


class SyntheticConfig(_Section):
    """The embedded default data set, generated with `captcha.image.ImageCaptcha`."""

    train_size: PosInt = Field(512, description="training images")
    val_size: PosInt = Field(128, description="validation images")
    seed: Int = Field(0, description="generation seed (same seed → same images)")


class DataConfig(_Section):
    train_dir: Path | None = Field(None, description="folder of TEXT_anything.png; null → synthetic set")
    val_dir: Path | None = Field(None, description="validation folder; null → hold out val_fraction of train_dir")
    val_fraction: Annotated[float, Strict(), Field(gt=0, lt=1)] = Field(0.1, description="held-out share of train_dir")
    charset: str = Field(DEFAULT_CHARSET, min_length=2, description="characters a captcha may contain")
    length: PosInt = Field(4, description="characters per captcha")
    width: Annotated[int, Strict(), Field(ge=8)] = Field(160, description="image width, pixels")
    height: Annotated[int, Strict(), Field(ge=8)] = Field(60, description="image height, pixels")
    synthetic: SyntheticConfig = SyntheticConfig()

    @model_validator(mode="after")
    def _check(self):
        if len(set(self.charset)) != len(self.charset):
            raise ValueError("charset repeats a character")
        if self.val_dir is not None and self.train_dir is None:
            raise ValueError("val_dir is set but train_dir is not; set both, or neither for the synthetic set")
        return self

    @property
    def num_classes(self) -> int:
        return len(self.charset)


class ModelConfig(_Section):
    dropout: Annotated[float, Strict(), Field(ge=0, lt=1)] = Field(0.5, description="dropout probability")


class ScalingConfig(_Section):
    """One trial's Ray Train worker group."""

    num_workers: PosInt = Field(2, description="DDP ranks per trial (one GPU each when use_gpu)")
    use_gpu: bool = Field(False, description="one GPU per worker, NCCL; false → CPU workers, gloo")
    cpus_per_worker: PosFloat = Field(1, description="CPUs reserved per worker (sets its OMP threads)")
    worker_start_timeout_s: PosFloat = Field(
        60, description="a worker group not started by then fails its trial instead of waiting forever"
    )
    max_setup_failures: PosInt = Field(
        3, description="a warm group whose set-up (device, data, process group) fails this many times in a row ends "
        "its slot; its trial fails (failure: infra), and while no group of the shape ever set up, so do the others"
    )


class TrainConfig(_Section):
    epochs: PosInt = Field(6, description="epochs per trial; with time_budget_s, the most a trial may run")
    time_budget_s: PosFloat | None = Field(
        None, description="training seconds per trial (start-up excluded): a trial times its epochs while still in "
        "warmup and fixes the epochs (at most train.epochs; its cosine fitted to them) that fill the budget; "
        "null → train.epochs"
    )
    precision: Precision = Field(
        "auto", description="autocast dtype: fp32, bf16, fp16 (adds a GradScaler), or auto: bf16 on GPUs that support it and on CPUs with AVX512-BF16 or AMX, else fp32"
    )
    compile: bool | Auto = Field(
        "auto", description="torch.compile the training step; auto: on for CUDA (2.2× the eager step on an H100), "
        "off for CPU workers (no gain measured there); see benchmarks/RESULTS.md"
    )
    cuda_graphs: bool | Auto = Field(
        "auto", description="replay each optimizer step as one CUDA graph (no per-kernel launches); auto: on for "
        "one-GPU trials (not fp16) at micro-batches of at most 512, where launches leave the GPU idle"
    )
    lr_rule: LrRule = Field("sqrt", description="peak_lr = base_lr × (global/reference)^p; p = 1, ½ or 0")
    reference_batch_size: PosInt = Field(256, description="global batch at which base_lr is given")
    min_lr: NonNegFloat = Field(1.0e-6, description="cosine floor")
    grad_clip: PosFloat | None = Field(1.0, description="max pre-clip global grad norm; null → no clipping")
    grad_accum_steps: PosInt = Field(1, description="micro-batches per optimizer step")
    checkpoint_every: PosInt = Field(1, description="epochs between checkpoints (the last epoch always saves)")
    max_failures: NonNegInt = Field(1, description="worker-group restarts from the last checkpoint")
    max_infra_retries: NonNegInt = Field(
        3, description="times a trial is submitted again, to resume from its checkpoint on another group, after "
        "a failure of the infrastructure (a slot host or controller lost, a group that could not start, the store "
        "stalled past mlflow.retry_s); its own failures (oom, diverged, error) are never retried"
    )
    max_downshifts: NonNegInt = Field(
        3, description="on OOM at start: halve the micro-batch, double accumulation, at most this often"
    )
    seed: Int = Field(0, description="model init, shuffling and dropout seed")


class SearchConfig(_Section):
    """The trial knobs. A plain value fixes a knob; a distribution searches it."""

    per_gpu_batch_size: Knob(PosInt, "choice", "randint") = Field(32, description="micro-batch per worker")
    base_lr: Knob(PosFloat, "choice", "uniform", "loguniform") = Field(1.0e-3, description="LR at reference_batch_size")
    warmup_epochs: Knob(NonNegFloat, "choice", "uniform", "randint") = Field(1, description="linear warmup, epochs")
    weight_decay: Knob(NonNegFloat, "choice", "uniform", "loguniform") = Field(1.0e-4, description="AdamW decoupled decay")
    grad_accum_steps: Knob(PosInt, "choice", "randint") | None = Field(None, description="null → train.grad_accum_steps")
    lr_rule: Knob(LrRule, "choice") | None = Field(None, description="null → train.lr_rule")

    @model_validator(mode="after")
    def _max_only_on_batch(self):
        for name, knob in self.knobs().items():
            if name != "per_gpu_batch_size" and getattr(knob, "max", None) is not None:
                raise ValueError(f"{name}: 'max' applies to per_gpu_batch_size only")
        return self

    def knobs(self) -> dict[str, Any]:
        """The knobs that are set (fixed or searched), by name."""
        return {name: getattr(self, name) for name in type(self).model_fields if getattr(self, name) is not None}


class AshaConfig(_Section):
    unit: Literal["epochs", "seconds"] = Field(
        "epochs", description="what ASHA's rungs count: epochs, or training seconds (train_seconds): batches "
        "compared by the time they cost, not the epochs they ran")
    max_t: PosNumber | None = Field(
        None, description="the most a trial runs, in the unit; null → train.epochs (seconds: train.time_budget_s)")
    grace_period: PosNumber = Field(2, description="what every trial gets before it can be stopped, in the unit")
    reduction_factor: Annotated[float, Strict(), Field(gt=1)] = Field(2, description="keep 1/reduction_factor at each rung")
    allow_grace_within_warmup: bool = Field(
        False, description="allow grace_period < the largest warmup (trials may be cut before they are judged)"
    )


def _rankable(metric: str) -> None:
    """A ValueError naming the closest rankable metric, unless `metric` is one (tune.metric, tune.target.metric)."""
    from raysweep.metrics import RANKABLE_METRICS

    if metric not in RANKABLE_METRICS:
        close = difflib.get_close_matches(metric, RANKABLE_METRICS, n=1)
        hint = f"did you mean '{close[0]}'?" if close else "one of " + ", ".join(RANKABLE_METRICS)
        raise ValueError(f"unknown metric {metric!r} ({hint})")


class TargetConfig(_Section):
    """A value of a metric to reach: trials are compared by how long they take to get there."""

    metric: str = Field("val_exact_acc", description="the metric (one ASHA can rank by)")
    value: Float = Field(description="the value to reach (at or above it for accuracies, at or below for losses)")
    stop: bool = Field(False, description="end a trial when it gets there (it counts as finished)")

    @model_validator(mode="after")
    def _check(self):
        _rankable(self.metric)
        return self

    @property
    def mode(self) -> str:
        from raysweep.metrics import METRIC_MODES

        return METRIC_MODES[self.metric]


class TuneSection(_Section):
    num_samples: PosInt = Field(6, description="trials")
    metric: str = Field("val_loss", description="metric ASHA ranks trials by")
    mode: Literal["min", "max"] = Field(
        None, description="min or max; left out (null) → the metric's own: losses min, accuracies max")
    max_concurrent_trials: PosInt | None = Field(None, description="null → planned from what the cluster has free")
    keep_warm_s: PosFloat | None = Field(
        30, description="seconds a warm worker group idle with no trial queued keeps its resources before it "
        "leaves (another sweep on the cluster may need them); null → kept until the sweep ends"
    )
    seed: Int = Field(0, description="search seed")
    asha: AshaConfig = AshaConfig()
    target: TargetConfig | None = Field(
        None, description="{metric, value, stop}: log each trial's time_to_target_s and rank by it (trials that "
        "never get there after, by tune.metric); null → rank by tune.metric")

    @model_validator(mode="before")
    @classmethod
    def _infer_mode(cls, data):
        """A spec that leaves `mode` out means the metric's own direction (so no spec can rank backwards)."""
        from raysweep.metrics import METRIC_MODES

        if isinstance(data, dict) and data.get("mode") is None:
            return {**data, "mode": METRIC_MODES.get(data.get("metric", "val_loss"), "min")}
        return data

    @model_validator(mode="after")
    def _check(self):
        from raysweep.metrics import METRIC_MODES

        _rankable(self.metric)
        better = METRIC_MODES[self.metric]
        if self.mode != better:
            higher = "higher" if better == "max" else "lower"
            raise ValueError(f"mode {self.mode!r} with metric {self.metric!r}, where {higher} is better: ASHA would "
                             f"keep the worst trials; set mode: {better}, or leave mode out (it follows the metric)")
        return self


class MlflowSection(_Section):
    tracking_uri: str | None = Field(None, description="null → sqlite mlflow.db in the working directory")
    retry_s: PosFloat = Field(
        300, description="seconds a write to the store is retried (with backoff) and a slot waits for the store "
        "before a checkpoint: a tracking server that restarts within it costs nothing; past it the sweep fails"
    )
    experiment: str | None = Field(None, description="null → the spec's name")


class SweepConfig(_Section):
    """A whole spec file."""

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")] = Field(
        "quickstart", description="MLflow experiment and Ray run directory name"
    )
    storage_path: str = Field(
        "./raysweep_results",
        description="Ray results and checkpoints: a folder, or on several machines shared storage (an NFS path or s3:// URI)",
    )
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    scaling: ScalingConfig = ScalingConfig()
    train: TrainConfig = TrainConfig()
    search: SearchConfig = SearchConfig()
    tune: TuneSection = TuneSection()
    mlflow: MlflowSection = MlflowSection()

    def sweep_problem(self) -> str | None:
        """What makes this spec unfit for `tune` (ASHA's settings against the epochs and warmup), or None.

        `train` runs no ASHA, so it never asks: a user shortening a run with `--set train.epochs=2`
        need not know about ASHA.
        """
        asha = self.tune.asha
        max_t = self.max_t
        if asha.unit == "seconds":
            budget = self.train.time_budget_s
            if max_t == math.inf:
                return ("tune.asha.unit: seconds needs a horizon in seconds; set tune.asha.max_t (training seconds) "
                        "or train.time_budget_s")
            if budget is not None and max_t > budget:
                return (f"tune.asha.max_t: {max_t:g} s exceeds train.time_budget_s {budget:g}: no trial runs that "
                        f"long; lower max_t or leave it unset (it follows the budget)")
            if asha.grace_period > max_t:
                return (f"tune.asha.grace_period: {asha.grace_period:g} s exceeds max_t {max_t:g} s "
                        f"(train.time_budget_s unless tune.asha.max_t is set); lower grace_period")
            return None
        for key in ("grace_period", "max_t"):
            value = getattr(asha, key)
            if value is not None and value != int(value):
                return (f"tune.asha.{key}: {value!r} is not a whole number of epochs; use one, or count in training "
                        f"seconds with tune.asha.unit: seconds")
        if max_t > self.train.epochs:
            return f"tune.asha.max_t: {max_t} exceeds train.epochs {self.train.epochs}; lower max_t or leave it unset"
        if asha.grace_period > max_t:
            return (f"tune.asha.grace_period: {asha.grace_period} exceeds max_t {max_t} (train.epochs unless "
                    f"tune.asha.max_t is set); lower grace_period")
        warmup = knob_largest(self.search.warmup_epochs)
        if asha.grace_period < warmup and not asha.allow_grace_within_warmup:
            return (f"tune.asha.grace_period: {asha.grace_period} is shorter than the largest warmup_epochs "
                    f"in the search ({warmup:g}): a trial cut during warmup was never judged; raise grace_period "
                    f"or set tune.asha.allow_grace_within_warmup: true")
        return None

    def check_data_fits(self, train_size: int, batch_cap: int | None = None, searched: bool = True) -> None:
        """Every rank's shard must fill its micro-batches (`epoch_plan` needs one sample each at least).

        Checks the extremes of the search (smallest and largest per-GPU batch × fewest and most
        accumulation steps), or the defaults alone when not `searched`. Raises a one-line UserError.
        """
        knobs = self.searched() if searched else {}
        batches = _extremes(knobs.get("per_gpu_batch_size")) or [self.default_knobs()["per_gpu_batch_size"]]
        accums = _extremes(knobs.get("grad_accum_steps")) or [self.default_knobs().get("grad_accum_steps",
                                                                                    self.train.grad_accum_steps)]
        for batch in batches:
            for accum in accums:
                t = self.trial({"per_gpu_batch_size": batch, "grad_accum_steps": accum}, train_size, batch_cap)
                if t.min_shard_size < t.micro_batches_per_epoch:
                    raise UserError(
                        f"data: {train_size} training images give each of {t.world_size} workers {t.min_shard_size}, "
                        f"too few for {t.micro_batches_per_epoch} micro-batches per epoch (per-GPU batch {batch} × "
                        f"{t.accumulation_steps} accumulation steps, global batch {t.global_batch_size}); use more "
                        f"training images (data.synthetic.train_size or data.train_dir), or fewer scaling.num_workers "
                        f"or grad_accum_steps"
                    )

    @property
    def max_t(self) -> float:
        """ASHA's horizon in its unit: tune.asha.max_t, else train.epochs (epochs) or train.time_budget_s (seconds;
        inf when neither is set: sweep_problem refuses it)."""
        asha = self.tune.asha
        if asha.unit == "seconds":
            return asha.max_t or self.train.time_budget_s or math.inf
        return asha.max_t or self.train.epochs

    @property
    def time_attr(self) -> str:
        """The reported metric ASHA counts in: `epoch` (worker-reported; Tune's training_iteration restarts at 1
        after a restore) or `train_seconds`."""
        return "train_seconds" if self.tune.asha.unit == "seconds" else "epoch"

    @property
    def horizon(self):
        """Where trials end on their own (metrics.Horizon): how the driver tells finished from pruned."""
        from raysweep.metrics import Horizon

        target = self.tune.target
        return Horizon(self.time_attr, self.max_t, bool(target and target.stop))

    @property
    def experiment_name(self) -> str:
        return self.mlflow.experiment or self.name

    def global_batches(self) -> list[int]:
        """Every global batch the search can sample (per-GPU batch × workers × accumulation; a range by its ends)."""
        def values(knob, fallback) -> list:
            if knob is None:
                return [fallback]
            return sorted({knob.choice[0], *knob.choice} if isinstance(knob, Choice) else set(_extremes(knob) or [knob]))

        search = self.search
        return sorted({b * self.scaling.num_workers * a for b in values(search.per_gpu_batch_size, 32)
                       for a in values(search.grad_accum_steps, self.train.grad_accum_steps)})

    def searched(self) -> dict[str, Any]:
        """Knobs with a distribution (what Tune samples), by name."""
        return {k: v for k, v in self.search.knobs().items() if isinstance(v, BaseModel)}

    def default_knobs(self) -> dict[str, Any]:
        """Every knob at its default (else first choice / lower bound): what `train` runs."""
        return {k: knob_first(v) for k, v in self.search.knobs().items()}

    def is_baseline(self, knobs: dict[str, Any]) -> bool:
        """Whether sampled knobs are the spec's defaults: the sweep's first trial, its baseline."""
        defaults = self.default_knobs()
        return all(knobs.get(k) == defaults[k] for k in self.searched())

    @property
    def batch_cap(self) -> int | str | None:
        """`search.per_gpu_batch_size.max`: a number, "probe", or None."""
        return getattr(self.search.per_gpu_batch_size, "max", None)

    def trial(self, knobs: dict[str, Any], train_size: int, batch_cap: int | None = None) -> TrialConfig:
        """One trial's full config from sampled knob values (Tune's flat dict).

        A per-GPU batch above `batch_cap` runs as a micro-batch ≤ the cap × more accumulation steps:
        the same global batch, so the same peak LR and schedule.
        """
        values = {**self.default_knobs(), **knobs}
        values.setdefault("grad_accum_steps", self.train.grad_accum_steps)
        values.setdefault("lr_rule", self.train.lr_rule)
        splits = 1 if batch_cap is None else -(-values["per_gpu_batch_size"] // batch_cap)
        return TrialConfig(
            micro_splits=splits,
            knobs=Knobs(**values),
            train=self.train,
            model=self.model,
            scaling=self.scaling,
            image=ImageSpec(
                width=self.data.width,
                height=self.data.height,
                length=self.data.length,
                num_classes=self.data.num_classes,
            ),
            train_size=train_size,
            target=self.tune.target,
        )


# ---------------------------------------------------------------------------------------------
# One trial: concrete knob values plus the sections a worker needs, and every derived value.


class Knobs(_Section):
    """Concrete values of the searchable knobs for one trial."""

    per_gpu_batch_size: PosInt
    base_lr: PosFloat
    warmup_epochs: NonNegFloat
    weight_decay: NonNegFloat
    grad_accum_steps: PosInt
    lr_rule: LrRule


class ImageSpec(_Section):
    width: PosInt
    height: PosInt
    length: PosInt
    num_classes: PosInt


class TrialConfig(_Section):
    """What every rank of one trial needs; crosses the Ray boundary as `to_dict()`."""

    knobs: Knobs
    micro_splits: PosInt = Field(1, description="micro-batches each per-GPU batch is cut into (memory cap, OOM)")
    train: TrainConfig
    model: ModelConfig
    scaling: ScalingConfig
    image: ImageSpec
    train_size: PosInt = Field(description="training images in the whole set")
    target: TargetConfig | None = Field(None, description="tune.target: the rank watches for it (TargetWatch)")

    @classmethod
    def from_dict(cls, d: dict) -> TrialConfig:
        return cls.model_validate(d)

    def to_dict(self) -> dict:
        return self.model_dump(mode="json")

    @property
    def world_size(self) -> int:
        return self.scaling.num_workers

    @property
    def global_batch_size(self) -> int:
        return self.knobs.per_gpu_batch_size * self.world_size * self.knobs.grad_accum_steps

    @property
    def peak_lr(self) -> float:
        from raysweep.optim import scaled_lr

        return scaled_lr(self.knobs.base_lr, self.global_batch_size, self.train.reference_batch_size, self.knobs.lr_rule)

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self.train_size / self.global_batch_size)

    @property
    def warmup_steps(self) -> int:
        return round(self.knobs.warmup_epochs * self.steps_per_epoch)

    @property
    def total_steps(self) -> int:
        return self.train.epochs * self.steps_per_epoch

    @property
    def micro_batch_size(self) -> int:
        """Samples per forward/backward on one rank: the per-GPU batch cut into micro_splits."""
        return -(-self.knobs.per_gpu_batch_size // self.micro_splits)

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches per optimizer step on one rank."""
        return self.knobs.grad_accum_steps * self.micro_splits

    @property
    def micro_batches_per_epoch(self) -> int:
        """Forward/backward passes per rank per epoch: every rank makes the same number."""
        return self.steps_per_epoch * self.accumulation_steps

    @property
    def min_shard_size(self) -> int:
        """Training samples of the smallest rank's shard (shards differ by at most one)."""
        return self.train_size // self.world_size

    def downshifted(self) -> TrialConfig:
        """Half the micro-batch, twice the accumulation: the same global batch, LR and steps."""
        return self.model_copy(update={"micro_splits": self.micro_splits * 2})

    def params(self) -> dict[str, Any]:
        """Every knob and derived value, flat: the MLflow params of a trial."""
        return {
            **self.knobs.model_dump(),
            "global_batch_size": self.global_batch_size,
            "peak_lr": self.peak_lr,
            "steps_per_epoch": self.steps_per_epoch,
            "warmup_steps": self.warmup_steps,
            "total_steps": self.total_steps,
            "world_size": self.world_size,
            "precision": self.train.precision,
            "epochs": self.train.epochs,
            "train_size": self.train_size,
            "reference_batch_size": self.train.reference_batch_size,
            "min_lr": self.train.min_lr,
            "grad_clip": self.train.grad_clip,
        }


# ---------------------------------------------------------------------------------------------
# YAML loading, overrides, error lines.


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads `1e-4` as a float (YAML 1.1, which PyYAML follows, needs `1.0e-4`)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def parse_yaml(text: str, source: str) -> Any:
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1} column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise UserError(f"{source}:{where}: invalid YAML: {problem}") from None


def load_config(path: str | Path, overrides: list[str] = (), sweep: bool = True) -> SweepConfig:
    """Read a spec file, apply `--set dotted.key=value` overrides, validate (`sweep`: for `tune` too)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such spec file (see search_spaces/ for examples)")
    raw = parse_yaml(path.read_text(), str(path))
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise UserError(f"{path}: expected a mapping of sections (name, data, train, ...), got {type(raw).__name__}")
    overridden = {}
    for item in overrides:
        key, value = _apply_override(raw, item)
        overridden[key] = item
    try:
        config = SweepConfig.model_validate(raw)
    except ValidationError as e:
        raise UserError(_describe(e, str(path), overridden)) from None
    _check_paths(config, str(path))
    problem = config.sweep_problem() if sweep else None
    if problem:
        raise UserError(f"{_source(str(path), problem.split(':', 1)[0], overridden)}: {problem}")
    return config


def _apply_override(raw: dict, item: str) -> tuple[str, Any]:
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise UserError(f"--set {item!r}: expected dotted.key=value, e.g. --set train.epochs=2")
    value = parse_yaml(text, f"--set {key}")
    node = raw
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise UserError(f"--set {item}: '{'.'.join(parts[: i + 1])}' is a value, not a section")
        node = child
    node[parts[-1]] = value
    return key, value


def _check_paths(config: SweepConfig, source: str) -> None:
    for key in ("train_dir", "val_dir"):
        folder = getattr(config.data, key)
        if folder is not None and not folder.is_dir():
            raise UserError(
                f"{source}: data.{key}: no such folder {str(folder)!r} (relative paths start from the "
                f"working directory; set data.{key}: null for the synthetic set)"
            )


def _dotted(loc: tuple) -> str:
    """`('search', 'base_lr', 'loguniform', 'loguniform', 0)` → `search.base_lr.loguniform[0]`."""
    out = ""
    previous = None
    for part in loc:
        knob_tag = part == "value" and previous in SearchConfig.model_fields  # a fixed knob's tag, not a key
        if knob_tag or part == previous or (isinstance(part, str) and "[" in part):
            previous = part
            continue  # discriminator tags and generic class names, not keys the user wrote
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
        previous = part
    return out


def _fields_at(loc: tuple) -> list[str]:
    """Valid key names of the section at `loc` (for 'did you mean')."""
    cls: Any = SweepConfig
    for part in loc:
        if cls is SearchConfig and part in SearchConfig.model_fields:
            cls = "knob"  # next comes the discriminator tag naming the distribution
            continue
        if cls == "knob":
            cls = DISTRIBUTIONS.get(part)
            continue
        if not (isinstance(cls, type) and issubclass(cls, BaseModel)) or part not in cls.model_fields:
            return []
        cls = _model_in(cls.model_fields[part].annotation)
    return list(cls.model_fields) if isinstance(cls, type) and issubclass(cls, BaseModel) else []


def _model_in(annotation) -> Any:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _source(source: str, key: str, overridden: dict[str, str]) -> str:
    """The file, plus the `--set` that wrote `key` (or a section above it), if one did."""
    for dotted, item in overridden.items():
        if key == dotted or key.startswith(dotted + ".") or key.startswith(dotted + "["):
            source = f"{source} (--set {item})"
    return source


def _describe(error: ValidationError, source: str, overridden: dict[str, str]) -> str:
    """One line for the first validation error: where, what, the value, the fix."""
    errors = error.errors()
    err = errors[0]
    loc, value, kind = err["loc"], err.get("input"), err["type"]
    key = _dotted(loc)
    source = _source(source, key, overridden)
    if kind == "extra_forbidden":
        name = loc[-1]
        valid = _fields_at(loc[:-1])
        close = difflib.get_close_matches(str(name), valid, n=1, cutoff=0.5)
        hint = f"did you mean '{close[0]}'?" if close else ("valid keys: " + ", ".join(valid) if valid else "remove it")
        message = f"unknown key '{name}' ({hint})"
    elif kind in ("float_type", "int_type", "float_parsing", "int_parsing") and isinstance(value, str):
        message = f"expected a number, got {value!r}"
        if re.fullmatch(r"\s*[-+]?[0-9.]+[eE][-+]?[0-9]+\s*", value):
            message += f" (write it unquoted, e.g. {float(value)!r})"
    elif kind in ("float_type", "int_type") and isinstance(value, bool):
        message = f"expected a number, got {value!r}"
    elif kind == "int_type" and isinstance(value, float):
        message = f"expected a whole number, got {value!r}"
    elif kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        bound = next(iter(err["ctx"].values()))
        words = {"greater_than": "above", "greater_than_equal": "at least", "less_than": "below", "less_than_equal": "at most"}
        message = f"must be {words[kind]} {bound}, got {value!r}"
    elif kind == "union_tag_invalid":
        allowed = err["ctx"]["expected_tags"].replace("'value'", "a plain value")
        message = f"'{err['ctx']['tag']}' is not allowed here; use {allowed}"
    elif kind == "union_tag_not_found":
        message = f"expected a plain value or exactly one of {', '.join(DISTRIBUTIONS)}, got {value!r}"
    elif kind == "literal_error":
        message = f"got {value!r}, expected {err['ctx']['expected']}"
    elif kind == "value_error":
        message = str(err["ctx"]["error"])
    elif kind == "missing":
        message = "missing required key"
    else:
        message = f"{err['msg'][0].lower()}{err['msg'][1:]}, got {value!r}"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    where = f"{key}: " if key else ""
    return f"{source}: {where}{message}{more}"


def spec_yaml(config: SweepConfig) -> str:
    """The resolved spec as YAML (every default filled in): logged with each sweep."""
    return yaml.safe_dump(config.model_dump(mode="json", exclude_none=False), sort_keys=False)


def iter_keys(cls: type[BaseModel] = None, prefix: str = ""):
    """(dotted key, default, description) for every key of the schema (README's table is made from it)."""
    cls = cls or SweepConfig
    for name, field in cls.model_fields.items():
        sub = _model_in(field.annotation)
        if sub is not None and cls is not SearchConfig:  # a section, not a knob
            yield from iter_keys(sub, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", field.default, field.description or ""
