"""How a sweep draws its trials (tune.search): `random` (Tune's BasicVariantGenerator) or `tpe` (Optuna's TPE through
Tune's OptunaSearch). Either way the spec's defaults run first, as the baseline, and the searcher is told of it.

OptunaSearch alone tells Optuna a trial ASHA stopped as COMPLETE with its last, low-budget value (it marks a trial
PRUNED only when no result came: ray python/ray/tune/search/optuna/optuna_search.py, `on_trial_complete`), so TPE
would learn from an early rung's loss as if it were a final one; and it reports intermediate values at Tune's
`training_iteration`, which under ASHA in seconds is a different budget for every batch. `RungTPE` tells Optuna what
ASHA saw instead:

- a trial's value at each ASHA rung (the first report at or past it, as ASHA records it) is an intermediate value
  at that budget (step: the rung in epochs, or in whole training seconds);
- a trial that ended (metrics.Horizon.outcome, the sweep's one rule) finished is COMPLETE with its last value; one
  ASHA cut is PRUNED (Optuna then takes its last rung value, and TPE ranks pruned trials after the complete ones,
  those cut later first: optuna/samplers/_tpe/sampler.py, `_split_pruned_trials`); a failed one is FAIL.

Its study lives in memory and Tune saves it with the experiment (`save_to_dir`, beside Tune's own state, on
storage_path): `tune --resume` restores it with the trials, so the study goes on where the sweep's state does.
`restored(experiment_path)` reads it back.
"""

from __future__ import annotations

import logging
import math
import warnings
from typing import Any

from ray.tune.search.optuna import OptunaSearch

from raysweep.errors import UserError
from raysweep.metrics import FAILED, FINISHED, PRUNED, Horizon

log = logging.getLogger(__name__)

SEARCHES = ("random", "tpe")


def startup_trials(num_samples: int) -> int:
    """Trials TPE draws at random (the baseline among them) before it models: a third of the budget, 3 to 10
    (Optuna's default is 10, a whole budget for the few dozen trials a sweep runs)."""
    return max(3, min(10, num_samples // 3))


def describe(config) -> str:
    """The sweep's search in a line (console.print_search)."""
    t = config.tune
    if t.search == "tpe":
        return (f"tpe (Optuna's TPE, seed {t.seed}): the baseline and {startup_trials(t.num_samples) - 1} random "
                f"trials first, then each trial drawn from what the finished and pruned ones scored")
    return f"random (seed {t.seed}): the baseline first, then independent samples"


def searcher(config, trials_at_once: int, rungs: tuple[float, ...]):
    """Tune's search algorithm for a sweep (config.SweepConfig) and its param_space: (search_alg, param_space)."""
    trials, t = config.trials, config.tune
    defaults, searched = trials.default_knobs(), trials.searched()
    baseline = [{k: defaults[k] for k in searched}] if searched else None
    if t.search == "tpe":
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)  # not a line per trial: the console says what ran
        with warnings.catch_warnings():  # multivariate and constant_liar are marked experimental
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            sampler = optuna.samplers.TPESampler(seed=t.seed, n_startup_trials=startup_trials(t.num_samples),
                                                 multivariate=True, constant_liar=trials_at_once > 1)
        search = RungTPE(tpe_space(searched), config.horizon, rungs, metric=t.metric, mode=t.mode,
                         points_to_evaluate=baseline, sampler=sampler)
        fixed = {k: v for k, v in defaults.items() if k not in searched}
        return search, fixed
    from ray.tune.search.basic_variant import BasicVariantGenerator

    # max_concurrent must be set here: Tune ignores TuneConfig.max_concurrent_trials when search_alg is a
    # BasicVariantGenerator instance (tune.py wraps only Searchers), and oversubscribed trials then wait for
    # workers until they time out
    return (BasicVariantGenerator(points_to_evaluate=baseline, random_state=t.seed, max_concurrent=trials_at_once),
            tune_space(config.search.knobs()))


def tune_space(knobs: dict[str, Any]) -> dict[str, Any]:
    """Tune's param_space: one entry per set knob (fixed values pass through)."""
    from ray import tune

    from raysweep.config import Choice, LogUniform, RandInt, Uniform

    space = {}
    for name, knob in knobs.items():
        if isinstance(knob, Choice):
            space[name] = tune.choice(list(knob.choice))
        elif isinstance(knob, LogUniform):
            space[name] = tune.loguniform(*knob.loguniform)
        elif isinstance(knob, Uniform):
            space[name] = tune.uniform(*knob.uniform)
        elif isinstance(knob, RandInt):
            space[name] = tune.randint(knob.randint[0], knob.randint[1] + 1)  # Tune's high is exclusive
        else:
            space[name] = knob
    return space


def tpe_space(searched: dict[str, Any]) -> dict[str, Any]:
    """Optuna's distributions for the searched knobs; a knob TPE cannot take is a UserError naming it."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    from raysweep.config import Choice, LogUniform, RandInt, Uniform

    space = {}
    for name, knob in searched.items():
        if isinstance(knob, Choice):
            space[name] = CategoricalDistribution(list(knob.choice))
        elif isinstance(knob, LogUniform):
            space[name] = FloatDistribution(*knob.loguniform, log=True)
        elif isinstance(knob, Uniform):
            space[name] = FloatDistribution(*knob.uniform)
        elif isinstance(knob, RandInt):
            space[name] = IntDistribution(*knob.randint)  # both bounds inclusive, as in the spec
        else:
            raise UserError(f"search.{name}: tune.search: tpe cannot search a {type(knob).__name__} knob; give it "
                            f"a choice, uniform, loguniform or randint, or use tune.search: random")
    return space  # never empty: config.SweepConfig.sweep_problem refuses tpe without a searched knob


class RungTPE(OptunaSearch):
    """OptunaSearch that tells Optuna what ASHA saw (the module's docstring): intermediate values at the rungs, and
    a trial's end as finished, pruned or failed by the sweep's rule."""

    def __init__(self, space: dict, horizon: Horizon, rungs: tuple[float, ...], **kwargs):
        self._horizon, self._rungs = horizon, tuple(sorted(rungs))
        self._reported: dict[str, set[float]] = {}  # trial id → the rungs told
        super().__init__(space=space, **kwargs)

    @property
    def study(self):
        return self._ot_study

    @property
    def numbers(self) -> dict[str, int]:
        return {trial_id: ot_trial.number for trial_id, ot_trial in self._ot_trials.items()}

    def rung_step(self, rung: float) -> int:
        """Optuna's step for a rung: the epoch, or (ASHA in seconds) the whole training second."""
        return int(round(rung))

    def _tell_rungs(self, trial_id: str, result: dict) -> None:
        """The metric at every rung this result is the first report at or past (ASHA records it there)."""
        value, clock = result.get(self.metric), result.get(self._horizon.time_attr)
        if value is None or clock is None:
            return
        told = self._reported.setdefault(trial_id, set())
        ot_trial = self._ot_trials[trial_id]
        for rung in self._rungs:
            if rung <= float(clock) and rung not in told:
                told.add(rung)
                if math.isfinite(float(value)):
                    ot_trial.report(float(value), self.rung_step(rung))

    def on_trial_result(self, trial_id: str, result: dict) -> None:
        if trial_id in self._completed_trials or trial_id not in self._ot_trials:
            return
        self._tell_rungs(trial_id, result)

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        from optuna.trial import TrialState

        if trial_id in self._completed_trials or trial_id not in self._ot_trials:
            return  # told already (a settled trial reported again on --resume), or never asked of this study
        if result:
            self._tell_rungs(trial_id, result)  # ASHA's stopping report never reaches on_trial_result
        outcome = self._horizon.outcome(result or {}, error) if result or error else FAILED
        value = (result or {}).get(self.metric)
        ot_trial = self._ot_trials[trial_id]
        if outcome == FINISHED and value is not None and math.isfinite(float(value)):
            self._ot_study.tell(ot_trial, float(value))
        elif outcome == PRUNED:
            self._ot_study.tell(ot_trial, state=TrialState.PRUNED)
        else:  # failed, or ended without a usable value
            self._ot_study.tell(ot_trial, state=TrialState.FAIL)
        self._completed_trials.add(trial_id)


def restored(experiment_path: str) -> RungTPE:
    """A TPE sweep's searcher as Tune last saved it with the experiment (a local folder): its Optuna study is
    `.study`, and `.numbers` maps Tune's trial ids to the study's trial numbers."""
    search = RungTPE.__new__(RungTPE)
    search.restore_from_dir(experiment_path)
    return search
