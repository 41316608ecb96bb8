"""What a sweep publishes on its runs once it is reviewed: the report's files and summary, the batch size
recommendation, and the probe's own run."""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from datetime import datetime
from pathlib import Path

from raysweep import layout
from raysweep.metrics import SweepRecord
from raysweep.tracking.runs import open_sweep


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


def log_importance(tracking_uri: str, run_id: str, importance: dict) -> None:
    """The knobs' importance on the sweep's parent run (`importance`: report.Importance.as_dict): a metric
    `importance_<knob>` each, and the whole as importance.json (the budget it was taken at, the trials)."""
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    now = int(time.time() * 1000)
    client.log_batch(run_id, metrics=[Metric(f"importance_{knob}", share, now, 0)
                                      for knob, share in importance["importance"].items()])
    client.log_text(run_id, json.dumps(importance, indent=1), "importance.json")


def log_probe(result, spec_text: str, experiment: str, tracking_uri: str, margin: float, plot: Path) -> str:
    """The probe as an MLflow run of its own (`result`: probe.ProbeResult): metrics per batch (step = per-GPU batch),
    the recommendation as params, the JSON table and its plot (`plot`: a PNG, report.plots.probe_plot). Returns
    the run id."""
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
    client.log_text(run_id, json.dumps([asdict(r) for r in result.rows], indent=1), layout.PROBE_FILE)
    client.log_artifact(run_id, str(plot))
    client.set_terminated(run_id, status="FINISHED")
    return run_id
