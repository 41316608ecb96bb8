"""The spec's sections below the top level: data, model, scaling, train, search, tune (with asha and target), mlflow.

Field names are public API (specs, `--set`, docs/reference/spec.md); each field's
description is its line there (docs/gen.py).
"""

from __future__ import annotations

import difflib
import string
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, Strict, field_validator, model_validator

from raysweep.config.fields import (
    Auto,
    Float,
    Int,
    LrRule,
    NonNegFloat,
    NonNegInt,
    PosFloat,
    PosInt,
    PosNumber,
    Precision,
    Section,
)
from raysweep.config.knobs import Knob

DEFAULT_CHARSET = string.digits + string.ascii_uppercase
MAX_CHARSET = 256  # labels are uint8 indices into the charset (data.CaptchaArrays)


class SyntheticConfig(Section):
    """The embedded default data set, generated with `captcha.image.ImageCaptcha`."""

    train_size: PosInt = Field(512, description="training images")
    val_size: PosInt = Field(128, description="validation images")
    seed: Int = Field(0, description="generation seed (same seed → same images)")


class DataConfig(Section):
    train_dir: Path | None = Field(None, description="folder of TEXT_anything.png; null → synthetic set")
    val_dir: Path | None = Field(None, description="validation folder; null → hold out val_fraction of train_dir")
    val_fraction: Annotated[float, Strict(), Field(gt=0, lt=1)] = Field(0.1, description="held-out share of train_dir")
    charset: str = Field(DEFAULT_CHARSET, min_length=2, description="characters a captcha may contain")
    length: PosInt = Field(4, description="characters per captcha")
    width: Annotated[int, Strict(), Field(ge=8)] = Field(160, description="image width, pixels")
    height: Annotated[int, Strict(), Field(ge=8)] = Field(60, description="image height, pixels")
    channels: Literal[1, 3] = Field(
        1, description="colour channels the model takes: 1 grayscale, 3 RGB (transparency laid on white either way)")
    synthetic: SyntheticConfig = SyntheticConfig()

    @field_validator("charset")
    @classmethod
    def _charset(cls, charset: str) -> str:
        if len(set(charset)) != len(charset):
            raise ValueError("repeats a character")
        if len(charset) > MAX_CHARSET:
            raise ValueError(f"{len(charset)} characters, at most {MAX_CHARSET} (a label's characters are stored one "
                             f"byte each); keep only the characters the labels use")
        return charset

    @model_validator(mode="after")
    def _check(self):
        if self.val_dir is not None and self.train_dir is None:
            raise ValueError("val_dir is set but train_dir is not; set both, or neither for the synthetic set")
        return self

    @property
    def num_classes(self) -> int:
        return len(self.charset)


DEFAULT_MODEL = "captcha_cnn"
BUILTIN_MODELS = {"captcha_cnn": "raysweep.model:captcha_cnn"}  # a built-in model's name → its factory (models.py)
_NAME = r"[A-Za-z_][A-Za-z0-9_]*"
FACTORY_PATTERN = rf"^{_NAME}(\.{_NAME})*:{_NAME}(\.{_NAME})*$"  # package.module:function (or Class.method)


class ModelConfig(Section):
    """The network the loop trains: raysweep's captcha CNN, or a user's, named by its factory (raysweep/models.py
    has the contract; docs/your-model.md)."""

    factory: str | None = Field(
        None, description="\"package.module:function\" returning the nn.Module to train (called with the image spec "
        "and model.kwargs), or a built-in's name (captcha_cnn); null → raysweep's captcha CNN")
    kwargs: dict[str, Any] = Field(
        {}, description="keyword arguments for the factory (plain YAML values)")
    dropout: Annotated[float, Strict(), Field(ge=0, lt=1)] | None = Field(
        None, description="the built-in CNN's dropout probability; null → 0.5 (a model of your own takes its own "
        "settings in model.kwargs)")
    find_unused_parameters: bool = Field(
        False, description="DDP's find_unused_parameters: true for a model whose forward leaves a parameter without a "
        "gradient in some steps (costs a pass over the autograd graph every step); false: such a model is refused "
        "by the check before Ray")

    @field_validator("factory")
    @classmethod
    def _factory(cls, factory: str | None) -> str | None:
        import re

        if factory is None or factory in BUILTIN_MODELS:
            return factory
        if not re.match(FACTORY_PATTERN, factory):
            raise ValueError(f"{factory!r} is not \"package.module:function\" (a module path, a colon, the name of "
                             f"the function in it) nor a built-in model ({', '.join(BUILTIN_MODELS)})")
        return factory

    @model_validator(mode="after")
    def _dropout_is_the_cnns(self):
        if not self.builtin and self.dropout is not None:
            raise ValueError("dropout is the built-in CNN's; a model of your own takes its own settings in "
                             "model.kwargs (e.g. kwargs: {dropout: 0.3})")
        if self.builtin and "dropout" in self.kwargs and self.dropout is not None:
            raise ValueError("dropout is set twice (model.dropout and model.kwargs.dropout); keep one")
        return self

    @property
    def builtin(self) -> bool:
        """Whether this is raysweep's own CNN (no user code to check or ship)."""
        return self.factory in (None, *BUILTIN_MODELS)

    @property
    def name(self) -> str:
        """The factory as the plan line, MLflow and answer.json name it."""
        return (self.factory or DEFAULT_MODEL) if self.builtin else self.factory

    def factory_kwargs(self) -> dict[str, Any]:
        """What the factory is called with beside the image spec: model.kwargs, and for the built-in CNN its
        dropout (model.dropout, else 0.5)."""
        if not self.builtin:
            return dict(self.kwargs)
        return {"dropout": 0.5 if self.dropout is None else self.dropout, **self.kwargs}


class ScalingConfig(Section):
    """One trial's Ray Train worker group."""

    num_workers: PosInt = Field(2, description="DDP ranks per trial (one GPU each when use_gpu)")
    use_gpu: bool = Field(False, description="one GPU per worker, NCCL; false → CPU workers, gloo")
    workers_per_gpu: PosInt = Field(
        1, description="with use_gpu, how many workers share one GPU: each holds 1/k of it in Ray and in memory, "
        "over gloo (NCCL refuses two ranks on one GPU). For testing a trial's several ranks on a one-GPU machine, "
        "not for speed: gloo moves the gradients through the host"
    )
    cpus_per_worker: PosFloat = Field(1, description="CPUs reserved per worker (sets its OMP threads)")
    worker_start_timeout_s: PosFloat = Field(
        60, description="a worker group not started by then fails its trial instead of waiting forever"
    )
    max_setup_failures: PosInt = Field(
        3, description="a warm group whose set-up (device, data, process group) fails this many times in a row ends "
        "its slot; its trial fails (failure: infra), and while no group of the shape ever set up, so do the others"
    )

    @model_validator(mode="after")
    def _check(self):
        if self.workers_per_gpu > 1 and not self.use_gpu:
            raise ValueError(f"workers_per_gpu {self.workers_per_gpu} needs use_gpu: true (CPU workers share no GPU); "
                             f"set workers_per_gpu: 1")
        if self.workers_per_gpu > self.num_workers:
            raise ValueError(f"workers_per_gpu {self.workers_per_gpu} is more than num_workers {self.num_workers}; "
                             f"set it to {self.num_workers} at most")
        return self

    @property
    def gpus_per_worker(self) -> float:
        """What one worker holds of a GPU (Ray's resource, and its share of the device's memory); 0 on CPU."""
        return 1.0 / self.workers_per_gpu if self.use_gpu else 0.0

    @property
    def shares_gpu(self) -> bool:
        """Several ranks on one GPU: gloo instead of NCCL, each rank's memory capped to its share."""
        return self.use_gpu and self.workers_per_gpu > 1

    @property
    def gpus(self) -> float:
        """GPUs one trial's group holds."""
        return self.num_workers * self.gpus_per_worker


class TrainConfig(Section):
    epochs: PosInt = Field(6, description="epochs per trial; with time_budget_s, the most a trial may run")
    time_budget_s: PosFloat | None = Field(
        None, description="training seconds per trial (start-up excluded): a trial times its epochs while still in "
        "warmup and fixes the epochs (at most train.epochs; its cosine fitted to them) that fill the budget; "
        "null → train.epochs"
    )
    precision: Precision = Field(
        "auto", description="autocast dtype: fp32, bf16, fp16 (adds a GradScaler), or auto: bf16 on GPUs that "
        "support it and on CPUs with AVX512-BF16 or AMX, else fp32"
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


class SearchConfig(Section):
    """The trial knobs. A plain value fixes a knob; a distribution searches it."""

    per_gpu_batch_size: Knob(PosInt, "choice", "randint") = Field(32, description="micro-batch per worker")
    base_lr: Knob(PosFloat, "choice", "uniform", "loguniform") = Field(1.0e-3, description="LR at reference_batch_size")
    warmup_epochs: Knob(NonNegFloat, "choice", "uniform", "randint", whole=NonNegInt) = Field(
        1, description="linear warmup, epochs")
    weight_decay: Knob(NonNegFloat, "choice", "uniform", "loguniform") = Field(
        1.0e-4, description="AdamW decoupled decay")
    grad_accum_steps: Knob(PosInt, "choice", "randint") | None = Field(
        None, description="null → train.grad_accum_steps")
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


class AshaConfig(Section):
    unit: Literal["epochs", "seconds"] = Field(
        "epochs", description="what ASHA's rungs count: epochs, or training seconds (train_seconds): batches "
        "compared by the time they cost, not the epochs they ran")
    max_t: PosNumber | None = Field(
        None, description="the most a trial runs, in the unit; null → train.epochs (seconds: train.time_budget_s)")
    grace_period: PosNumber = Field(2, description="what every trial gets before it can be stopped, in the unit")
    reduction_factor: Annotated[float, Strict(), Field(gt=1)] = Field(
        2, description="keep 1/reduction_factor at each rung")
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


class TargetConfig(Section):
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


class TuneSection(Section):
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
    search: Literal["random", "tpe"] = Field(
        "random", description="how trials are drawn: random (independent samples) or tpe (Optuna's TPE through "
        "Tune: each trial drawn from what the finished and pruned ones scored); the baseline runs first either way")
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


class MlflowSection(Section):
    tracking_uri: str | None = Field(None, description="null → sqlite mlflow.db in the working directory")
    retry_s: PosFloat = Field(
        300, description="seconds a write to the store is retried (with backoff) and a slot waits for the store "
        "before a checkpoint: a tracking server that restarts within it costs nothing; past it the sweep fails"
    )
    experiment: str | None = Field(None, description="null → the spec's name")
