"""Which knob mattered: each searched knob's share of the ranking metric's variance over the sweep's trials, by
fANOVA (Optuna's FanovaImportanceEvaluator: a random forest fitted to (knobs → metric), its variance split by knob;
Hutter et al., ICML 2014), from the store alone.

The trials compared are the finished and the pruned ones, each at a budget they all reached: the least any of
them ran, in ASHA's unit (epochs, or training seconds), each trial's value taken at its first report at or past it
(where ASHA records a trial at a rung). A pruned trial's last value and a finished trial's final one are values at
different budgets; fitted together they would credit whatever made trials run longer. Failed trials carry no
value and are left out.

The knobs and their ranges come from the spec the sweep logged (its `search:` section): what the search could
vary, whatever the trials happened to draw.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from raysweep.metrics import FINISHED, PRUNED, RunRecord, SweepRecord

# fewer finished and pruned trials than this: no importance. A forest on three trials split the variance 50/50
# between two knobs (tests/test_report.py's sweep, seen): on so few points the split is chance
MIN_TRIALS = 5
SHORT = {"per_gpu_batch_size": "b", "base_lr": "lr", "warmup_epochs": "w", "weight_decay": "wd",
         "grad_accum_steps": "acc", "lr_rule": ""}  # a trial named by its settings: b64 lr1.0e-3 w1


@dataclass(frozen=True)
class Knob:
    """A searched knob as the spec gave it: its name, kind (choice, uniform, loguniform, randint) and range."""

    name: str
    kind: str
    values: tuple  # choice: the choices; otherwise (low, high)

    @property
    def log(self) -> bool:
        return self.kind == "loguniform"

    def distribution(self):
        from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

        if self.kind == "choice":
            return CategoricalDistribution(list(self.values))
        if self.kind == "randint":
            return IntDistribution(int(self.values[0]), int(self.values[1]))
        return FloatDistribution(float(self.values[0]), float(self.values[1]), log=self.log)

    def value(self, param: str) -> Any:
        """A run's param (a string) as this knob's value; ValueError when it is not one."""
        if self.kind == "choice":
            found = [v for v in self.values if str(v) == param]
            if not found:
                raise ValueError(f"{param!r} is not one of {self.values}")
            return found[0]
        number = float(param)
        return int(number) if self.kind == "randint" else number

    def show(self, value: Any) -> str:
        """A value as a trial's label shows it: 64, 1.0e-03 → 1.0e-3, 0.5."""
        if isinstance(value, float) and (self.log or (value != 0 and abs(value) < 1e-2)):
            mantissa, exponent = f"{value:.1e}".split("e")
            return f"{mantissa}e{int(exponent)}"
        return f"{value:g}" if isinstance(value, float) else str(value)


def _logged_spec(spec_text: str) -> dict:
    """The spec a sweep logged (spec.yaml on its parent run), as YAML; {} when it cannot be read."""
    import yaml

    try:
        spec = yaml.safe_load(spec_text or "")
    except yaml.YAMLError:
        return {}
    return spec if isinstance(spec, dict) else {}


def searched_knobs(spec_text: str) -> list[Knob]:
    """The knobs the logged spec searched, in its order ([] when it searched none or cannot be read)."""
    search = _logged_spec(spec_text).get("search") or {}
    knobs = []
    for name, value in search.items():
        if isinstance(value, dict):
            kinds = [k for k in ("choice", "uniform", "loguniform", "randint") if k in value]
            if len(kinds) == 1:
                knobs.append(Knob(name, kinds[0], tuple(value[kinds[0]])))
    return knobs


def settings_label(t: RunRecord, knobs: list[Knob]) -> str:
    """A trial named by its searched settings (`b64 lr1.0e-3 w1`), `(baseline)` marked; its id where the spec
    searched nothing or the run lacks the params."""
    parts = []
    for knob in knobs:
        param = t.params.get(knob.name)
        if param is None:
            return t.trial_id + (" (baseline)" if t.baseline else "")
        try:
            parts.append(f"{SHORT.get(knob.name, knob.name)}{knob.show(knob.value(param))}")
        except ValueError:
            parts.append(f"{SHORT.get(knob.name, knob.name)}{param}")
    label = " ".join(parts) if parts else t.trial_id
    return label + (" (baseline)" if t.baseline else "")


def trial_labels(record: SweepRecord) -> dict[str, str]:
    """{trial id: its settings label}; two trials that drew the same settings are told apart by their ids."""
    knobs = searched_knobs(record.spec_text)
    labels = {t.trial_id: settings_label(t, knobs) for t in record.trials}
    seen: dict[str, int] = {}
    for label in labels.values():
        seen[label] = seen.get(label, 0) + 1
    return {tid: (f"{label} [{tid}]" if seen[label] > 1 and knobs else label) for tid, label in labels.items()}


def time_attr(spec_text: str) -> str:
    """ASHA's clock in the logged spec: train_seconds (tune.asha.unit: seconds), else epoch."""
    unit = ((_logged_spec(spec_text).get("tune") or {}).get("asha") or {}).get("unit")
    return "train_seconds" if unit == "seconds" else "epoch"


@dataclass(frozen=True)
class Importance:
    """The knobs' importance for the ranking metric at a budget every compared trial reached."""

    metric: str
    mode: str
    clock: str  # epoch | train_seconds
    budget: float  # in `clock`
    knobs: list[Knob]
    importance: dict[str, float]  # knob → share (they sum to 1), largest first
    points: list[tuple[RunRecord, dict[str, Any], float]]  # each compared trial: its knob values, metric at budget

    @property
    def at(self) -> str:
        """The budget in words: `epoch 2`, `31.5 training seconds`."""
        return f"epoch {self.budget:g}" if self.clock == "epoch" else f"{self.budget:.1f} training seconds"

    def as_dict(self) -> dict:
        return {"metric": self.metric, "at": self.at, "clock": self.clock, "budget": self.budget,
                "trials": len(self.points), "evaluator": "fanova", "importance": self.importance}


def reading_at(t: RunRecord, metric: str, clock: str, budget: float) -> tuple[int, float | None]:
    """A trial's (epoch, metric) at its first report at or past `budget` in `clock`, where ASHA read it ((0, None):
    it never got there)."""
    times, values = t.history.get(clock) or {}, t.history.get(metric) or {}
    for epoch in sorted(e for e in times if e in values):
        if times[epoch] >= budget - 1e-9:
            return epoch, values[epoch]
    return 0, None


def value_at(t: RunRecord, metric: str, clock: str, budget: float) -> float | None:
    """A trial's metric at its first report at or past `budget` in `clock` (None: it never got there)."""
    return reading_at(t, metric, clock, budget)[1]


def knob_importance(record: SweepRecord) -> Importance | None:
    """fANOVA over the finished and pruned trials at their common budget (the module's docstring); None with fewer
    than MIN_TRIALS such trials, or when the spec searched nothing."""
    knobs = searched_knobs(record.spec_text)
    clock = time_attr(record.spec_text)
    compared = [t for t in record.trials if t.status in (FINISHED, PRUNED) and t.history.get(clock)
                and t.history.get(record.metric)]
    if not knobs or len(compared) < MIN_TRIALS:
        return None
    budget = min(max(t.history[clock].values()) for t in compared)
    points = []
    for t in compared:
        try:
            values = {k.name: k.value(t.params[k.name]) for k in knobs}
        except (KeyError, ValueError):  # a run without the knob's param, or outside the spec's range
            continue
        value = value_at(t, record.metric, clock, budget)
        if value is not None and math.isfinite(value):
            points.append((t, values, value))
    if len(points) < MIN_TRIALS:
        return None
    return Importance(record.metric, record.mode, clock, budget, knobs, _fanova(knobs, points, record.mode), points)


def _fanova(knobs: list[Knob], points: list, mode: str) -> dict[str, float]:
    """Optuna's fANOVA on the points, as a study of trials made from the store (seeded: the same store gives the
    same figures); a knob no trial varied gets 0."""
    import optuna
    from optuna.importance import FanovaImportanceEvaluator, get_param_importances

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="minimize" if mode == "min" else "maximize")
    distributions = {k.name: k.distribution() for k in knobs}
    for _, values, value in points:
        study.add_trial(optuna.trial.create_trial(params=values, distributions=distributions, value=value))
    varied = [k.name for k in knobs if len({str(values[k.name]) for _, values, _ in points}) > 1]
    found = get_param_importances(study, evaluator=FanovaImportanceEvaluator(seed=0), params=varied) if varied else {}
    shares = {k.name: float(found.get(k.name, 0.0)) for k in knobs}
    return dict(sorted(shares.items(), key=lambda kv: -kv[1]))
