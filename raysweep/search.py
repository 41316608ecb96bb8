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
  those cut later first: optuna/samplers/_tpe/sampler.py, `_split_pruned_trials`);
- with tune.target, the value is what the sweep ranks by (metrics.rank_key): the time to the target for a trial
  that reached it, and for one that did not a value past every reached one (UNREACHED), ordered by tune.metric;
  the study minimises it. A trial stopped at its target was COMPLETE with an early value of tune.metric, and TPE
  steered away from the trials the report ranks best;
- a failed trial is told by its kind (failures.py, which the driver's MLflow callback reads from the trial's error
  and notes: Tune tells a searcher only that a trial errored, before its callbacks run, so the searcher settles
  failures at its next call, and before the study is saved: a trial that errors after the last suggestion is
  settled in the study Tune saves at the end): one that diverged or ran out of memory is COMPLETE with the worst
  value for the study's direction (`worst_value`: +inf when it minimises, -inf when it maximises), so TPE's model
  draws fewer of its learning rates and batches (FAIL, which TPE ignores, let it propose them again); one that failed
  for the infrastructure says nothing of its knobs and is FAIL too (left RUNNING, TPE's constant_liar, on whenever
  trials run at once, counts it among the worst trials: optuna/samplers/_tpe/sampler.py, `_split_trials`), and when
  `tune --resume` continues it, its results go to a new Optuna trial of the same knobs, with the rung values it had
  been told; an `error` (its code raised) is FAIL.

RungTPE limits the trials in flight itself (`set_max_concurrency`): Tune's ConcurrencyLimiter forgets a trial once
it errors and forwards nothing of it again, so a trial --resume continued never reached the study.

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
from raysweep.failures import DIVERGED, INFRA, OOM, noted_kind
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
        search = RungTPE(tpe_space(searched), config.horizon, rungs, target=t.target, metric=t.metric,
                         mode="min" if t.target is not None else t.mode, sweep_mode=t.mode,
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


UNREACHED = 1e9  # with tune.target: a trial that did not reach it counts as this plus its metric (past every
# time: 31 years of training; at 1e9 a double still tells metrics 1e-7 apart, at 1e12 only 1e-4)


def worst_value(direction: str) -> float:
    """A trial that diverged or ran out of memory: worse than any value for a study that minimises ("min": +inf) or
    maximises ("max": -inf). TPE orders values, never adds them."""
    return math.inf if direction == "min" else -math.inf


class RungTPE(OptunaSearch):
    """OptunaSearch that tells Optuna what ASHA saw (the module's docstring): intermediate values at the rungs, a
    trial's end as finished, pruned or failed by the sweep's rule, what the sweep ranks by, and failures by kind."""

    def __init__(self, space: dict, horizon: Horizon, rungs: tuple[float, ...], target=None, sweep_mode: str = "min",
                 **kwargs):
        """`target`: tune.target (config.TargetConfig) or None; `sweep_mode`: tune.mode (the study's own direction
        is min under a target)."""
        self._horizon, self._rungs = horizon, tuple(sorted(rungs))
        self._target, self._sweep_mode = target, sweep_mode
        self._reported: dict[str, set[float]] = {}  # trial id → the rungs told
        self._live: set[str] = set()  # suggested (or resumed) and not ended: the trials in flight
        self._errored: dict[str, dict | None] = {}  # errored, kind not yet noted: trial id → its last result
        self._lost: set[str] = set()  # failed for the infrastructure: told FAIL, its knobs reopened if it continues
        self._max_concurrent = 0  # 0: no limit
        super().__init__(space=space, **kwargs)

    @property
    def study(self):
        return self._ot_study

    @property
    def numbers(self) -> dict[str, int]:
        return {trial_id: ot_trial.number for trial_id, ot_trial in self._ot_trials.items()}

    def set_max_concurrency(self, max_concurrent: int) -> bool:
        """Tune's ConcurrencyLimiter asks: this searcher limits itself (suggest), so the limiter forwards every
        trial's results and end, a resumed one's too."""
        self._max_concurrent = max_concurrent
        return True

    def rung_step(self, rung: float) -> int:
        """Optuna's step for a rung: the epoch, or (ASHA in seconds) the whole training second."""
        return int(round(rung))

    def objective(self, result: dict) -> float | None:
        """What the study minimises or maximises for a result: tune.metric's value, or under tune.target the
        sweep's rank (time to the target; UNREACHED plus the metric, signed to minimise, when not reached).
        None: no usable value."""
        value = result.get(self.metric)
        if self._target is not None and result.get("time_to_target_s") is not None:
            return float(result["time_to_target_s"])
        if value is None or not math.isfinite(float(value)):
            return None
        if self._target is not None:
            return UNREACHED + (-float(value) if self._sweep_mode == "max" else float(value))
        return float(value)

    def suggest(self, trial_id: str):
        self._settle()
        if self._max_concurrent and len(self._live) >= self._max_concurrent:
            return None  # as ConcurrencyLimiter would: Tune asks again when a trial ends
        suggestion = super().suggest(trial_id)
        if suggestion is not None:
            self._live.add(trial_id)
        return suggestion

    def _tell_rungs(self, trial_id: str, result: dict) -> None:
        """The objective at every rung this result is the first report at or past (ASHA records it there)."""
        value, clock = self.objective(result), result.get(self._horizon.time_attr)
        if clock is None:
            return
        told = self._reported.setdefault(trial_id, set())
        ot_trial = self._ot_trials[trial_id]
        for rung in self._rungs:
            if rung <= float(clock) and rung not in told:
                told.add(rung)
                if value is not None:
                    ot_trial.report(value, self.rung_step(rung))

    def on_trial_result(self, trial_id: str, result: dict) -> None:
        self._settle()
        self._reopen(trial_id)
        if trial_id in self._completed_trials or trial_id not in self._ot_trials:
            return
        self._live.add(trial_id)  # a trial --resume continued is in flight again
        self._tell_rungs(trial_id, result)

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        from optuna.trial import TrialState

        self._settle()
        self._live.discard(trial_id)
        if not error:
            self._reopen(trial_id)
        if trial_id in self._completed_trials or trial_id not in self._ot_trials:
            return  # told already (a settled trial reported again on --resume), or never asked of this study
        if result:
            self._tell_rungs(trial_id, result)  # ASHA's stopping report never reaches on_trial_result
        if error:  # its kind is noted by the driver's callback right after this call: told at the next call
            self._errored[trial_id] = result
            return
        outcome = self._horizon.outcome(result or {}, False) if result else FAILED
        value = self.objective(result or {})
        ot_trial = self._ot_trials[trial_id]
        if outcome == FINISHED and value is not None:
            self._ot_study.tell(ot_trial, value)
        elif outcome == PRUNED:
            self._ot_study.tell(ot_trial, state=TrialState.PRUNED)
        else:  # ended without a usable value
            self._ot_study.tell(ot_trial, state=TrialState.FAIL)
        self._completed_trials.add(trial_id)

    def _settle(self) -> None:
        """Tell the errored trials whose kind the driver has noted (failures.note_kind): diverged and oom as the
        worst value for the study's direction, error and infra as FAIL (an infra trial may be continued: _reopen)."""
        from optuna.study import StudyDirection
        from optuna.trial import TrialState

        for trial_id in list(self._errored):
            kind = noted_kind(trial_id)
            if kind is None:
                continue
            del self._errored[trial_id]
            ot_trial = self._ot_trials[trial_id]
            if kind in (DIVERGED, OOM):
                direction = "max" if self._ot_study.direction == StudyDirection.MAXIMIZE else "min"
                self._ot_study.tell(ot_trial, worst_value(direction))
                self._completed_trials.add(trial_id)
                continue
            self._ot_study.tell(ot_trial, state=TrialState.FAIL)
            if kind == INFRA:
                self._lost.add(trial_id)
            else:
                self._completed_trials.add(trial_id)

    def _reopen(self, trial_id: str) -> None:
        """A trial that failed for the infrastructure and goes on (`tune --resume`): a new Optuna trial of its knobs,
        told the rung values the failed one had been told, takes its place (a told trial cannot be told again)."""
        if trial_id not in self._lost:
            return
        self._lost.discard(trial_id)
        failed = self._ot_study.trials[self._ot_trials[trial_id].number]
        self._ot_study.enqueue_trial(failed.params, skip_if_exists=False)
        again = self._ot_study.ask(self._space)  # the enqueued knobs: nothing else asks between the two calls
        for step, value in failed.intermediate_values.items():
            again.report(value, step)
        self._ot_trials[trial_id] = again

    def save(self, checkpoint_path: str) -> None:
        """Tune saves the searcher with the experiment (after every trial's end, and once more when the sweep
        ends): what the driver has noted since the last call is told first."""
        self._settle()
        super().save(checkpoint_path)


def restored(experiment_path: str) -> RungTPE:
    """A TPE sweep's searcher as Tune last saved it with the experiment (a local folder): its Optuna study is
    `.study`, and `.numbers` maps Tune's trial ids to the study's trial numbers."""
    search = RungTPE.__new__(RungTPE)
    search.restore_from_dir(experiment_path)
    return search
