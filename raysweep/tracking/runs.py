"""A sweep's runs from opening to end: the parent run (opened, found again, taken over by `--resume`, ended
with its best trial or its cause) and its figures."""

from __future__ import annotations

import time

from raysweep import drivers
from raysweep.errors import UserError
from raysweep.failures import INFRA
from raysweep.metrics import (
    ENDING_TAGS,
    ERROR_TAG_CHARS,
    FAILED,
    FINISHED,
    INTERRUPTED,
    TAG_ERROR,
    RunEnding,
    run_ending,
)
from raysweep.tracking.store import _artifact_text, _set_tags, mlflow_client, sqlite_path


def open_sweep(tracking_uri: str, experiment: str, run_name: str, tags: dict, spec_text: str,
               params: dict[str, str] | None = None) -> tuple[str, str]:
    """Create (or reuse) the experiment and open the sweep's parent run, with the spec and `params` (the data's:
    data.describe.mlflow_params); returns (experiment_id, run_id)."""
    client = mlflow_client(tracking_uri)
    found = client.get_experiment_by_name(experiment)
    if found is not None:
        experiment_id = found.experiment_id
    else:
        db = sqlite_path(tracking_uri)
        location = (db.parent / "mlartifacts" / experiment).as_uri() if db else None
        try:
            experiment_id = client.create_experiment(experiment, artifact_location=location)
        except Exception:  # two sweeps of one name started together: the other created it first (UNIQUE name)
            found = client.get_experiment_by_name(experiment)
            if found is None:
                raise
            experiment_id = found.experiment_id
    run = client.create_run(experiment_id, run_name=run_name, tags={**tags, **drivers.driver_tags()})
    client.log_text(run.info.run_id, spec_text, "spec.yaml")
    if params:
        from mlflow.entities import Param

        client.log_batch(run.info.run_id, params=[Param(k, v) for k, v in params.items()])
    return experiment_id, run.info.run_id


def find_parent(tracking_uri: str, experiment_path: str):
    """The newest parent run of the sweep stored at `experiment_path` (an mlflow Run), or a UserError."""
    client = mlflow_client(tracking_uri)
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
    return _artifact_text(mlflow_client(tracking_uri), run_id, "spec.yaml")


def resumed_parent(tracking_uri: str, parent_run_id: str) -> str:
    """Take a sweep's parent run over for `--resume` (checked before by resume.check_resume): RUNNING again, with
    this driver's address and heartbeat. Returns its experiment id."""
    client = mlflow_client(tracking_uri)
    run = reopen(client, parent_run_id)
    _set_tags(client, parent_run_id, drivers.driver_tags())
    return run.info.experiment_id


def reopen(client, run_id: str):
    """RUNNING again, without the marks of how it ended (metrics.ENDING_TAGS: a resumed sweep's parent, a resumed
    trial's run); returns the run as it was."""
    run = client.get_run(run_id)
    for key in ENDING_TAGS:
        if key in run.data.tags:
            client.delete_tag(run_id, key)
    client.update_run(run_id, status="RUNNING")
    return run


def end_run(client, run_id: str, ending: RunEnding) -> None:
    """A run ended as metrics.run_ending encodes it: its tags, then its status."""
    if ending.tags:
        _set_tags(client, run_id, ending.tags)
    client.set_terminated(run_id, status=ending.status)


def end_sweep(tracking_uri: str, parent_run_id: str, status: str, error: str | None = None) -> None:
    """End a sweep with `status` (FINISHED: it ran to its end; KILLED: interrupted; FAILED), and its children still
    RUNNING: FAILED with it, else KILLED + interrupted (a resume sets them RUNNING again); `error` (the cause) as a
    tag on each. Children that ended keep their verdict."""
    client = mlflow_client(tracking_uri)
    experiment_id = client.get_run(parent_run_id).info.experiment_id
    children = client.search_runs(
        [experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent_run_id}' and attributes.status = 'RUNNING'"
    )
    if status == "FAILED":  # not the trials' own failure but the sweep's: `tune --resume` continues them
        child = run_ending(FAILED, failure=INFRA, error=error or "its sweep failed")
        parent = RunEnding("FAILED", {TAG_ERROR: error[:ERROR_TAG_CHARS]} if error else {})
    else:  # interrupted: `tune --resume` sets them RUNNING again
        child = parent = run_ending(INTERRUPTED, error=error)
        if status == "FINISHED":  # the sweep ran to its end (a child still RUNNING there was cut off with it)
            parent = run_ending(FINISHED)
    for c in children:
        end_run(client, c.info.run_id, child)
    end_run(client, parent_run_id, parent)


def log_sweep_figures(tracking_uri: str, parent_run_id: str, figures: dict[str, float]) -> None:
    """Figures of the sweep as a whole (busy_share, wall_s, …) on the parent run; a resumed sweep logs its own
    driver's again (the latest value is the last run's)."""
    from mlflow.entities import Metric
    now = int(time.time() * 1000)
    mlflow_client(tracking_uri).log_batch(
        parent_run_id, metrics=[Metric(k, float(v), now, 0) for k, v in figures.items()]
    )


def close_sweep(tracking_uri: str, parent_run_id: str, best: dict | None, metric: str, status: str) -> None:
    """End the parent run with the best trial's params and metric; end children left RUNNING (end_sweep)."""
    from mlflow.entities import Metric, Param

    client = mlflow_client(tracking_uri)
    if best is not None:
        params = [Param(f"best.{k}", str(v)) for k, v in best["params"].items()]
        now = int(time.time() * 1000)
        metrics = [Metric(f"best_{metric}", float(best["value"]), now, 0)] if best["value"] is not None else []
        if best.get("time_to_target_s") is not None:
            metrics.append(Metric("best_time_to_target_s", float(best["time_to_target_s"]), now, 0))
        client.log_batch(parent_run_id, metrics=metrics, params=params)
        client.set_tag(parent_run_id, "best_trial_id", best["trial_id"])
    end_sweep(tracking_uri, parent_run_id, status)


CONFIRMS, PREDICTED = "raysweep.confirms", "raysweep.predicted"  # a confirm run's parent: the sweep, the prediction


def confirm_tags(confirming) -> dict[str, str]:
    """A `confirm` run's parent tags (`confirming`: sweep.Confirming or None): the sweep it confirms, the recipe's
    global batch and peak LR, and what it was predicted to reach (JSON); reads.confirmations reads them back."""
    if confirming is None:
        return {}
    return {CONFIRMS: confirming.sweep_run_id, PREDICTED: confirming.predicted,
            "raysweep.confirm_global_batch": str(confirming.global_batch),
            "raysweep.confirm_peak_lr": repr(confirming.peak_lr)}


def target_tags(target) -> dict[str, str]:
    """The parent run's tags for tune.target (config.TargetConfig or None): `report` ranks by them."""
    if target is None:
        return {}
    return {"raysweep.target_metric": target.metric, "raysweep.target_value": repr(target.value)}
