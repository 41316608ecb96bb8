"""A sweep's MLflow writes off Tune's loop: one writer thread per parent run, retrying a store that stalls."""

from __future__ import annotations

import logging
import time

from raysweep.errors import StoreUnavailable
from raysweep.tracking.store import StoreTimeout, bounded

log = logging.getLogger(__name__)


class Writer:
    """A sweep's MLflow writes, in the order they were put, on a thread of their own: Tune's loop (ASHA's decisions,
    the next trial's start, every slot waiting at a rung) never waits on the store, which is tens of ms a write on
    SQLite and more on a remote server, for every trial's every epoch.

    A write that fails is tried again, with backoff, for up to `retry_s` (mlflow.retry_s): a tracking server that
    restarts, a busy database. Writes must be safe to repeat (the callback's are: a run is looked up before it is
    created, an epoch's metrics are checked against the store after a failed attempt). `retry_s` is a deadline for
    the whole write, attempts included: one HTTP call to a server that stopped answering blocks inside MLflow's own
    retries (MLFLOW_HTTP_REQUEST_TIMEOUT × MLFLOW_HTTP_REQUEST_MAX_RETRIES, many minutes), so each attempt runs on a
    thread of its own and is given up at the deadline (left to finish or fail in the background). Past it the
    writer stops: the writes after it are dropped (they would land out of order) and the error is raised by the
    next `put` or `flush`, so a store that stays down ends the sweep with its cause. `flush` waits for everything
    put so far, and ends: at most `retry_s` for a write in progress, then the dropped ones go at once."""

    def __init__(self, name: str, retry_s: float = 300.0, store: str = "the tracking URI"):
        import queue
        import threading

        self.name, self.error, self.retry_s, self.store = name, None, retry_s, store
        self.queue: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, name=f"mlflow-writer {name}", daemon=True)
        self.thread.start()

    def put(self, write) -> None:
        self._raise()
        self.queue.put(write)

    def flush(self) -> None:
        """Wait until every write put so far is in the store, or the writer gave up (then raise why). Bounded: the
        write in progress ends by its deadline, and after a failure the rest are dropped without a call."""
        with self.queue.all_tasks_done:
            deadline = (time.monotonic() + self.retry_s + ATTEMPT_FLOOR_S
                        + FLUSH_SLACK_S * (1 + self.queue.unfinished_tasks))
            while self.queue.unfinished_tasks and self.error is None:
                left = deadline - time.monotonic()
                if left <= 0:  # a guard only: each write gives up at its own deadline
                    raise RuntimeError(f"MLflow writes of {self.name} still not done {self.retry_s:.0f} s "
                                       f"(mlflow.retry_s) after the flush began")
                self.queue.all_tasks_done.wait(min(left, 1.0))
        self._raise()

    def _raise(self) -> None:
        """The store's failure, once the writer gave up (errors.StoreUnavailable: the sweep ends with it named)."""
        if self.error is not None:
            raise StoreUnavailable.of(self.store, self.retry_s, self.error) from self.error

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
            try:  # an attempt begun at the deadline still gets ATTEMPT_FLOOR_S: its own error beats "no answer"
                _attempt(write, max(deadline - time.monotonic(), ATTEMPT_FLOOR_S), self.name)
                return
            except StoreTimeout:
                raise
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
ATTEMPT_FLOOR_S = 2.0  # the least an attempt is waited for (retry_s 0: one attempt, given this long)
FLUSH_SLACK_S = 5.0  # what flush allows beyond retry_s for each queued write's bookkeeping (never a store call)


def _attempt(write, wait_s: float, name: str) -> None:
    """One attempt at `write`, waited for at most `wait_s` (the write's deadline): store.bounded, so that a call
    blocked on a silent server cannot hold the writer (or the driver's exit) past it."""
    bounded(write, wait_s, "a write")

_WRITERS: dict[str, Writer] = {}  # this driver's writers, by parent run (the callback Tune restores finds its own)


def writer(parent_run_id: str, retry_s: float = 300.0, store: str = "the tracking URI") -> Writer:
    """The sweep's MLflow writer (one per parent run in this process), started on first use. `store`: the tracking
    URI, for the line that names it when it stops answering."""
    if parent_run_id not in _WRITERS:
        _WRITERS[parent_run_id] = Writer(parent_run_id, retry_s, store)
    return _WRITERS[parent_run_id]


def raise_if_gave_up(parent_run_id: str) -> None:
    """Raise the store's failure (errors.StoreUnavailable) once the sweep's writer gave up; nothing otherwise, and
    no store call: cheap enough for every step of Tune's loop."""
    if parent_run_id in _WRITERS:
        _WRITERS[parent_run_id]._raise()


def flush_writes(parent_run_id: str) -> None:
    """Wait until every queued write of the sweep is in the store (raises the first that failed). Before anything
    that reads the store or ends runs: the sweep's end, its summary, Ctrl-C."""
    if parent_run_id in _WRITERS:
        _WRITERS[parent_run_id].flush()
