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


class StoreTimeout(TimeoutError):
    """An MLflow call still waiting on the store at its deadline (`bounded`)."""


def bounded(call, wait_s: float, what: str):
    """`call()`, waited for at most `wait_s`: on a daemon thread, so that a call blocked on a store that stopped
    answering (one HTTP call blocks inside MLflow's own retries: MLFLOW_HTTP_REQUEST_TIMEOUT ×
    MLFLOW_HTTP_REQUEST_MAX_RETRIES, many minutes) holds neither the driver nor its exit past the deadline; it is
    left to finish or fail in the background. Returns what `call` returns, raises what it raised, or StoreTimeout
    naming `what`."""
    import threading

    outcome: list = []

    def run():
        try:
            outcome.append((True, call()))
        except BaseException as e:  # handed to the caller's thread
            outcome.append((False, e))

    thread = threading.Thread(target=run, name=f"mlflow {what}", daemon=True)
    thread.start()
    thread.join(max(wait_s, 0.0))
    if not outcome:
        raise StoreTimeout(f"the MLflow store did not answer {what} in {max(wait_s, 0.0):.0f} s")
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


def in_store(call, tracking_uri: str, retry_s: float, what: str, wait_s: float | None = None):
    """`call()`, an MLflow call of a driver, waited for at most `wait_s` (default `retry_s`: mlflow.retry_s): a store
    that stops answering ends the command with it named (errors.StoreUnavailable), never holds it (`bounded`)."""
    from raysweep.errors import StoreUnavailable

    try:
        return bounded(call, retry_s if wait_s is None else wait_s, what)
    except StoreTimeout as e:
        raise StoreUnavailable.of(tracking_uri, retry_s, e) from e
