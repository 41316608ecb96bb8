"""The errors a user sees as a single line, never as a traceback: bad input (exit code 2), a sweep whose
infrastructure failed (exit code 1)."""

from __future__ import annotations


class UserError(Exception):
    """Bad input: the message names the file, the key, the value and the fix, on one line."""


class SweepFailed(Exception):
    """The infrastructure under a running sweep failed for good (its broker lost): one line, exit code 1; the
    trials' checkpoints are kept and `tune --resume` continues them."""


class BrokerLost(SweepFailed):
    """The sweep's broker actor died (its node, the OOM killer): the sweep ends with the cause."""

    @classmethod
    def of(cls, cause: str) -> BrokerLost:
        return cls(f"the sweep's broker was lost ({cause}); the trials' checkpoints are kept: "
                   f"`tune --resume` continues them")
