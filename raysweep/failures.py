"""How a trial fails, as data: the kind travels typed from a rank through the broker to Tune and MLflow.

A trial's own failures are final: `oom` (past the downshifts, or later in training), `diverged` (a non-finite
loss or gradient norm), `error` (its step raised, its workers' restarts are spent). Everything else is the
infrastructure's (`infra`: a slot host or controller lost, a worker group that could not be set up, the broker
lost, the store stalled): the trial continues from its checkpoint on a new group, within
`train.max_infra_retries`, and `tune --resume` continues it again. MLflow tags each failed run `failure: KIND`.

No Ray, no MLflow here: the worker raises these, the driver reads them.
"""

from __future__ import annotations

from raysweep.metrics import FAILED, FINISHED, PRUNED, TAG_ERROR, TAG_FAILURE, outcome_of_run

OOM, DIVERGED, ERROR, INFRA = "oom", "diverged", "error", "infra"
OWN = (OOM, DIVERGED, ERROR)  # the trial's own: final (never retried, never resumed)
KINDS = (*OWN, INFRA)


class TrialFailure(Exception):
    """A trial's failure of a known kind (KINDS) with a one-line message. Raised on the ranks (agreed by all of
    them), handed to the broker as `as_dict()`, raised again by the trial's relay for Tune (which pickles it: the
    MLflow callback reads the kind back from it, `kind_of`)."""

    def __init__(self, kind: str, message: str):
        if kind not in KINDS:
            raise ValueError(f"failure kind {kind!r} is not one of {KINDS}")
        super().__init__(message)
        self.kind, self.message = kind, message

    def __reduce__(self):  # Exception pickles its args (message alone): keep the kind across Ray and Tune
        return type(self), (self.kind, self.message)

    @property
    def final(self) -> bool:
        """The trial's own failure: it is not tried again, in this sweep or by --resume."""
        return self.kind in OWN

    def as_dict(self) -> dict:
        return {"kind": self.kind, "message": self.message}

    @classmethod
    def from_dict(cls, d: dict) -> TrialFailure:
        return cls(d["kind"], d["message"])


def find_cause(error: BaseException | None, kind: type) -> BaseException | None:
    """`error` or the first exception it wraps that is a `kind`: down Ray's `cause` (a RayTaskError keeps what the
    task raised) and Python's __cause__ / __context__ (Tune re-raises what a callback raised). None: none is."""
    for _ in range(10):
        if error is None or isinstance(error, kind):
            return error
        error = getattr(error, "cause", None) or error.__cause__ or error.__context__
    return None


def kind_of(error: BaseException | None) -> str:
    """The failure kind of an exception Tune kept for a trial (its pickled error: a RayTaskError whose cause is a
    TrialFailure, or the TrialFailure itself); any other exception is the trial's own `error`."""
    failure = find_cause(error, TrialFailure)
    return failure.kind if failure is not None else ERROR


def settled(status: str, tags: dict) -> dict | None | bool:
    """How the store says a trial ended, when that is final (`tune --resume` runs it no further): its failure
    (as_dict) when it failed on its own; None when it finished or ASHA pruned it; False when it may go on (still
    running, interrupted, or failed for the infrastructure). `status`, `tags`: its MLflow run's."""
    outcome = outcome_of_run(status, tags)
    if outcome in (FINISHED, PRUNED):
        return None
    if outcome == FAILED and tags.get(TAG_FAILURE, ERROR) in OWN:
        return {"kind": tags.get(TAG_FAILURE, ERROR), "message": tags.get(TAG_ERROR, "failed")}
    return False
