"""The whole spec (`SweepConfig`): its top-level keys, the sections, what makes it unfit for `tune`, ASHA's
horizon, and the trial factory (`SweepConfig.trials`) built from its sections."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, Field, PrivateAttr

from raysweep.config.fields import Section
from raysweep.config.knobs import knob_first, knob_largest
from raysweep.config.sections import (
    DataConfig,
    MlflowSection,
    ModelConfig,
    ScalingConfig,
    SearchConfig,
    TrainConfig,
    TuneSection,
)
from raysweep.config.trial import ImageSpec, TrialFactory


class SweepConfig(Section):
    """A whole spec file."""

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")] = Field(
        "quickstart", description="MLflow experiment and Ray run directory name (a spec file without one: the file's "
                                  "name without .yaml)"
    )
    storage_path: str = Field(
        "./raysweep_results",
        description="Ray results and checkpoints: a folder, or on several machines shared storage (an NFS path or "
        "s3:// URI)",
    )
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    scaling: ScalingConfig = ScalingConfig()
    train: TrainConfig = TrainConfig()
    search: SearchConfig = SearchConfig()
    tune: TuneSection = TuneSection()
    mlflow: MlflowSection = MlflowSection()
    _source: str = PrivateAttr("")  # the spec file (and --set overrides) it was read from: load_config sets it
    _args: str = PrivateAttr("")  # the same as a command's arguments: `spec.yaml --set k=v` (load_config sets it)
    _spec_dir: str | None = PrivateAttr(None)  # the spec file's folder (load_config sets it): a factory's module is
    # looked for there too (model_search_path)

    @property
    def source(self) -> str:
        """Where this spec came from, to start an error line with: `spec.yaml` or `spec.yaml (--set k=v)`."""
        return self._source

    @property
    def model_search_path(self) -> list[Path]:
        """Where model.factory's module is looked for beside the installed packages, in order: the working directory
        (as `python -m` puts it first), then the spec file's folder."""
        folders = [Path(os.getcwd())]
        if self._spec_dir is not None and Path(self._spec_dir) != folders[0]:
            folders.append(Path(self._spec_dir))
        return folders

    @property
    def command_args(self) -> str | None:
        """The spec file and its --set overrides as a command takes them (`raysweep confirm <this>`); None for a
        spec not read from a file."""
        return self._args or None

    def trial_problem(self, searched: bool = True) -> str | None:
        """What makes a trial of this spec unable to do what it logs, or None: a warmup as long as the trial never
        reaches the peak LR it logs. Each command checks what it runs: `tune` (`searched`) every warmup the search
        can draw, `train` the default it runs."""
        knob, epochs = self.search.warmup_epochs, self.train.epochs
        warmup = knob_largest(knob) if searched else knob_first(knob)
        if warmup >= epochs:
            if not isinstance(knob, BaseModel):
                which = f"warmup_epochs ({warmup:g})"
            elif searched:
                which = f"the largest warmup_epochs in the search ({warmup:g})"
            else:
                which = f"the default warmup_epochs ({warmup:g}), which `train` runs,"
            return (f"search.warmup_epochs: {which} is not shorter than train.epochs ({epochs}): a "
                    f"trial would end before its LR reaches peak_lr; lower warmup_epochs below {epochs} (or raise "
                    f"train.epochs)")
        return None

    def sweep_problem(self) -> str | None:
        """What makes this spec unfit for `tune` (ASHA's settings against the epochs and warmup), or None.

        `train` runs no ASHA, so it never asks: a user shortening a run with `--set train.epochs=2`
        need not know about ASHA (only that a warmup must end before the run does: trial_problem).
        """
        if self.tune.search == "tpe" and not self.trials.searched():
            return ("tune.search: tpe has no searched knob to model; give one a distribution (e.g. search.base_lr: "
                    "{loguniform: [1.0e-4, 3.0e-3]}) or use tune.search: random")
        problem = self.trial_problem()
        if problem:
            return problem
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
        if warmup >= max_t:  # ASHA ends every trial at max_t: one whose warmup lasts as long never reaches its peak
            return (f"search.warmup_epochs: the largest warmup ({warmup:g}) is not shorter than tune.asha.max_t "
                    f"({max_t}), where every trial ends; lower warmup_epochs below {max_t} (or raise max_t)")
        if asha.grace_period < warmup and not asha.allow_grace_within_warmup:
            return (f"tune.asha.grace_period: {asha.grace_period} is shorter than the largest warmup_epochs "
                    f"in the search ({warmup:g}): a trial cut during warmup was never judged; raise grace_period, "
                    f"lower the largest warmup_epochs, or set tune.asha.allow_grace_within_warmup: true")
        return None

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

    @property
    def trials(self) -> TrialFactory:
        """The slice that makes trials (search, train, model, scaling, the image shape, tune.target)."""
        data = self.data
        return TrialFactory(
            search=self.search,
            train=self.train,
            model=self.model,
            scaling=self.scaling,
            image=ImageSpec(width=data.width, height=data.height, length=data.length, num_classes=data.num_classes,
                            channels=data.channels),
            target=self.tune.target,
        )
