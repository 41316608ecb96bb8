"""Where a sweep's MLflow store is, and how to look at it: the tracking URI every process agrees on, the
artifacts read back, the UI's link to a sweep's runs."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from raysweep.errors import UserError

log = logging.getLogger(__name__)

# MLflow draws a tqdm bar on stderr for every artifact it moves once tqdm is installed (Optuna, for tune.search:
# tpe, brings it): a report would print "Downloading artifacts" bars for a spec of a few hundred bytes. A user's
# own setting of the variable wins (mlflow/environment_variables.py, MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR).
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")


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


def _artifact_text(client, run_id: str, path: str) -> str | None:
    import tempfile

    try:
        with tempfile.TemporaryDirectory() as d:
            return Path(client.download_artifacts(run_id, path, d)).read_text()
    except Exception:  # absent (an older run): the caller falls back
        return None


def _set_tags(client, run_id: str, tags: dict) -> None:
    from mlflow.entities import RunTag

    client.log_batch(run_id, tags=[RunTag(k, v) for k, v in tags.items()])


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
