"""What the driver and the report read back from the store: a sweep whole (load_sweep; read_sweep for a command that
only reads, bounded and with its orphans ended first), the trials a resume
must not run again, ASHA's rung histories, the epoch seconds `check` shows, the last noise scale."""

from __future__ import annotations

from raysweep.errors import UserError
from raysweep.metrics import (
    METRIC_NAMES,
    TAG_BASELINE,
    ConfirmationRecord,
    RunRecord,
    SweepRecord,
    outcome_of_run,
    seconds_to_value,
)
from raysweep.tracking.orphans import reconcile_orphans
from raysweep.tracking.store import _artifact_text, in_store, mlflow_client, sqlite_path


def read_sweep(tracking_uri: str, experiment: str, retry_s: float, command: str = "report") -> SweepRecord:
    """The newest sweep of `experiment` as `report`, `answer` and `confirm` read it: a sweep whose driver died is
    ended first (not read as still running); each call waited for at most `retry_s` (mlflow.retry_s), so a store
    that does not answer ends the command in one line (errors.StoreUnavailable), never holds it."""
    in_store(lambda: reconcile_orphans(tracking_uri), tracking_uri, retry_s, "the orphans' search")
    return in_store(lambda: load_sweep(tracking_uri, experiment, command=command), tracking_uri, retry_s,
                    "the sweep's read")


def epoch_seconds_by_batch(tracking_uri: str, experiment: str) -> dict[int, float]:
    """Training seconds an epoch per global batch, as the experiment's trials measured them (the median over its
    runs of train_seconds ÷ epoch, last values): `check` turns rungs into the other unit with it. {} when the
    store or the experiment does not exist (nothing is created)."""
    import statistics

    db = sqlite_path(tracking_uri)
    if db is not None and not db.is_file():
        return {}
    client = mlflow_client(tracking_uri)
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


def settled_trials(tracking_uri: str, parent_run_id: str) -> dict:
    """{trial id: failures.Settled, with its last reported metrics} for a sweep's trials whose end the store holds
    as final (failures.settled): a resumed sweep's relays end them so (a pruned or finished one reports its last
    result again: Tune needs one with the metric), and never train them again."""
    import dataclasses

    from raysweep.failures import settled

    client = mlflow_client(tracking_uri)
    experiment_id = client.get_run(parent_run_id).info.experiment_id
    out = {}
    for child in client.search_runs([experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent_run_id}'",
                                    max_results=10_000):
        verdict = settled(child.info.status, child.data.tags)
        if verdict is not None:
            last = dict(child.data.metrics)
            if "resolved_epochs" in child.data.params:  # what metrics.Horizon reads to call it finished
                last["resolved_epochs"] = int(child.data.params["resolved_epochs"])
            out[child.data.tags.get("trial_id", child.info.run_name)] = dataclasses.replace(verdict, last=last)
    return out


def trial_histories(tracking_uri: str, parent_run_id: str, time_attr: str, metric: str) -> dict:
    """{trial id: [(time_attr, metric) per reported epoch, in order]} of a sweep's children, from the store."""
    client = mlflow_client(tracking_uri)
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


def last_noise_scale(tracking_uri: str, experiment: str) -> tuple[float, str]:
    """B_noise of the experiment's newest sweep that measured one: (value, where from)."""
    client = mlflow_client(tracking_uri)
    found = client.get_experiment_by_name(experiment)
    runs = [] if found is None else client.search_runs(
        [found.experiment_id], filter_string="tags.`raysweep.kind` = 'tune' and metrics.grad_noise_scale > 0",
        order_by=["attributes.start_time DESC"], max_results=1)
    if not runs:
        raise UserError(f"--noise-scale last: no sweep in experiment {experiment!r} of {tracking_uri} measured "
                        f"grad_noise_scale; run `tune` first, or give a number (--noise-scale 500)")
    run = runs[0]
    return run.data.metrics["grad_noise_scale"], f"sweep {run.info.run_name}"


def load_sweep(tracking_uri: str, experiment: str, parent_run_id: str | None = None,
               command: str = "report") -> SweepRecord:
    """A sweep from the MLflow store alone (the newest `tune` parent run of `experiment`, or the one given).

    An absent store, an unknown experiment or one without a sweep is a UserError naming `command` (no store is
    created).
    """
    db = sqlite_path(tracking_uri)
    if db is not None and not db.is_file():
        raise UserError(f"{command}: no MLflow store at {db}; pass --tracking-uri sqlite:///path/to/mlflow.db "
                        f"(the store the sweep printed)")
    client = mlflow_client(tracking_uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        names = sorted(e.name for e in client.search_experiments() if e.name != "Default")
        raise UserError(f"{command}: no experiment {experiment!r} in {tracking_uri}; "
                        + (f"it holds {', '.join(map(repr, names))}" if names else "the store is empty"))
    if parent_run_id is None:
        parents = client.search_runs([found.experiment_id], filter_string="tags.`raysweep.kind` = 'tune'",
                                     order_by=["attributes.start_time DESC"], max_results=50)
        if not parents:
            raise UserError(f"{command}: experiment {experiment!r} in {tracking_uri} holds no sweep (no `tune` run)")
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
        status = outcome_of_run(info.status, ctags)
        wall = (info.end_time - info.start_time) / 1000 if info.end_time else None
        trials.append(RunRecord(info.run_id, ctags.get("trial_id", info.run_name), status, dict(child.data.params),
                                history, dict(ctags), wall, ctags.get(TAG_BASELINE) == "true"))
    return SweepRecord(tracking_uri, experiment, found.experiment_id, parent.info.run_id, parent.info.run_name,
                       metric, mode or "min", spec_text or "", trials, target,
                       confirmations(client, found.experiment_id, parent.info.run_id, metric, mode or "min"))


def confirmations(client, experiment_id: str, sweep_run_id: str, metric: str, mode: str) -> list:
    """The `raysweep confirm` runs of a sweep (their parents tagged raysweep.confirms with its run id), oldest first,
    as metrics.ConfirmationRecord: each seed's run and what it measured, beside what was predicted."""
    import json

    from raysweep.tracking.runs import CONFIRMS, PREDICTED

    parents = client.search_runs([experiment_id], filter_string=f"tags.`{CONFIRMS}` = '{sweep_run_id}'",
                                 order_by=["attributes.start_time ASC"], max_results=100)
    out = []
    for parent in parents:
        tags = parent.data.tags
        try:
            predicted = dict(json.loads(tags[PREDICTED]))
        except (KeyError, ValueError, TypeError):
            continue  # not one this version wrote
        runs = []
        for child in client.search_runs([experiment_id], max_results=100,
                                        filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'",
                                        order_by=["attributes.start_time ASC"]):
            history = {name: {int(m.step): m.value for m in client.get_metric_history(child.info.run_id, name)}
                       for name in ("epoch", "train_seconds", metric) if name in child.data.metrics}
            m = child.data.metrics
            runs.append({"trial_id": child.data.tags.get("trial_id", child.info.run_name),
                         "seed": int(float(child.data.params.get("seed", -1))),
                         "status": outcome_of_run(child.info.status, child.data.tags),
                         "epoch": int(m.get("epoch", 0)), "value": m.get(metric),
                         "time_to_target_s": m.get("time_to_target_s"), "train_seconds": m.get("train_seconds"),
                         "seconds_to_value": (seconds_to_value(history, metric, predicted["value"], mode)
                                              if predicted.get("value") is not None else None)})
        out.append(ConfirmationRecord(parent.info.run_id, int(tags.get("raysweep.confirm_global_batch", 0)),
                                      float(tags.get("raysweep.confirm_peak_lr", "nan")), predicted, runs))
    return out
