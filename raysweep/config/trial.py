"""One trial: its concrete knob values, the sections a worker needs and every derived value (`TrialConfig`),
and the factory that makes one from the spec and a sampled knob dict (`TrialFactory`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from raysweep.config.fields import LrRule, NonNegFloat, PosFloat, PosInt, Section
from raysweep.config.knobs import Choice, knob_extremes, knob_first
from raysweep.config.sections import ModelConfig, ScalingConfig, SearchConfig, TargetConfig, TrainConfig
from raysweep.errors import UserError


class Knobs(Section):
    """Concrete values of the searchable knobs for one trial."""

    per_gpu_batch_size: PosInt
    base_lr: PosFloat
    warmup_epochs: NonNegFloat
    weight_decay: NonNegFloat
    grad_accum_steps: PosInt
    lr_rule: LrRule


class ImageSpec(Section):
    """The images a model takes and what it predicts: what a model factory is called with (raysweep/models.py).

    The model maps float images (N, channels, height, width) in [0, 1] to logits for every (position, character):
    (N, length, num_classes), or flat, (N, length × num_classes)."""

    width: PosInt = Field(description="image width, pixels")
    height: PosInt = Field(description="image height, pixels")
    length: PosInt = Field(description="characters per captcha: the positions to predict")
    num_classes: PosInt = Field(description="characters in the charset: the logits per position")
    channels: Literal[1, 3] = Field(1, description="1 grayscale, 3 RGB")


SEED = "seed"  # a sampled dict's key beside the knobs: a `confirm` run's train.seed for this trial


def divisor_at_least(n: int, k: int) -> int | None:
    """The smallest divisor of `n` that is ≥ `k` (None: none is, k > n): how many equal micro-batches a per-GPU
    batch of n is cut into when at least k are needed."""
    return next((d for d in range(max(k, 1), n + 1) if n % d == 0), None)


class TrialConfig(Section):
    """What every rank of one trial needs; crosses the Ray boundary as `to_dict()`."""

    knobs: Knobs
    micro_splits: PosInt = Field(
        1, description="equal micro-batches each per-GPU batch is cut into (memory cap, OOM); it divides the batch")
    train: TrainConfig
    model: ModelConfig
    scaling: ScalingConfig
    image: ImageSpec
    train_size: PosInt = Field(description="training images in the whole set")
    target: TargetConfig | None = Field(
        None, description="tune.target: the ranks watch for it (worker/run.TrainingRun.watch_target)")

    @model_validator(mode="after")
    def _whole_micro_batches(self):
        if self.knobs.per_gpu_batch_size % self.micro_splits:
            raise ValueError(f"micro_splits {self.micro_splits} does not divide per_gpu_batch_size "
                             f"{self.knobs.per_gpu_batch_size}: a step would not take the whole batch")
        return self

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

        return scaled_lr(self.knobs.base_lr, self.global_batch_size, self.train.reference_batch_size,
                         self.knobs.lr_rule)

    @property
    def steps_per_epoch(self) -> int:
        """Whole optimizer steps an epoch: floor(train_size / global batch), DistributedSampler's and the DataLoader's
        drop_last (every rank takes train_size // world_size, then whole steps of per-GPU × accumulation from it;
        floor(floor(n / w) / (b·a)) = floor(n / (w·b·a))). The samples left over sit out this epoch, others the
        next (shard.epoch_plan). 0 when the global batch exceeds the set: TrialFactory.check_data_fits refuses it."""
        return self.train_size // self.global_batch_size

    @property
    def samples_per_epoch(self) -> int:
        """Training samples an epoch takes, all ranks: whole steps of the global batch."""
        return self.steps_per_epoch * self.global_batch_size

    @property
    def warmup_steps(self) -> int:
        return round(self.knobs.warmup_epochs * self.steps_per_epoch)

    @property
    def total_steps(self) -> int:
        return self.train.epochs * self.steps_per_epoch

    @property
    def micro_batch_size(self) -> int:
        """Samples per forward/backward on one rank: the per-GPU batch cut into micro_splits equal parts."""
        return self.knobs.per_gpu_batch_size // self.micro_splits

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches per optimizer step on one rank."""
        return self.knobs.grad_accum_steps * self.micro_splits

    @property
    def micro_batches_per_epoch(self) -> int:
        """Forward/backward passes per rank per epoch: every rank makes the same number."""
        return self.steps_per_epoch * self.accumulation_steps

    @property
    def rank_share(self) -> int:
        """Training samples each rank is dealt an epoch (train_size // world_size: shard.epoch_plan); its steps are
        taken whole from it."""
        return self.train_size // self.world_size

    @property
    def can_downshift(self) -> bool:
        return self.micro_batch_size > 1

    def downshifted(self) -> TrialConfig:
        """About half the micro-batch (the largest one that divides the per-GPU batch and is at most half the current
        one), and as many more accumulation steps: the same global batch, LR and steps."""
        splits = divisor_at_least(self.knobs.per_gpu_batch_size, 2 * self.micro_splits)
        if splits is None:
            raise ValueError(f"micro-batch {self.micro_batch_size} cannot be cut further")
        return self.model_copy(update={"micro_splits": splits})

    def params(self) -> dict[str, Any]:
        """Every knob and derived value, flat: the MLflow params of a trial."""
        return {
            **self.knobs.model_dump(),
            "global_batch_size": self.global_batch_size,
            "peak_lr": self.peak_lr,
            "steps_per_epoch": self.steps_per_epoch,
            "samples_per_epoch": self.samples_per_epoch,
            "warmup_steps": self.warmup_steps,
            "total_steps": self.total_steps,
            "world_size": self.world_size,
            "precision": self.train.precision,
            "epochs": self.train.epochs,
            "train_size": self.train_size,
            "reference_batch_size": self.train.reference_batch_size,
            "min_lr": self.train.min_lr,
            "grad_clip": self.train.grad_clip,
            "seed": self.train.seed,
            "model.factory": self.model.name,
            "model.kwargs": json.dumps(self.model.factory_kwargs(), sort_keys=True),
        }


@dataclass(frozen=True)
class TrialFactory:
    """The spec's slice that makes trials: sampled knobs → `TrialConfig`, the defaults, the search's extremes.

    Holds only the sections a trial reads, so it is small to pickle to Tune's trial actors.
    """

    search: SearchConfig
    train: TrainConfig
    model: ModelConfig
    scaling: ScalingConfig
    image: ImageSpec
    target: TargetConfig | None = None

    def searched(self) -> dict[str, Any]:
        """Knobs with a distribution (what Tune samples), by name."""
        return {k: v for k, v in self.search.knobs().items() if isinstance(v, BaseModel)}

    def default_knobs(self) -> dict[str, Any]:
        """Every knob at its default (else first choice / lower bound): what `train` runs."""
        return {k: knob_first(v) for k, v in self.search.knobs().items()}

    def is_baseline(self, knobs: dict[str, Any]) -> bool:
        """Whether sampled knobs are the spec's defaults: the sweep's first trial, its baseline (a `confirm` run's
        seeds, which carry SEED, are never one)."""
        if SEED in knobs:
            return False
        defaults = self.default_knobs()
        return all(knobs.get(k) == defaults[k] for k in self.searched())

    @property
    def batch_cap(self) -> int | str | None:
        """`search.per_gpu_batch_size.max`: a number, "probe", or None."""
        return getattr(self.search.per_gpu_batch_size, "max", None)

    def global_batches(self) -> list[int]:
        """Every global batch the search can sample (per-GPU batch × workers × accumulation; a range by its ends)."""
        def values(knob, fallback) -> list:
            if knob is None:
                return [fallback]
            return sorted({knob.choice[0], *knob.choice} if isinstance(knob, Choice)
                          else set(knob_extremes(knob) or [knob]))

        search = self.search
        return sorted({b * self.scaling.num_workers * a for b in values(search.per_gpu_batch_size, 32)
                       for a in values(search.grad_accum_steps, self.train.grad_accum_steps)})

    def trial(self, knobs: dict[str, Any], train_size: int, batch_cap: int | None = None) -> TrialConfig:
        """One trial's full config from sampled knob values (Tune's flat dict; SEED, where given, its train.seed).

        A per-GPU batch above `batch_cap` runs as equal micro-batches ≤ the cap (the largest that divide it) × more
        accumulation steps: the same global batch, so the same peak LR and schedule.
        """
        values = {**self.default_knobs(), **knobs}
        seed = values.pop(SEED, None)  # a confirm run's seed: its train.seed
        train = self.train if seed is None else self.train.model_copy(update={"seed": int(seed)})
        values.setdefault("grad_accum_steps", self.train.grad_accum_steps)
        values.setdefault("lr_rule", self.train.lr_rule)
        batch = values["per_gpu_batch_size"]
        splits = 1 if batch_cap is None else divisor_at_least(batch, -(-batch // batch_cap))
        return TrialConfig(
            micro_splits=splits,
            knobs=Knobs(**values),
            train=train,
            model=self.model,
            scaling=self.scaling,
            image=self.image,
            train_size=train_size,
            target=self.target,
        )

    def check_data_fits(self, train_size: int, batch_cap: int | None = None, searched: bool = True,
                        source: str = "") -> None:
        """Every trial the search can draw runs the batch it logs, on every rank's share of the training set.

        A rank's share (train_size // workers) must hold one whole optimizer step at the asked per-GPU batch ×
        accumulation (steps are taken whole, the rest of the share sits out: TrialConfig.steps_per_epoch). Refused
        rather than capped: a capped trial would duplicate the cap's trial under another name, and the search would
        model a knob that changes nothing. Checks the largest step the search can draw (largest per-GPU batch × most
        accumulation steps; every smaller one fits if it does), or the defaults alone when not `searched`. Raises
        a one-line UserError (`source`: the spec file, to start it with).
        """
        knobs = self.searched() if searched else {}
        defaults = self.default_knobs()
        batches = knob_extremes(knobs.get("per_gpu_batch_size")) or [defaults["per_gpu_batch_size"]]
        accums = knob_extremes(knobs.get("grad_accum_steps")) or [defaults.get("grad_accum_steps",
                                                                              self.train.grad_accum_steps)]
        where = f"{source}: " if source else ""
        for batch in batches:
            for accum in accums:
                t = self.trial({"per_gpu_batch_size": batch, "grad_accum_steps": accum}, train_size, batch_cap)
                share = t.rank_share
                if batch * accum > share:
                    most = max(share // accum, 1)
                    raise UserError(
                        f"{where}search.per_gpu_batch_size: {batch} × {accum} accumulation step(s) is more than a "
                        f"rank's share of the training set ({train_size:,} images over {t.world_size} workers: "
                        f"{share:,} each), so not one whole step fits in an epoch; the largest per-GPU batch this "
                        f"data runs is {most:,}: lower the batch, or use more training images")
