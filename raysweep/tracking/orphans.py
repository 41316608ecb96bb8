"""The sweeps whose driver is gone: the parent run's heartbeat while a driver lives, and the reconciliation
that ends what a dead driver left RUNNING (drivers.py says how a driver is recorded and judged)."""

from __future__ import annotations

import logging
import time

from raysweep import drivers
from raysweep.tracking.runs import end_sweep
from raysweep.tracking.store import mlflow_client, sqlite_path

log = logging.getLogger(__name__)


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

    def __exit__(self, exc_type, exc, tb):
        """Let a beat in progress end first (a few ms on a store that answers), but never wait on a store that has
        just failed the sweep: that beat is blocked on it for up to a beat's time."""
        from raysweep.errors import StoreUnavailable
        from raysweep.failures import find_cause

        self.done.set()
        if exc is None or find_cause(exc, StoreUnavailable) is None:
            self.thread.join(timeout=10)

    def _run(self):
        from raysweep.tracking.store import bounded

        client = mlflow_client(self.tracking_uri)
        while not self.done.wait(self.every_s):
            try:  # each beat waited for at most a beat's time (store.bounded): a store that hangs holds no thread
                bounded(lambda: client.set_tag(self.run_id, "raysweep.heartbeat", repr(time.time())), self.every_s,
                        "the heartbeat")
            except Exception as e:  # a busy or silent store: the next beat tries again
                log.warning("heartbeat of run %s not written: %s", self.run_id, e)


def reconcile_orphans(tracking_uri: str, keep: str | None = None) -> list[str]:
    """End every sweep on the store whose driver is gone (parent and RUNNING children FAILED, tagged
    `error: driver lost`), but the parent `keep` (a `--resume` takes its own sweep over). Returns the parent run
    ids ended. A store that does not exist yet holds none (and is not created)."""
    db = sqlite_path(tracking_uri)
    if db is not None and not db.is_file():
        return []
    client = mlflow_client(tracking_uri)
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
