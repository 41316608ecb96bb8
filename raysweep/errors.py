"""The errors a user sees as a single line, never as a traceback: bad input (exit code 2), a sweep whose
infrastructure failed or a local Ray that did not start (exit code 1)."""

from __future__ import annotations


class UserError(Exception):
    """Bad input: the message names the file, the key, the value and the fix, on one line."""


class RayNotStarted(Exception):
    """The local Ray cluster a command starts did not come up: one line, exit code 1; nothing of the sweep had
    started (no run in the store, no trial)."""


class SweepFailed(Exception):
    """The infrastructure under a command failed for good (a sweep's broker lost, its store gone): one line, exit
    code 1. The line says what failed, not what to do next: that depends on the command, and `cli.main` adds it
    (`tune --resume` only where Tune saved a sweep to resume: cli._resume_line)."""


class BrokerLost(SweepFailed):
    """The sweep's broker actor died (its node, the OOM killer): the sweep ends with the cause."""

    @classmethod
    def of(cls, cause: str) -> BrokerLost:
        return cls(f"the sweep's broker was lost ({cause})")


class StoreUnavailable(SweepFailed, RuntimeError):
    """The sweep's MLflow store did not answer for mlflow.retry_s (a server stopped, hung or gone): the sweep ends
    with it named; the runs it could not end are ended by the next command on the store."""

    @classmethod
    def of(cls, store: str, retry_s: float, cause: BaseException) -> StoreUnavailable:
        line = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
        return cls(f"the MLflow store at {store} did not answer for mlflow.retry_s ({retry_s:.0f} s): "
                   f"{type(cause).__name__}: {line[:300]}")
