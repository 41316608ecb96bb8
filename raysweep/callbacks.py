"""The driver's Tune callbacks, in the order sweep.py hands them to Tune:

- SweepClock: each trial's start-up, from the stamps its first report carries (the callbacks after it see them);
- BrokerLink: tells the broker when Tune ended a trial (ASHA's stop, an error), and ends the sweep when the broker is
  lost;
- MLflowEvents: every event into the store's writes (tracking.TrialRuns, on the sweep's writer, off Tune's loop);
- ConsoleEvents: the console's lines and tables (console.ConsoleProgress);
- asha.RungKeeper (sweeps only): ASHA's rungs across a resume.

Tune pickles callbacks with the experiment, and a resumed sweep gets them back (`Tuner.restore`): a callback holds
only what a new driver can use (the sweep's folder, run ids), never an actor handle or a client.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from ray.tune import Callback

from raysweep.errors import BrokerLost
from raysweep.metrics import (
    EAGER_FALLBACK,
    METRIC_NAMES,
    STARTUP_NAMES,
    WORKER_PARAMS,
    TrialView,
    eager_reason,
    run_ending,
    startup_phases,
)
from raysweep.relay import INFRA_RETRIES, STARTUP_STAMPS

log = logging.getLogger(__name__)


class SweepClock(Callback):
    """Stamps each trial's start and turns the stamps its first report carries into `startup_s` and its phases
    (metrics.startup_phases)."""

    def __init__(self):
        self.started: dict[str, float] = {}

    def on_trial_start(self, iteration, trials, trial, **info):
        self.started[trial.trial_id] = time.time()

    def on_trial_result(self, iteration, trials, trial, result, **info):
        stamps = result.pop(STARTUP_STAMPS, None)
        if stamps is not None:
            stamps = json.loads(stamps)
            stamps["trial_started"] = self.started.get(trial.trial_id, stamps["relay_started"])
            result.update(startup_phases(stamps))


class BrokerLink(Callback):
    """The broker's side of Tune's loop: a trial Tune ended (ASHA's stop, an error) is ended on its slot, which stops
    at the epoch's end and takes the next trial; a lost broker ends the sweep (every relay fails with it too:
    `tune --resume` continues the trials).

    It finds the broker by the sweep's folder rather than holding it (slots.active): a resumed sweep's restored
    callback must find the new driver's broker."""

    def __init__(self, experiment_path: str):
        self.experiment_path = experiment_path

    def on_step_begin(self, iteration, trials, **info):
        from raysweep import slots

        lost = slots.broker_lost(self.experiment_path)
        if lost:
            raise BrokerLost.of(lost)

    def on_trial_complete(self, iteration, trials, trial, **info):
        self._end(trial)

    def on_trial_error(self, iteration, trials, trial, **info):
        self._end(trial)

    def _end(self, trial):
        from raysweep import slots

        broker = slots.active(self.experiment_path)
        if broker is not None:
            broker.end.remote(trial.trial_id)


class MLflowEvents(Callback):
    """Tune's events into the sweep's MLflow writes: what a write needs is taken now (the trial object changes),
    the write (tracking.TrialRuns) goes to the sweep's writer (tracking.writer), off Tune's loop.

    `trials` (config.TrialFactory) gives a trial's params; `on_recorded(trial_id, epoch)` (picklable) is told, after
    each result's write, the last epoch the store holds for the trial (a slot checkpoints only past epochs the store
    holds: slots.Broker.recorded_through). Run ids and the last epoch logged per run are the callback's state, so a
    restored sweep keeps writing to the same runs."""

    def __init__(self, runs, trials, train_size: int, horizon, retry_s: float, on_recorded=None):
        self.runs, self.trials, self.train_size = runs, trials, train_size
        self.horizon, self.retry_s, self.on_recorded = horizon, retry_s, on_recorded
        self._params: dict[str, tuple[dict, bool]] = {}  # trial id → (params, baseline), computed once

    def get_state(self) -> dict:
        return self.runs.state()

    def set_state(self, state: dict) -> None:
        self.runs.restore(state)

    def on_step_begin(self, iteration, trials, **info):
        """The store's failure ends the sweep once the writer gave up, not at the next result: a slot waits for the
        store before its checkpoint, so none may come before its own wait ends."""
        from raysweep.tracking import raise_if_gave_up

        raise_if_gave_up(self.runs.parent_run_id)

    def on_experiment_end(self, trials, **info):
        from raysweep.tracking import flush_writes

        flush_writes(self.runs.parent_run_id)

    def _put(self, write, *args) -> None:
        from raysweep.tracking import writer

        writer(self.runs.parent_run_id, self.retry_s, self.runs.tracking_uri).put(lambda: write(*args))

    def _run_of(self, trial) -> tuple[str, dict, bool]:
        """(trial id, params, baseline): what creating the trial's run needs, should a write find it missing."""
        if trial.trial_id not in self._params:
            knobs = dict(trial.config)
            self._params[trial.trial_id] = (self.trials.trial(knobs, self.train_size).params(),
                                            self.trials.is_baseline(knobs))
        return trial.trial_id, *self._params[trial.trial_id]

    def on_trial_start(self, iteration, trials, trial, **info):
        self._put(self.runs.start, *self._run_of(trial))

    def on_trial_result(self, iteration, trials, trial, result, **info):
        step, now = int(result.get("epoch", 0)), int(time.time() * 1000)
        values = {k: float(result[k]) for k in (*METRIC_NAMES, *STARTUP_NAMES) if result.get(k) is not None}
        worker_params = {k: str(result[k]) for k in WORKER_PARAMS if k in result}
        tags = {}
        if result.get(INFRA_RETRIES):
            tags["raysweep.infra_retries"] = str(int(result[INFRA_RETRIES]))
        if result.get(EAGER_FALLBACK):
            tags["raysweep.eager_fallback"] = eager_reason(result[EAGER_FALLBACK])
        self.runs.add_result(trial.trial_id, step, now, values, worker_params, tags)
        self._put(self._write_results, *self._run_of(trial))

    def _write_results(self, trial_id: str, params: dict, baseline: bool) -> None:
        """The trial's reports held so far, in one write (the ones queued behind it find nothing left: a busy
        store gets one write per run per turn of the writer, however many epochs came in meanwhile)."""
        stored = self.runs.write_results(trial_id, params, baseline)
        if stored is not None and self.on_recorded is not None:
            self.on_recorded(trial_id, stored)

    def on_trial_complete(self, iteration, trials, trial, **info):
        view = TrialView.of_trial(trial, self.horizon, ended="complete")
        self._put(self.runs.end, *self._run_of(trial), *run_ending(view.status, view.epoch))

    def on_trial_error(self, iteration, trials, trial, **info):
        from raysweep.failures import kind_of, note_kind

        view = TrialView.of_trial(trial, self.horizon, ended="error")
        kind = kind_of(_pickled_error(trial))  # typed, as the relay raised it (failures.TrialFailure)
        note_kind(trial.trial_id, kind)  # for the searcher (search.RungTPE), which Tune told only "errored"
        self._put(self.runs.end, *self._run_of(trial), *run_ending(view.status, view.epoch, kind, view.error))


_PROGRESS: dict[str, object] = {}  # this driver's console, by the sweep's folder (ConsoleEvents.progress)


def show_progress(experiment_path: str, progress) -> None:
    """Where the sweep at `experiment_path` prints its events (console.ConsoleProgress): this driver's, set before
    Tune starts or restores the sweep."""
    _PROGRESS[experiment_path] = progress


class ConsoleEvents(Callback):
    """Tune's events to the console of the driver that runs the sweep now. Tune pickles its callbacks with the
    experiment and `--resume` gets them back as they were: holding the progress object itself, a resumed sweep
    printed to the first driver's (its --progress-every, its start-up figures, which the new driver's summary
    never saw). So it holds the sweep's folder and finds this driver's console by it (show_progress)."""

    def __init__(self, experiment_path: str, horizon):
        self.experiment_path, self.horizon = experiment_path, horizon

    @property
    def progress(self):
        return _PROGRESS[self.experiment_path]

    def on_trial_start(self, iteration, trials, trial, **info):
        self.progress.trial_start(TrialView.of_trial(trial, self.horizon))

    def on_trial_result(self, iteration, trials, trial, result, **info):
        self.progress.trial_result(trial.trial_id, result)

    def on_trial_complete(self, iteration, trials, trial, **info):
        self.progress.trial_end(TrialView.of_trial(trial, self.horizon, ended="complete"))

    def on_trial_error(self, iteration, trials, trial, **info):
        self.progress.trial_end(TrialView.of_trial(trial, self.horizon, ended="error"))

    def on_step_end(self, iteration, trials, **info):
        if not self.progress.per_epoch:
            self.progress.step(TrialView.of_trial(t, self.horizon) for t in trials)


def _pickled_error(trial) -> BaseException | None:
    """The exception Tune kept for an errored trial (a RayTaskError around what the trial function raised): read
    from the trial's error file, which Trial.handle_error writes before Tune calls on_trial_error
    (ray python/ray/tune/experiment/trial.py)."""
    import cloudpickle

    try:
        local = trial.pickled_error_file
        if local and Path(local).is_file():
            return cloudpickle.loads(Path(local).read_bytes())
        return trial.get_pickled_error()
    except Exception as e:  # not there, or not unpicklable here: the trial's own error
        log.warning("trial %s: its error could not be read back (%s: %s)", trial.trial_id, type(e).__name__, e)
        return None
