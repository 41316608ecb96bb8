"""A trial's clock (layout.write_clock) written by rank 0 off the epoch's path: the training seconds each epoch
without a checkpoint reached, which a restart goes on from (worker/run.TrainingRun.restore)."""

from __future__ import annotations

import logging
import queue
import threading

from raysweep import layout

log = logging.getLogger(__name__)


class ClockWriter:
    """Rank 0 of a trial: the training seconds each epoch without a checkpoint reached (layout.write_clock), written
    by a thread of its own, in order, off the epoch's path: no rank waits on the store for it (a checkpoint
    carries its own clock). A write the store refuses is `failure` from then on: the next epoch's send stops the
    trial, which ends as `infra` and resumes from its checkpoint on another group (its own code did nothing wrong).
    The thread is a daemon and never joined: a store that hangs holds it, not the group."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir
        self.failure: str | None = None  # the first write the store refused: "ErrorType: message"
        self._queue: queue.Queue = queue.Queue()
        self._done = threading.Condition()
        self._queued = self._written = 0
        threading.Thread(target=self._run, name="raysweep-clock", daemon=True).start()

    def write(self, epoch: int, train_seconds: float) -> None:
        """Queue the clock of `epoch`; returns at once."""
        with self._done:
            self._queued += 1
        self._queue.put((epoch, train_seconds))

    def flush(self, timeout_s: float) -> bool:
        """Whether every write queued so far was done (or refused) within `timeout_s`."""
        with self._done:
            return self._done.wait_for(lambda: self._written >= self._queued, timeout_s)

    def close(self) -> None:
        """No more writes: the thread leaves after the queued ones."""
        self._queue.put(None)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                if self.failure is None:
                    layout.write_clock(self.run_dir, *item)
            except Exception as e:  # OSError locally, pyarrow's errors on S3: the store's, whatever they are
                self.failure = f"{type(e).__name__}: {e}"
                log.warning("the clock of epoch %d could not be written under %s: %s", item[0], self.run_dir,
                            self.failure)
            with self._done:
                self._written += 1
                self._done.notify_all()
