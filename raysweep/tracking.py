"""Every MLflow write, by the driver alone: the sweep's parent run, a child run per trial, the probe's run.

`mlflow` and `ray.tune` are imported inside the functions that need them, so importing this module
stays instant (`--help`, `check`).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict
from datetime import datetime
from pathlib import Path

from raysweep import drivers
from raysweep.errors import UserError
from raysweep.failures import INFRA
from raysweep.metrics import EAGER_FALLBACK, METRIC_NAMES, STARTUP_NAMES, WORKER_PARAMS, RunRecord, SweepRecord, TrialView

log = logging.getLogger(__name__)


def resolve_tracking_uri(uri: str | None, cwd: Path | None = None) -> str:
    """An absolute tracking URI: Train workers chdir, so a relative sqlite path would split the store.

    null → sqlite mlflow.db in the working directory. MLflow 3.17's file store raises, so plain paths
    and file: URIs are refused with the fix.
    """
    cwd = Path(cwd or Path.cwd())
    if uri is None:
        return f"sqlite:///{(cwd / 'mlflow.db').resolve()}"
    if uri.startswith("sqlite:///"):
        path = Path(uri[len("sqlite:///"):])
        return f"sqlite:///{(cwd / path).resolve() if not path.is_absolute() else path}"
    if uri.startswith(("http://", "https://", "databricks", "postgresql", "mysql", "mssql")):
        return uri
    raise UserError(
        f"mlflow.tracking_uri: {uri!r} is not supported (MLflow 3.17 refuses the file store); use "
        f"sqlite:///path/to/mlflow.db, an http(s):// tracking server, or null for ./mlflow.db"
    )


def sqlite_path(uri: str) -> Path | None:
    return Path(uri[len("sqlite:///"):]) if uri.startswith("sqlite:///") else None


def open_sweep(tracking_uri: str, experiment: str, run_name: str, tags: dict, spec_text: str) -> tuple[str, str]:
    """Create (or reuse) the experiment and open the sweep's parent run; returns (experiment_id, run_id)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    found = client.get_experiment_by_name(experiment)
    if found is not None:
        experiment_id = found.experiment_id
    else:
        db = sqlite_path(tracking_uri)
        location = (db.parent / "mlartifacts" / experiment).as_uri() if db else None
        experiment_id = client.create_experiment(experiment, artifact_location=location)
    run = client.create_run(experiment_id, run_name=run_name, tags={**tags, **drivers.driver_tags()})
    client.log_text(run.info.run_id, spec_text, "spec.yaml")
    return experiment_id, run.info.run_id


def find_parent(tracking_uri: str, experiment_path: str):
    """The newest parent run of the sweep stored at `experiment_path` (an mlflow Run), or a UserError."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    runs = client.search_runs(
        [e.experiment_id for e in client.search_experiments()],
        filter_string=f"tags.`raysweep.storage` = '{experiment_path}'", order_by=["attributes.start_time DESC"],
        max_results=1,
    )
    if not runs:
        raise UserError(f"--resume: no MLflow parent run for {experiment_path} in {tracking_uri}")
    return runs[0]


def spec_of(tracking_uri: str, run_id: str) -> str | None:
    """The spec.yaml a sweep logged on its parent run (None for a run without one)."""
    from mlflow.tracking import MlflowClient

    return _artifact_text(MlflowClient(tracking_uri), run_id, "spec.yaml")


def resumed_parent(tracking_uri: str, parent_run_id: str) -> str:
    """Take a sweep's parent run over for `--resume` (checked before by sweep.check_resume): RUNNING again, with
    this driver's address and heartbeat. Returns its experiment id."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    run = reopen(client, parent_run_id)
    _set_tags(client, parent_run_id, drivers.driver_tags())
    return run.info.experiment_id


def reopen(client, run_id: str):
    """RUNNING again, without the marks of how it ended (a resumed sweep's parent, a resumed trial's run);
    returns the run as it was."""
    run = client.get_run(run_id)
    for key in ("error", "interrupted"):
        if key in run.data.tags:
            client.delete_tag(run_id, key)
    client.update_run(run_id, status="RUNNING")
    return run


# ---------------------------------------------------------------------------------------------
# The sweeps whose driver is gone (drivers.py says how a driver is recorded and judged)


class Heartbeat:
    """Refreshes the parent run's `raysweep.heartbeat` every HEARTBEAT_EVERY_S while the sweep runs (a thread
    of its own, with a client of its own; a failed write is logged and retried at the next beat)."""

    def __init__(self, tracking_uri: str, run_id: str, every_s: float = drivers.HEARTBEAT_EVERY_S):
        import threading

        self.tracking_uri, self.run_id, self.every_s = tracking_uri, run_id, every_s
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="raysweep-heartbeat", daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join(timeout=10)

    def _run(self):
        from mlflow.tracking import MlflowClient

        client = MlflowClient(self.tracking_uri)
        while not self.done.wait(self.every_s):
            try:
                client.set_tag(self.run_id, "raysweep.heartbeat", repr(time.time()))
            except Exception as e:  # a busy store: the next beat tries again
                log.warning("heartbeat of run %s not written: %s", self.run_id, e)


def reconcile_orphans(tracking_uri: str, keep: str | None = None) -> list[str]:
    """End every sweep on the store whose driver is gone (parent and RUNNING children FAILED, tagged
    `error: driver lost`), but the parent `keep` (a `--resume` takes its own sweep over). Returns the parent run
    ids ended. A store that does not exist yet holds none (and is not created)."""
    from mlflow.tracking import MlflowClient

    db = sqlite_path(tracking_uri)
    if db is not None and not db.is_file():
        return []
    client = MlflowClient(tracking_uri)
    ended = []
    experiments = [e.experiment_id for e in client.search_experiments()]
    if not experiments:
        return []
    for run in client.search_runs(experiments, filter_string="attributes.status = 'RUNNING'", max_results=10_000):
        if run.info.run_id == keep or "mlflow.parentRunId" in run.data.tags:
            continue
        if drivers.driver_alive(run.data.tags) is False:
            end_sweep(tracking_uri, run.info.run_id, "FAILED", error=drivers.DRIVER_LOST)
            log.warning("MLflow run %s (%s): its sweep's driver is gone; ended FAILED (%s)", run.info.run_id,
                        run.info.run_name, drivers.DRIVER_LOST)
            ended.append(run.info.run_id)
    return ended


def end_sweep(tracking_uri: str, parent_run_id: str, status: str, error: str | None = None) -> None:
    """End a sweep with `status`, and its children still RUNNING: FAILED with it, else KILLED + interrupted (a
    resume sets them RUNNING again); `error` (the cause) as a tag on each. Children that ended keep their verdict."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    experiment_id = client.get_run(parent_run_id).info.experiment_id
    children = client.search_runs(
        [experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent_run_id}' and attributes.status = 'RUNNING'"
    )
    child_status = "FAILED" if status == "FAILED" else "KILLED"
    for run_id, ends in [(c.info.run_id, child_status) for c in children] + [(parent_run_id, status)]:
        if ends == "KILLED":  # interrupted: `tune --resume` sets them RUNNING again
            client.set_tag(run_id, "interrupted", "true")
        elif run_id != parent_run_id:  # not its own failure but the sweep's: `tune --resume` continues it
            client.set_tag(run_id, "failure", INFRA)
        if error:
            client.set_tag(run_id, "error", error[:5000])
        client.set_terminated(run_id, status=ends)


def _set_tags(client, run_id: str, tags: dict) -> None:
    from mlflow.entities import RunTag

    client.log_batch(run_id, tags=[RunTag(k, v) for k, v in tags.items()])


class Writer:
    """A sweep's MLflow writes, in the order they were put, on a thread of their own: Tune's loop (ASHA's decisions,
    the next trial's start, every slot waiting at a rung) never waits on the store, which is tens of ms a write on
    SQLite and more on a remote server, for every trial's every epoch.

    A write that fails is tried again, with backoff, for up to `retry_s` (mlflow.retry_s): a tracking server that
    restarts, a busy database. Writes must be safe to repeat (the callback's are: a run is looked up before it is
    created, an epoch's metrics are checked against the store after a failed attempt). Past `retry_s` the writer
    stops: the writes after it are dropped (they would land out of order) and the error is raised by the next `put`
    or `flush`, so a store that stays down ends the sweep with its cause. `flush` waits for everything put so far."""

    def __init__(self, name: str, retry_s: float = 300.0):
        import queue
        import threading

        self.name, self.error, self.retry_s = name, None, retry_s
        self.queue: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, name=f"mlflow-writer {name}", daemon=True)
        self.thread.start()

    def put(self, write) -> None:
        self._raise()
        self.queue.put(write)

    def flush(self) -> None:
        self.queue.join()
        self._raise()

    def _raise(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"MLflow write failed: {type(self.error).__name__}: {self.error}") from self.error

    def _run(self) -> None:
        while True:
            write = self.queue.get()
            try:
                if self.error is None:
                    self._write(write)
            except BaseException as e:  # kept for the caller: this thread has no one to raise to
                log.error("MLflow write for %s failed for %.0f s (mlflow.retry_s): %s: %s", self.name, self.retry_s,
                          type(e).__name__, e)
                self.error = e
            finally:
                self.queue.task_done()

    def _write(self, write) -> None:
        deadline, delay = time.monotonic() + self.retry_s, RETRY_FIRST_S
        while True:
            try:
                write()
                return
            except Exception as e:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise
                if delay == RETRY_FIRST_S:
                    log.warning("MLflow store not answering (%s: %s); writes of %s retried for up to %.0f s",
                                type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "", self.name, left)
                time.sleep(min(delay, left))
                delay = min(2 * delay, RETRY_MAX_S)


RETRY_FIRST_S, RETRY_MAX_S = 0.5, 15.0  # a failed write's first wait, and the longest between two attempts

_WRITERS: dict[str, Writer] = {}  # this driver's writers, by parent run (the callback Tune restores finds its own)


def writer(parent_run_id: str, retry_s: float = 300.0) -> Writer:
    """The sweep's MLflow writer (one per parent run in this process), started on first use."""
    if parent_run_id not in _WRITERS:
        _WRITERS[parent_run_id] = Writer(parent_run_id, retry_s)
    return _WRITERS[parent_run_id]


def flush_writes(parent_run_id: str) -> None:
    """Wait until every queued write of the sweep is in the store (raises the first that failed). Before anything
    that reads the store or ends runs: the sweep's end, its summary, Ctrl-C."""
    if parent_run_id in _WRITERS:
        _WRITERS[parent_run_id].flush()


def make_mlflow_callback(tracking_uri: str, experiment_id: str, parent_run_id: str, config, train_size: int,
                         on_recorded=None):
    """The `ray.tune.Callback` that does all of a sweep's MLflow writing, on the driver, through the sweep's
    `Writer` (off Tune's loop: `flush_writes` before reading the store).

    One child run per trial under the parent: params at trial start (knobs + derived), metrics per
    report with step = epoch, and the final status: FINISHED (reached max_t), KILLED + stopped_by=asha
    (cut early), FAILED + error tag. Run ids live in get_state/set_state so a restored sweep keeps
    writing to the same runs. `on_recorded(trial_id, epoch)` (picklable: Tune pickles callbacks) is told,
    after each write of a result, the last epoch the store holds for the trial (a slot checkpoints only
    past epochs the store holds: slots.Broker.recorded_through).

    MLflow appends: an epoch reported again (a worker group restarted from an older checkpoint, a
    resumed trial) would be a second value at the same step. The callback keeps the last epoch it
    logged per run (in its state too) and skips anything at or below it; after a restore it reads that
    epoch back from the store, which the last saved state may trail.
    """
    import threading

    from mlflow.entities import RunTag
    from mlflow.exceptions import MlflowException
    from ray.tune import Callback

    class MLflowSweepCallback(Callback):
        def __init__(self):
            self.tracking_uri, self.experiment_id, self.parent_run_id = tracking_uri, experiment_id, parent_run_id
            self.config, self.train_size, self.on_recorded = config, train_size, on_recorded
            self.runs: dict[str, str] = {}  # trial id → MLflow run id
            self.logged: dict[str, int] = {}  # trial id → last epoch logged
            self.unsure: set[str] = set()  # trials whose last metrics write failed: it may have landed (re-read)
            self.settled: set[str] = set()  # trials whose run ended for good before a --resume: never written again
            self._client = None
            self._lock = threading.Lock()  # runs and logged: written on the writer's thread, read by get_state

        @property
        def client(self):
            if self._client is None:
                from mlflow.tracking import MlflowClient

                self._client = MlflowClient(self.tracking_uri)
            return self._client

        def __getstate__(self):  # Tune pickles callbacks with the experiment; a client and a lock are not state
            return {**self.__dict__, "_client": None, "_lock": None}

        def __setstate__(self, state):
            self.__dict__.update(state)
            self._lock = threading.Lock()
            self.unsure, self.settled = set(), set()

        def _put(self, write) -> None:
            writer(self.parent_run_id, self.config.mlflow.retry_s).put(write)

        def get_state(self) -> dict:
            with self._lock:
                return {"runs": dict(self.runs), "parent_run_id": self.parent_run_id, "logged": dict(self.logged)}

        def set_state(self, state: dict) -> None:
            self.runs.update(state["runs"])
            self.parent_run_id = state["parent_run_id"]
            self.logged.update(state.get("logged", {}))
            for trial_id, run_id in self.runs.items():  # the store is the truth: the state may trail it
                self._read_logged(trial_id, run_id)

        def on_experiment_end(self, trials, **info):
            flush_writes(self.parent_run_id)

        def _read_logged(self, trial_id: str, run_id: str) -> None:
            """The last epoch the store holds for a run (it may be ahead of the saved state)."""
            history = self.client.get_metric_history(run_id, "epoch")
            with self._lock:
                self.logged[trial_id] = max([int(m.step) for m in history] + [self.logged.get(trial_id, 0)])

        def _run_for(self, trial_id: str, knobs: dict) -> str:
            run_id = self.runs.get(trial_id) or self._existing_run(trial_id)
            if run_id is not None:
                with self._lock:
                    self.runs[trial_id] = run_id
            else:
                from mlflow.entities import Param

                tags = {"mlflow.parentRunId": self.parent_run_id, "trial_id": trial_id}
                if self.config.is_baseline(knobs):
                    tags["raysweep.baseline"] = "true"
                run = self.client.create_run(self.experiment_id, run_name=trial_id, tags=tags)
                run_id = run.info.run_id
                with self._lock:
                    self.runs[trial_id] = run_id
                params = self.config.trial(knobs, self.train_size).params()
                self.client.log_batch(run_id, params=[Param(k, str(v)) for k, v in params.items()])
            return run_id

        def _existing_run(self, trial_id: str) -> str | None:
            """The trial's child run when the saved state predates it (a driver killed after creating it)."""
            found = self.client.search_runs(
                [self.experiment_id], max_results=1,
                filter_string=f"tags.mlflow.parentRunId = '{self.parent_run_id}' and tags.trial_id = '{trial_id}'")
            if not found:
                return None
            run_id = found[0].info.run_id
            self._read_logged(trial_id, run_id)
            return run_id

        # Tune's events: what a write needs is taken now (the trial object changes); the write goes to the writer

        def on_trial_start(self, iteration, trials, trial, **info):
            trial_id, knobs = trial.trial_id, dict(trial.config)

            def write():
                from raysweep.failures import settled

                run_id = self._run_for(trial_id, knobs)
                run = self.client.get_run(run_id)
                if run.info.status == "RUNNING":
                    return
                if settled(run.info.status, run.data.tags) is not False:  # its relay ends it as it ended (--resume)
                    self.settled.add(trial_id)
                else:  # resumed: interrupted (KILLED) or failed for the infrastructure
                    reopen(self.client, run_id)
                    if "failure" in run.data.tags:
                        self.client.delete_tag(run_id, "failure")

            self._put(write)

        def on_trial_result(self, iteration, trials, trial, result, **info):
            trial_id, knobs = trial.trial_id, dict(trial.config)
            step, now = int(result.get("epoch", 0)), int(time.time() * 1000)
            retries = int(result.get("infra_retries", 0))
            eager = bool(result.get(EAGER_FALLBACK))
            values = {k: float(result[k]) for k in (*METRIC_NAMES, *STARTUP_NAMES) if result.get(k) is not None}
            worker_params = {k: str(result[k]) for k in WORKER_PARAMS if k in result}

            def write():
                from mlflow.entities import Metric, Param

                if trial_id in self.settled:
                    return
                run_id = self._run_for(trial_id, knobs)
                if trial_id in self.unsure:  # a failed attempt may have landed: the store says what it holds
                    self._read_logged(trial_id, run_id)
                    self.unsure.discard(trial_id)
                last = self.logged.get(trial_id, 0)
                if step > last:  # else reported again after a restart: MLflow already holds this epoch
                    metrics = [Metric(k, v, now, step) for k, v in values.items()]
                    params = [Param(k, v) for k, v in worker_params.items()] if last == 0 else []  # known after the probe
                    self.unsure.add(trial_id)
                    try:
                        self.client.log_batch(run_id, metrics=metrics, params=params)
                    except MlflowException as e:  # a param logged before with another value (a restart elsewhere)
                        if e.error_code != "INVALID_PARAMETER_VALUE":
                            raise
                        self.client.log_batch(run_id, metrics=metrics)
                    self.unsure.discard(trial_id)
                    with self._lock:
                        self.logged[trial_id] = step
                    if retries:
                        self.client.set_tag(run_id, "raysweep.infra_retries", str(retries))
                    if eager:
                        self.client.set_tag(run_id, "raysweep.eager_fallback", "true")
                if self.on_recorded is not None:
                    self.on_recorded(trial_id, self.logged.get(trial_id, 0))

            self._put(write)

        def on_trial_complete(self, iteration, trials, trial, **info):
            trial_id, knobs = trial.trial_id, dict(trial.config)
            view = TrialView.of_trial(trial, self.config.horizon, ended="complete")

            def write():
                if trial_id in self.settled:
                    return
                run_id = self._run_for(trial_id, knobs)
                if view.status == "finished":
                    self.client.set_terminated(run_id, status="FINISHED")
                else:
                    self.client.set_tag(run_id, "stopped_by", "asha")
                    self.client.set_tag(run_id, "stopped_at_epoch", str(view.epoch))
                    self.client.set_terminated(run_id, status="KILLED")

            self._put(write)

        def on_trial_error(self, iteration, trials, trial, **info):
            from raysweep.failures import kind_of

            trial_id, knobs = trial.trial_id, dict(trial.config)
            line = TrialView.of_trial(trial, self.config.horizon, ended="error").error
            kind = kind_of(_pickled_error(trial))  # typed, as the relay raised it (failures.TrialFailure)

            def write():
                if trial_id in self.settled:
                    return
                run_id = self._run_for(trial_id, knobs)
                self.client.log_batch(run_id, tags=[RunTag("error", line[:5000]), RunTag("failure", kind)])
                self.client.set_terminated(run_id, status="FAILED")

            self._put(write)

    return MLflowSweepCallback()


def _pickled_error(trial) -> BaseException | None:
    """The exception Tune kept for an errored trial (a RayTaskError around what the trial function raised)."""
    import cloudpickle

    try:
        local = trial.pickled_error_file  # written by Trial.handle_error before Tune calls on_trial_error
        if local and Path(local).is_file():
            return cloudpickle.loads(Path(local).read_bytes())
        return trial.get_pickled_error()
    except Exception as e:  # not there, or not unpicklable here: the trial's own error
        log.warning("trial %s: its error could not be read back (%s: %s)", trial.trial_id, type(e).__name__, e)
        return None


def log_sweep_figures(tracking_uri: str, parent_run_id: str, figures: dict[str, float]) -> None:
    """Figures of the sweep as a whole (busy_share, wall_s, …) on the parent run; a resumed sweep logs its own
    driver's again (the latest value is the last run's)."""
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    now = int(time.time() * 1000)
    MlflowClient(tracking_uri).log_batch(parent_run_id, metrics=[Metric(k, float(v), now, 0) for k, v in figures.items()])


def close_sweep(tracking_uri: str, parent_run_id: str, best: dict | None, metric: str, status: str) -> None:
    """End the parent run with the best trial's params and metric; end children left RUNNING (end_sweep)."""
    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    if best is not None:
        params = [Param(f"best.{k}", str(v)) for k, v in best["params"].items()]
        now = int(time.time() * 1000)
        metrics = [Metric(f"best_{metric}", float(best["value"]), now, 0)] if best["value"] is not None else []
        if best.get("time_to_target_s") is not None:
            metrics.append(Metric("best_time_to_target_s", float(best["time_to_target_s"]), now, 0))
        client.log_batch(parent_run_id, metrics=metrics, params=params)
        client.set_tag(parent_run_id, "best_trial_id", best["trial_id"])
    end_sweep(tracking_uri, parent_run_id, status)


def target_tags(target) -> dict[str, str]:
    """The parent run's tags for tune.target (config.TargetConfig or None): `report` ranks by them."""
    if target is None:
        return {}
    return {"raysweep.target_metric": target.metric, "raysweep.target_value": repr(target.value)}


def epoch_seconds_by_batch(tracking_uri: str, experiment: str) -> dict[int, float]:
    """Training seconds an epoch per global batch, as the experiment's trials measured them (the median over its
    runs of train_seconds ÷ epoch, last values): `check` turns rungs into the other unit with it. {} when the
    store or the experiment does not exist (nothing is created)."""
    import statistics

    from mlflow.tracking import MlflowClient

    db = sqlite_path(tracking_uri)
    if db is not None and not db.is_file():
        return {}
    client = MlflowClient(tracking_uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return {}
    seen: dict[int, list[float]] = {}
    for run in client.search_runs([found.experiment_id], filter_string="metrics.train_seconds > 0",
                                  max_results=1000):
        m, batch = run.data.metrics, run.data.params.get("global_batch_size")
        if batch and m.get("epoch"):
            seen.setdefault(int(batch), []).append(m["train_seconds"] / m["epoch"])
    return {b: statistics.median(v) for b, v in seen.items()}


def settled_trials(tracking_uri: str, parent_run_id: str) -> dict[str, dict]:
    """{trial id: {"failure": how it failed or None, "last": its last reported metrics}} for a sweep's trials whose
    end the store holds as final (failures.settled): a resumed sweep's relays end them so (a pruned or finished one
    reports its last result again: Tune needs one with the metric), and never train them again."""
    from mlflow.tracking import MlflowClient

    from raysweep.failures import settled

    client = MlflowClient(tracking_uri)
    experiment_id = client.get_run(parent_run_id).info.experiment_id
    out = {}
    for child in client.search_runs([experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent_run_id}'",
                                    max_results=10_000):
        verdict = settled(child.info.status, child.data.tags)
        if verdict is not False:
            last = dict(child.data.metrics)
            if "resolved_epochs" in child.data.params:  # what metrics.Horizon reads to call it finished
                last["resolved_epochs"] = int(child.data.params["resolved_epochs"])
            out[child.data.tags.get("trial_id", child.info.run_name)] = {"failure": verdict, "last": last}
    return out


def trial_histories(tracking_uri: str, parent_run_id: str, time_attr: str, metric: str) -> dict:
    """{trial id: [(time_attr, metric) per reported epoch, in order]} of a sweep's children, from the store."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    experiment_id = client.get_run(parent_run_id).info.experiment_id
    out = {}
    for child in client.search_runs([experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent_run_id}'",
                                    max_results=10_000):
        clock = {int(m.step): m.value for m in client.get_metric_history(child.info.run_id, time_attr)}
        values = {int(m.step): m.value for m in client.get_metric_history(child.info.run_id, metric)}
        reports = [(clock[e], values[e]) for e in sorted(clock) if e in values]
        if reports:
            out[child.data.tags.get("trial_id", child.info.run_name)] = reports
    return out


def log_recommendation(tracking_uri: str, run_id: str, rec) -> None:
    """The time-to-target table (`rec`: noise.Recommendation) on a run: metrics `grad_noise_scale` and
    `recommended_global_batch`, and the table as recommendation.json."""
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    now = int(time.time() * 1000)
    client.log_batch(run_id, metrics=[Metric("grad_noise_scale", rec.noise_scale, now, 0),
                                      Metric("recommended_global_batch", rec.fastest.global_batch, now, 0)])
    client.log_text(run_id, json.dumps(rec.as_dict(), indent=1), "recommendation.json")


def last_noise_scale(tracking_uri: str, experiment: str) -> tuple[float, str]:
    """B_noise of the experiment's newest sweep that measured one: (value, where from)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    found = client.get_experiment_by_name(experiment)
    runs = [] if found is None else client.search_runs(
        [found.experiment_id], filter_string="tags.`raysweep.kind` = 'tune' and metrics.grad_noise_scale > 0",
        order_by=["attributes.start_time DESC"], max_results=1)
    if not runs:
        raise UserError(f"--noise-scale last: no sweep in experiment {experiment!r} of {tracking_uri} measured "
                        f"grad_noise_scale; run `tune` first, or give a number (--noise-scale 500)")
    run = runs[0]
    return run.data.metrics["grad_noise_scale"], f"sweep {run.info.run_name}"


def log_probe(result, spec_text: str, experiment: str, tracking_uri: str, margin: float) -> str:
    """The probe as an MLflow run of its own (`result`: probe.ProbeResult): metrics per batch (step =
    per-GPU batch), the recommendation as params, the JSON table and a PNG plot. Returns the run id."""
    import tempfile

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient

    _, run_id = open_sweep(tracking_uri, experiment, run_name=f"probe {datetime.now():%Y-%m-%d %H:%M:%S}",
                           tags={"raysweep.kind": "probe"}, spec_text=spec_text)
    client = MlflowClient(tracking_uri)
    now = int(time.time() * 1000)
    keys = ("peak_mem_allocated_gb", "peak_mem_reserved_gb", "peak_rss_gb", "step_time_s", "images_per_s", "fits")
    metrics = [Metric(k, float(getattr(r, k)), now, r.per_gpu_batch_size) for r in result.rows for k in keys]
    params = {"world_size": result.world_size, "device_name": result.device_name, "precision": result.precision,
              "largest_per_gpu_batch": result.largest, "recommended_per_gpu_batch": result.recommended,
              "margin": margin, "memory_limit_gb": round(result.limit_gb, 3)}
    client.log_batch(run_id, metrics=metrics, params=[Param(k, str(v)) for k, v in params.items()])
    client.log_text(run_id, json.dumps([asdict(r) for r in result.rows], indent=1), "probe.json")
    fig, (ax_mem, ax_rate) = plt.subplots(1, 2, figsize=(10, 4))
    xs = [r.per_gpu_batch_size for r in result.rows]
    colors = ["tab:green" if r.fits else "tab:red" for r in result.rows]
    for ax, key, label in ((ax_mem, result.memory_key, "peak memory (GiB)"), (ax_rate, "images_per_s", "images/s")):
        ax.scatter(xs, [getattr(r, key) for r in result.rows], c=colors)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("per-GPU batch")
        ax.set_ylabel(label)
    ax_mem.axhline(result.limit_gb, color="grey", linestyle="--", label="limit after margin")
    ax_mem.legend()
    fig.suptitle(f"probe: {result.world_size} × {result.device_name}, {result.precision} (red: OOM)")
    fig.tight_layout()
    with tempfile.TemporaryDirectory() as d:
        png = Path(d) / "probe.png"
        fig.savefig(png, dpi=100)
        client.log_artifact(run_id, str(png))
    plt.close(fig)
    client.set_terminated(run_id, status="FINISHED")
    return run_id


def load_sweep(tracking_uri: str, experiment: str, parent_run_id: str | None = None) -> SweepRecord:
    """A sweep from the MLflow store alone (the newest `tune` parent run of `experiment`, or the one given).

    An absent store, an unknown experiment or one without a sweep is a UserError (no store is created).
    """
    from mlflow.tracking import MlflowClient

    db = sqlite_path(tracking_uri)
    if db is not None and not db.is_file():
        raise UserError(f"report: no MLflow store at {db}; pass --tracking-uri sqlite:///path/to/mlflow.db "
                        f"(the store the sweep printed)")
    client = MlflowClient(tracking_uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        names = sorted(e.name for e in client.search_experiments() if e.name != "Default")
        raise UserError(f"report: no experiment {experiment!r} in {tracking_uri}; "
                        + (f"it holds {', '.join(map(repr, names))}" if names else "the store is empty"))
    if parent_run_id is None:
        parents = client.search_runs([found.experiment_id], filter_string="tags.`raysweep.kind` = 'tune'",
                                     order_by=["attributes.start_time DESC"], max_results=50)
        if not parents:
            raise UserError(f"report: experiment {experiment!r} in {tracking_uri} holds no sweep (no `tune` run)")
        # the newest sweep that ran a trial: one that failed before its first trial has nothing to show
        parent = next((p for p in parents if client.search_runs(
            [found.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{p.info.run_id}'", max_results=1)),
            parents[0])
    else:
        parent = client.get_run(parent_run_id)
    tags = parent.data.tags
    spec_text = _artifact_text(client, parent.info.run_id, "spec.yaml")
    metric, mode = tags.get("raysweep.metric"), tags.get("raysweep.mode")
    if metric is None:  # a sweep from before the tags: its spec says
        import yaml

        tune = (yaml.safe_load(spec_text or "") or {}).get("tune", {})
        metric, mode = tune.get("metric", "val_loss"), tune.get("mode", "min")
    target = ((tags["raysweep.target_metric"], float(tags["raysweep.target_value"]))
              if "raysweep.target_metric" in tags else None)
    children = client.search_runs([found.experiment_id], max_results=10_000,
                                  filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'",
                                  order_by=["attributes.start_time ASC"])
    wanted = dict.fromkeys(("epoch", metric, *METRIC_NAMES))
    trials = []
    for child in children:
        history = {name: {int(m.step): m.value for m in client.get_metric_history(child.info.run_id, name)}
                   for name in wanted if name in child.data.metrics}
        info, ctags = child.info, child.data.tags
        status = {"FINISHED": "finished", "FAILED": "failed", "RUNNING": "running"}.get(info.status)
        if status is None:  # KILLED: by ASHA, or by an interrupted sweep
            status = "pruned" if ctags.get("stopped_by") == "asha" else "interrupted"
        wall = (info.end_time - info.start_time) / 1000 if info.end_time else None
        trials.append(RunRecord(info.run_id, ctags.get("trial_id", info.run_name), status, dict(child.data.params),
                                history, dict(ctags), wall, ctags.get("raysweep.baseline") == "true"))
    return SweepRecord(tracking_uri, experiment, found.experiment_id, parent.info.run_id, parent.info.run_name,
                       metric, mode or "min", spec_text or "", trials, target)


def _artifact_text(client, run_id: str, path: str) -> str | None:
    import tempfile

    try:
        with tempfile.TemporaryDirectory() as d:
            return Path(client.download_artifacts(run_id, path, d)).read_text()
    except Exception:  # absent (an older run): the caller falls back
        return None


def log_report(tracking_uri: str, record: SweepRecord, folder: Path, trial_pngs: dict[str, Path],
               summary: list[dict]) -> None:
    """The report's files on the parent run (under report/), each trial's curves on its child run, and the
    summary table (with the baseline deltas) as the parent's summary.json."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    client.log_artifacts(record.parent_run_id, str(folder), "report")
    client.log_text(record.parent_run_id, json.dumps(summary, indent=1), "summary.json")
    for run_id, png in trial_pngs.items():
        client.log_artifact(run_id, str(png))


def runs_link(tracking_uri: str, experiment_id: str, parent_run_id: str | None = None, metric: str | None = None,
              mode: str = "min", port: int = 5000) -> tuple[str, str]:
    """(`mlflow ui` command, link to the runs table). 3.17 opens an experiment on a GenAI page, and its runs
    table shows a sweep as one collapsed parent row: the link filters to the sweep's trials (listed flat)
    and sorts them by the ranking metric."""
    from urllib.parse import quote

    command = f"mlflow ui --backend-store-uri {tracking_uri} --host 127.0.0.1 --port {port}"
    link = f"http://127.0.0.1:{port}/#/experiments/{experiment_id}/runs?workflowType=machine_learning"
    if parent_run_id:
        link += "&searchFilter=" + quote(f"tags.mlflow.parentRunId = '{parent_run_id}'", safe="")
    if metric:
        link += "&orderByKey=" + quote(f"metrics.`{metric}`", safe="") + f"&orderByAsc={str(mode == 'min').lower()}"
    return command, link
