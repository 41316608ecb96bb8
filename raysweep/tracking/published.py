"""What a sweep publishes on its runs once it is reviewed: the report's files and summary, the batch size
recommendation, and the probe's own run."""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict
from datetime import datetime
from pathlib import Path

from raysweep import layout
from raysweep.metrics import SweepRecord
from raysweep.tracking.runs import open_sweep
from raysweep.tracking.store import mlflow_client


def log_report(tracking_uri: str, record: SweepRecord, folder: Path, trial_pngs: dict[str, Path],
               summary: list[dict]) -> None:
    """The report's files on the parent run (under report/), each trial's curves on its child run, and the
    summary table (with the baseline deltas) as the parent's summary.json."""
    client = mlflow_client(tracking_uri)
    client.log_artifacts(record.parent_run_id, str(folder), "report")
    client.log_text(record.parent_run_id, json.dumps(summary, indent=1), "summary.json")
    for run_id, png in trial_pngs.items():
        client.log_artifact(run_id, str(png))


def log_recommendation(tracking_uri: str, run_id: str, rec) -> None:
    """The time-to-target table (`rec`: noise.Recommendation, the evidence beside the answer, not an answer of its
    own) on a run: metric `grad_noise_scale`, and the table as recommendation.json."""
    from mlflow.entities import Metric

    client = mlflow_client(tracking_uri)
    now = int(time.time() * 1000)
    client.log_batch(run_id, metrics=[Metric("grad_noise_scale", rec.noise_scale, now, 0)])
    client.log_text(run_id, json.dumps(rec.as_dict(), indent=1), "recommendation.json")


ANSWER_PARAMS_OUTDATED = "answer.params_outdated"  # a tag: the answer changed since its params were logged


def log_answer(tracking_uri: str, run_id: str, answer) -> None:
    """The sweep's answer (`answer`: answer.Answer) on its parent run: `answer.*` params (the recipe, as text) and
    metrics (its numbers, the fit's exponent, a confirmation's measurements), and answer.json. MLflow's params never
    change once logged: where a later answer differs (a resumed sweep, a confirmation), the params keep the first
    and the tag ANSWER_PARAMS_OUTDATED says so; the metrics and answer.json are always the current answer, whole: a
    metric this answer has no value for (no fit, no confirmation, no target) is logged NaN, so that no earlier
    answer's figure stands beside it (MLflow keeps a metric's history; it cannot delete one)."""
    from mlflow.entities import Metric, Param, RunTag

    from raysweep.answer.records import METRIC_KEYS

    client = mlflow_client(tracking_uri)
    held = client.get_run(run_id).data.params
    params = answer.params()
    changed = sorted(k for k, v in params.items() if k in held and held[k] != v)
    now = int(time.time() * 1000)
    figures = {f"answer.{k}": math.nan for k in METRIC_KEYS} | answer.metrics()
    client.log_batch(run_id, metrics=[Metric(k, v, now, 0) for k, v in figures.items()],
                     params=[Param(k, v) for k, v in params.items() if k not in held],
                     tags=[RunTag(ANSWER_PARAMS_OUTDATED, ", ".join(changed))] if changed else [])
    if not changed and ANSWER_PARAMS_OUTDATED in client.get_run(run_id).data.tags:
        client.delete_tag(run_id, ANSWER_PARAMS_OUTDATED)
    client.log_text(run_id, json.dumps(answer.as_json(), indent=1), "answer.json")


def log_confirmation(tracking_uri: str, confirmation) -> None:
    """A `confirm` run's finding on its own parent run (`confirmation`: metrics.ConfirmationRecord): metrics
    `predicted_*` and `measured_*` (the mean over its seeds) of the value at the end, the time to the target and the
    seconds to the predicted value, where there is one."""
    from mlflow.entities import Metric
    p = confirmation.predicted
    figures = {"predicted_value": p.get("value"), "predicted_time_to_target_s": p.get("time_to_target_s"),
               "predicted_seconds_to_value": p.get("seconds")}
    for key in ("value", "time_to_target_s", "seconds_to_value"):
        figures[f"measured_{key}"] = confirmation.measured(key)
    now = int(time.time() * 1000)
    mlflow_client(tracking_uri).log_batch(confirmation.parent_run_id, metrics=[
        Metric(k, float(v), now, 0) for k, v in figures.items() if v is not None])


def log_importance(tracking_uri: str, run_id: str, importance: dict) -> None:
    """The knobs' importance on the sweep's parent run (`importance`: report.Importance.as_dict): a metric
    `importance_<knob>` each, and the whole as importance.json (the budget it was taken at, the trials)."""
    from mlflow.entities import Metric

    client = mlflow_client(tracking_uri)
    now = int(time.time() * 1000)
    client.log_batch(run_id, metrics=[Metric(f"importance_{knob}", share, now, 0)
                                      for knob, share in importance["importance"].items()])
    client.log_text(run_id, json.dumps(importance, indent=1), "importance.json")


def log_probe(result, spec_text: str, experiment: str, tracking_uri: str, margin: float, plot: Path) -> str:
    """The probe as an MLflow run of its own (`result`: probe.ProbeResult): metrics per batch (step = per-GPU batch),
    the recommendation as params, the JSON table and its plot (`plot`: a PNG, report.plots.probe_plot). Returns
    the run id."""
    from mlflow.entities import Metric, Param
    _, run_id = open_sweep(tracking_uri, experiment, run_name=f"probe {datetime.now():%Y-%m-%d %H:%M:%S}",
                           tags={"raysweep.kind": "probe"}, spec_text=spec_text)
    client = mlflow_client(tracking_uri)
    now = int(time.time() * 1000)
    keys = ("peak_mem_allocated_gb", "peak_mem_reserved_gb", "peak_rss_gb", "step_time_s", "images_per_s", "fits")
    metrics = [Metric(k, float(getattr(r, k)), now, r.per_gpu_batch_size) for r in result.rows for k in keys]
    params = {"world_size": result.world_size, "device_name": result.device_name, "precision": result.precision,
              "largest_per_gpu_batch": result.largest, "recommended_per_gpu_batch": result.recommended,
              "margin": margin, "memory_limit_gb": round(result.limit_gb, 3)}
    client.log_batch(run_id, metrics=metrics, params=[Param(k, str(v)) for k, v in params.items()])
    client.log_text(run_id, json.dumps([asdict(r) for r in result.rows], indent=1), layout.PROBE_FILE)
    client.log_artifact(run_id, str(plot))
    client.set_terminated(run_id, status="FINISHED")
    return run_id
