"""The sweep spec: YAML → typed, validated `SweepConfig`; `--set` overrides; derived trial values.

Key names are public API (specs, `--set`, docs/reference/spec.md). Unknown keys are errors. Every bad input becomes
one `UserError` line naming the file, the dotted key, the value and the fix.

  fields.py    strict number types, choice literals, the frozen `Section` base
  knobs.py     a knob: a fixed value or one distribution (Choice, Uniform, LogUniform, RandInt)
  sections.py  the spec's sections: data, model, scaling, train, search, tune (asha, target), mlflow
  spec.py      `SweepConfig`, the whole spec: sweep_problem, ASHA's horizon, `trials`
  trial.py     one trial (`TrialConfig` and its derived values) and `TrialFactory`, which makes them
  load.py      YAML, `--set` overrides, one-line errors, spec_yaml, iter_keys
"""

from __future__ import annotations

from raysweep.config.knobs import Choice, LogUniform, RandInt, Uniform
from raysweep.config.load import STORE_KEY, command_args, iter_keys, load_config, parse_yaml, spec_yaml
from raysweep.config.sections import (
    DEFAULT_CHARSET,
    AshaConfig,
    DataConfig,
    MlflowSection,
    ModelConfig,
    ScalingConfig,
    SearchConfig,
    SyntheticConfig,
    TargetConfig,
    TrainConfig,
    TuneSection,
)
from raysweep.config.spec import SweepConfig
from raysweep.config.trial import ImageSpec, Knobs, TrialConfig, TrialFactory

# what the rest of raysweep imports; the schema's building blocks stay in their modules (fields.py, knobs.py)
__all__ = [
    "Choice", "LogUniform", "RandInt", "Uniform",
    "STORE_KEY", "command_args", "iter_keys", "load_config", "parse_yaml", "spec_yaml",
    "DEFAULT_CHARSET", "AshaConfig", "DataConfig", "MlflowSection", "ModelConfig", "ScalingConfig", "SearchConfig",
    "SyntheticConfig", "TargetConfig", "TrainConfig", "TuneSection",
    "SweepConfig",
    "ImageSpec", "Knobs", "TrialConfig", "TrialFactory",
]
