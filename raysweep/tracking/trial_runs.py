"""A sweep's trials as MLflow child runs: each write the driver's Tune events turn into (callbacks.MLflowEvents puts
them on the sweep's writer, off Tune's loop).

One child run per trial under the parent: params at the trial's start (knobs + derived, and what only the workers
know with its first epoch), metrics per report with step = epoch, and how it ended (metrics.run_ending). Every
write is safe to repeat (the writer retries a store that stalls): a run is looked up before it is created, and an
epoch's metrics are checked against the store after a failed attempt.

MLflow appends: an epoch reported again (a worker group restarted from an older checkpoint, a resumed trial) would
be a second value at the same step. The last epoch logged per run is kept (and saved with the experiment), and
anything at or below it is skipped; after a restore it is read back from the store, which the saved state may
trail.
"""

from __future__ import annotations

import threading

from raysweep.metrics import TAG_BASELINE, RunEnding
from raysweep.tracking.runs import end_run, reopen
from raysweep.tracking.store import mlflow_client


class TrialRuns:
    """The child runs of one parent run, and what the store holds of each."""

    def __init__(self, tracking_uri: str, experiment_id: str, parent_run_id: str):
        self.tracking_uri, self.experiment_id, self.parent_run_id = tracking_uri, experiment_id, parent_run_id
        self.runs: dict[str, str] = {}  # trial id → MLflow run id
        self.logged: dict[str, int] = {}  # trial id → last epoch logged
        self.unsure: set[str] = set()  # trials whose last metrics write failed: it may have landed (re-read)
        self.settled: set[str] = set()  # trials whose run ended for good before a --resume: never written again
        self.pending: dict[str, list] = {}  # trial id → reports not yet written (add_result → write_results)
        self.creating: set[str] = set()  # trials whose run's creation was tried, not known to have succeeded
        self.restored = False  # unpickled with a restored experiment: runs may exist the saved state does not know
        self._client = None
        self._lock = threading.Lock()  # runs and logged: written on the writer's thread, read by `state`

    @property
    def client(self):
        if self._client is None:
            self._client = mlflow_client(self.tracking_uri)
        return self._client

    def __getstate__(self):  # Tune pickles callbacks with the experiment; a client and a lock are not state
        return {**self.__dict__, "_client": None, "_lock": None, "unsure": set(), "settled": set(), "pending": {},
                "creating": set()}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self.restored = True

    def state(self) -> dict:
        with self._lock:
            return {"runs": dict(self.runs), "parent_run_id": self.parent_run_id, "logged": dict(self.logged)}

    def restore(self, state: dict) -> None:
        """A restored sweep's runs (Tune's saved callback state); the store is the truth: the state may trail it."""
        self.runs.update(state["runs"])
        self.parent_run_id = state["parent_run_id"]
        self.logged.update(state["logged"])
        for trial_id, run_id in self.runs.items():
            self._read_logged(trial_id, run_id)

    def last_logged(self, trial_id: str) -> int:
        return self.logged.get(trial_id, 0)

    # -- the writes (each on the writer's thread)

    def start(self, trial_id: str, params: dict, baseline: bool) -> None:
        """The trial's run, created, or taken up again: a resumed run RUNNING again, one the store says ended for
        good (failures.settled) left as it ended (its relay ends it so: --resume)."""
        from raysweep.failures import settled

        run_id, created = self._run_for(trial_id, params, baseline)
        if created:
            return
        run = self.client.get_run(run_id)
        if run.info.status == "RUNNING":
            return
        if settled(run.info.status, run.data.tags) is not None:
            self.settled.add(trial_id)
        else:  # resumed: interrupted (KILLED) or failed for the infrastructure
            reopen(self.client, run_id)

    def add_result(self, trial_id: str, step: int, at_ms: int, values: dict, worker_params: dict,
                   tags: dict) -> None:
        """One epoch's report, held until the writer's next `write_results` for the trial (on Tune's thread)."""
        with self._lock:
            self.pending.setdefault(trial_id, []).append((step, at_ms, values, worker_params, tags))

    def write_results(self, trial_id: str, params: dict, baseline: bool) -> int | None:
        """Every report held for the trial in one `log_batch` (its metrics, the worker params with the first
        epoch, its tags: a retry count, an eager fallback), epochs the store holds skipped. Returns the last epoch
        the store holds for the trial, or None when there was nothing to write (an earlier call wrote it) or its
        run ended for good before a --resume (never written)."""
        from mlflow.entities import Metric, Param, RunTag
        from mlflow.exceptions import MlflowException

        with self._lock:
            held = list(self.pending.get(trial_id, ()))
        if not held or trial_id in self.settled:
            self._drop(trial_id, len(held))
            return None
        run_id = self._run_for(trial_id, params, baseline)[0]
        if trial_id in self.unsure:  # a failed attempt may have landed: the store says what it holds
            self._read_logged(trial_id, run_id)
            self.unsure.discard(trial_id)
        last = first = self.logged.get(trial_id, 0)
        metrics, known, tags = [], {}, {}
        for step, at_ms, values, worker_params, report_tags in held:
            if step <= last:  # reported again after a restart: MLflow already holds this epoch
                continue
            metrics += [Metric(k, v, at_ms, step) for k, v in values.items()]
            known = known or worker_params  # known after the probe, logged once
            tags.update(report_tags)
            last = step
        if metrics:
            self.unsure.add(trial_id)
            tag_list = [RunTag(k, v) for k, v in tags.items()]
            try:
                self.client.log_batch(run_id, metrics=metrics, tags=tag_list,
                                      params=[Param(k, v) for k, v in known.items()] if first == 0 else [])
            except MlflowException as e:  # a param logged before with another value (a restart elsewhere)
                if e.error_code != "INVALID_PARAMETER_VALUE":
                    raise
                self.client.log_batch(run_id, metrics=metrics, tags=tag_list)
            self.unsure.discard(trial_id)
            with self._lock:
                self.logged[trial_id] = last
        self._drop(trial_id, len(held))
        return self.logged.get(trial_id, 0)

    def _drop(self, trial_id: str, n: int) -> None:
        """The first `n` reports held for a trial are in the store (or never will be)."""
        with self._lock:
            rest = self.pending.get(trial_id, [])[n:]
            if rest:
                self.pending[trial_id] = rest
            else:
                self.pending.pop(trial_id, None)

    def end(self, trial_id: str, params: dict, baseline: bool, status: str, tags: dict) -> None:
        """The run ended with `status` and `tags` (metrics.run_ending)."""
        if trial_id in self.settled:
            return
        self.write_results(trial_id, params, baseline)  # normally written by then: each report queued a write
        end_run(self.client, self._run_for(trial_id, params, baseline)[0], RunEnding(status, tags))

    # -- the run of a trial

    def _read_logged(self, trial_id: str, run_id: str) -> None:
        """The last epoch the store holds for a run (it may be ahead of the saved state)."""
        history = self.client.get_metric_history(run_id, "epoch")
        with self._lock:
            self.logged[trial_id] = max([int(m.step) for m in history] + [self.logged.get(trial_id, 0)])

    def _run_for(self, trial_id: str, params: dict, baseline: bool) -> tuple[str, bool]:
        """The trial's run id, and whether it was created now. Safe to repeat: a creation whose answer was lost is
        found in the store on the retry (as is a run a restored sweep's saved state predates: a driver killed
        after creating it), and its params logged again (the same values: MLflow accepts the repeat)."""
        run_id = self.runs.get(trial_id)
        if run_id is not None:
            return run_id, False
        creating = trial_id in self.creating
        if self.restored or creating:
            run_id = self._existing_run(trial_id)
            if run_id is not None and not creating:
                with self._lock:
                    self.runs[trial_id] = run_id
                return run_id, False
        from mlflow.entities import Param

        self.creating.add(trial_id)
        if run_id is None:
            tags = {"mlflow.parentRunId": self.parent_run_id, "trial_id": trial_id}
            if baseline:
                tags[TAG_BASELINE] = "true"
            run_id = self.client.create_run(self.experiment_id, run_name=trial_id, tags=tags).info.run_id
        self.client.log_batch(run_id, params=[Param(k, str(v)) for k, v in params.items()])
        with self._lock:
            self.runs[trial_id] = run_id
        self.creating.discard(trial_id)
        return run_id, True

    def _existing_run(self, trial_id: str) -> str | None:
        """The trial's child run, looked up in the store."""
        found = self.client.search_runs(
            [self.experiment_id], max_results=1,
            filter_string=f"tags.mlflow.parentRunId = '{self.parent_run_id}' and tags.trial_id = '{trial_id}'")
        if not found:
            return None
        run_id = found[0].info.run_id
        self._read_logged(trial_id, run_id)
        return run_id
