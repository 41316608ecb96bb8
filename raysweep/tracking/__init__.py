"""Every MLflow write and read, by the driver alone (workers never open the store), in modules by job:

- store.py: where the store is (the tracking URI every process agrees on), the one way to open it (`mlflow_client`:
  a new SQLite store is never created by two processes over each other), artifacts read back, the UI's link;
- runs.py: a sweep's parent run from opening to end (opened, found, taken over by --resume, ended);
- orphans.py: the driver's heartbeat, and ending what a dead driver left RUNNING;
- writer.py: the writer thread that keeps every write off Tune's loop and retries a stalled store;
- trial_runs.py: each trial's child run (the writes the driver's Tune events become: callbacks.MLflowEvents);
- reads.py: what is read back (a sweep whole for the summary and report, --resume's settled trials, ASHA's rungs);
- published.py: the report, the recommendation and the probe, once computed.

`mlflow` is imported inside the functions that need it, so importing this package stays instant (`--help`,
`check`). The names below are the package's API.
"""

from raysweep.tracking.orphans import Heartbeat, reconcile_orphans
from raysweep.tracking.published import (
    log_answer,
    log_confirmation,
    log_importance,
    log_probe,
    log_recommendation,
    log_report,
)
from raysweep.tracking.reads import (
    epoch_seconds_by_batch,
    last_noise_scale,
    load_sweep,
    read_sweep,
    settled_trials,
    trial_histories,
)
from raysweep.tracking.runs import (
    close_sweep,
    confirm_tags,
    end_sweep,
    find_parent,
    log_sweep_figures,
    open_sweep,
    reopen,
    resumed_parent,
    spec_of,
    target_tags,
)
from raysweep.tracking.store import StoreTimeout, bounded, in_store, resolve_tracking_uri, runs_link, sqlite_path
from raysweep.tracking.trial_runs import TrialRuns
from raysweep.tracking.writer import Writer, flush_writes, raise_if_gave_up, writer

__all__ = [
    "Heartbeat", "StoreTimeout", "TrialRuns", "Writer", "bounded", "close_sweep", "confirm_tags", "end_sweep",
    "epoch_seconds_by_batch", "find_parent", "flush_writes", "in_store", "last_noise_scale", "load_sweep",
    "log_answer", "log_confirmation", "log_importance", "log_probe", "log_recommendation", "log_report",
    "log_sweep_figures", "open_sweep", "raise_if_gave_up", "read_sweep", "reconcile_orphans", "reopen",
    "resolve_tracking_uri", "resumed_parent", "runs_link",
    "settled_trials", "spec_of", "sqlite_path", "target_tags", "trial_histories", "writer",
]
