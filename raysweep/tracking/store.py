"""Where a sweep's MLflow store is, and how to look at it: the tracking URI every process agrees on, the
artifacts read back, the UI's link to a sweep's runs."""

from __future__ import annotations

import logging
import os
import threading
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


# How long a driver waits for another process to finish creating a SQLite store it found half made (`mlflow_client`):
# the whole creation takes a second or two; a file that stops changing for STALLED_S was left by a creator that
# stopped, and is handed to MLflow as it is (it initialises an empty file; it names what is wrong with another).
CREATION_WAIT_S = 120.0
STALLED_S = 10.0
_ready: set[str] = set()  # the stores this process has found whole (each checked once)
# Alembic, which runs MLflow's migrations, keeps the migration under way in module globals (`alembic.op`,
# `alembic.context`): two creations in two threads of one process, even of two different stores, run each other's
# steps on the wrong connection ("no such table: jobs", "duplicate column name"). One at a time per process.
_creating = threading.Lock()


def mlflow_client(tracking_uri: str):
    """An MlflowClient on the store: the one way raysweep opens it. MLflow creates a SQLite store in place, running
    its migrations on the file, and two processes creating one store at once run them over each other (the second
    fails: "duplicate column name", "table experiments already exists", alembic's CircularDependencyError). Two
    sweeps started in one folder share ./mlflow.db, and `mlflow ui` may be opened on it as they start. So a missing
    store is made whole in a file beside it and linked into place (atomic; the loser uses the winner's), and one
    found half made is waited for until its creator has finished (`_await_creation`). In one process, creations
    take turns (`_creating`): a thread that opens a store with MLflow's own client while another creates one can
    still break both, so a process running a sweep opens every store with this."""
    from mlflow.tracking import MlflowClient

    db = sqlite_path(tracking_uri)
    if db is not None and tracking_uri not in _ready:
        with _creating:
            if tracking_uri not in _ready:
                if not db.exists():
                    _create(db)
                if db.exists():  # else no hard links there (`_create`): MLflow creates it in place, as it would
                    _await_creation(db)
                else:
                    MlflowClient(tracking_uri).search_experiments()  # that creation, inside the lock
                _ready.add(tracking_uri)
    return MlflowClient(tracking_uri)


def _create(db: Path) -> None:
    """A whole store (MLflow's schema at its head and its Default experiment, as MLflow itself makes them) at `db`,
    or nothing if another process got there first."""
    import tempfile

    from mlflow.store.tracking import DEFAULT_LOCAL_FILE_AND_ARTIFACT_PATH
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    db.parent.mkdir(parents=True, exist_ok=True)
    fd, scratch = tempfile.mkstemp(prefix=f".{db.name}.", suffix=".creating", dir=db.parent)
    os.close(fd)
    scratch_uri = f"sqlite:///{scratch}"
    try:
        SqlAlchemyStore(scratch_uri, DEFAULT_LOCAL_FILE_AND_ARTIFACT_PATH)  # creates it: schema, Default experiment
        engine = getattr(SqlAlchemyStore, "_engine_map", {}).pop(scratch_uri, None)  # its engine cache: closed
        if engine is not None:
            engine.dispose()
        if not _whole(Path(scratch)):  # MLflow made it elsewhere (SQLAlchemy reads a "?" in a path as a query)
            return
        try:
            os.link(scratch, db)  # fails if `db` exists: never replaces what another process made or is making
        except FileExistsError:
            pass
        except OSError as e:  # a file system without hard links (some FUSE mounts): no atomic way to put it there
            log.warning("MLflow store %s: not created atomically (%s); MLflow creates it in place", db, e)
    finally:
        Path(scratch).unlink(missing_ok=True)
        Path(scratch + "-journal").unlink(missing_ok=True)


def _whole(db: Path) -> bool:
    """Whether `db` holds MLflow's Default experiment: the last thing MLflow writes when it creates a store."""
    import sqlite3
    from contextlib import closing

    try:
        with closing(sqlite3.connect(f"{db.as_uri()}?mode=ro", uri=True, timeout=5)) as connection:
            return connection.execute("SELECT 1 FROM experiments WHERE experiment_id = 0").fetchone() is not None
    except sqlite3.Error:  # no such table yet, or a write holds the file for longer than the timeout
        return False


def _await_creation(db: Path) -> None:
    """Returns once `db` is whole, or once it has stopped changing for STALLED_S (its creator stopped: MLflow is
    left to open it as it is), or after CREATION_WAIT_S."""
    import time

    def state():
        seen = []
        for path in (db, db.with_name(db.name + "-journal")):
            try:
                seen.append((path.stat().st_size, path.stat().st_mtime_ns))
            except FileNotFoundError:  # the journal exists only while a write is under way
                seen.append(None)
        return tuple(seen)

    started = time.monotonic()
    seen, since = state(), started
    while not _whole(db):
        now = time.monotonic()
        if now - started > CREATION_WAIT_S or now - since > STALLED_S:
            log.warning("MLflow store %s: still half made after %.0f s, unchanged for the last %.0f s (its creator "
                        "stopped?); MLflow opens it as it is", db, now - started, now - since)
            return
        if not db.exists():  # removed under us: MLflow creates it in place
            return
        time.sleep(0.1)
        if (current := state()) != seen:
            seen, since = current, time.monotonic()


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
