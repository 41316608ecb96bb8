"""How a trial fails, as data: the kind travels typed from a rank through the broker to Tune and MLflow.

A trial's own failures are final: `oom` (past the downshifts, or later in training), `diverged` (a non-finite
loss or gradient norm), `error` (its code raised, its workers' restarts are spent). Everything else is the
infrastructure's (`infra`: a slot host or controller lost, a worker group that could not be set up, the broker
lost, the store stalled): the trial continues from its checkpoint on a new group, within
`train.max_infra_retries`, and `tune --resume` continues it again. MLflow tags each failed run `failure: KIND`.

How the two are told apart: a failure is the trial's own only when its code says so, by an exception it raised
(an OOM that torch raised, a loss the ranks agreed diverged, a Python error in its step). A process that died
without raising (killed from outside: SIGKILL, the OOM killer, its node lost) proves nothing about the trial and
is the infrastructure's, and so is a failure whose record cannot be read (`kind_of(None)`).

No Ray, no MLflow here: the worker raises these, the driver reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from raysweep.metrics import FAILED, FINISHED, PRUNED, TAG_ERROR, TAG_FAILURE, outcome_of_run


class Kind(str, Enum):
    """A failure's kind. Its value is the MLflow tag `failure` (a str: it compares equal to "oom", ...).

    `str, Enum` rather than 3.11's StrEnum (Python 3.10 is supported); `str()` and f-strings give the value on
    every version, as StrEnum's do.
    """

    __str__ = str.__str__
    __format__ = str.__format__

    OOM = "oom"
    DIVERGED = "diverged"
    ERROR = "error"
    INFRA = "infra"

    @property
    def own(self) -> bool:
        """The trial's own: final (never retried, never resumed)."""
        return self is not Kind.INFRA


OOM, DIVERGED, ERROR, INFRA = Kind.OOM, Kind.DIVERGED, Kind.ERROR, Kind.INFRA
OWN = (OOM, DIVERGED, ERROR)
KINDS = tuple(Kind)


def to_kind(value: str) -> Kind:
    """A kind from its name (a tag, a message), or ValueError naming the kinds there are."""
    try:
        return Kind(value)
    except ValueError:
        raise ValueError(f"failure kind {value!r} is not one of {tuple(k.value for k in Kind)}") from None


@dataclass(frozen=True)
class Failure:
    """How a trial failed: the one record from the rank that saw it, through the broker and the relay, to the
    store's tags (metrics.run_ending) and back (settled)."""

    kind: Kind
    message: str  # one line

    def __post_init__(self):
        object.__setattr__(self, "kind", to_kind(self.kind))

    @property
    def final(self) -> bool:
        """The trial's own failure: it is not tried again, in this sweep or by --resume."""
        return self.kind.own

    def raised(self) -> TrialFailure:
        return TrialFailure(self.kind, self.message)


class TrialFailure(Exception):
    """A Failure raised: on the ranks (agreed by all of them; `.failure` goes to the broker), and again by the
    trial's relay for Tune (which pickles it: the MLflow callback reads the kind back from it, `kind_of`)."""

    def __init__(self, kind: Kind | str, message: str):
        self.failure = Failure(kind, message)
        super().__init__(message)

    def __reduce__(self):  # Exception pickles its args (message alone): keep the kind across Ray and Tune
        return type(self), (self.kind, self.message)

    @property
    def kind(self) -> Kind:
        return self.failure.kind

    @property
    def message(self) -> str:
        return self.failure.message

    @property
    def final(self) -> bool:
        return self.failure.final


def wrapped(error: BaseException) -> BaseException | None:
    """The exception `error` wraps: Ray's `cause` (a RayTaskError keeps what the task raised), Train V2's
    `_base_exc` (UserExceptionWithTraceback: what a worker's code raised, ray/train/v2/_internal/util.py, which
    sets no __cause__) and `health_check_failure` (WorkerHealthCheckFailedError: why a worker's poll failed), then
    Python's __cause__ / __context__ (Tune re-raises what a callback raised)."""
    for name in ("cause", "_base_exc", "health_check_failure"):
        inner = getattr(error, name, None)
        if isinstance(inner, BaseException):
            return inner
    return error.__cause__ or error.__context__


def find_cause(error: BaseException | None, kind: type) -> BaseException | None:
    """`error` or the first exception it wraps (`wrapped`, down the chain) that is a `kind`. None: none is."""
    for _ in range(10):
        if error is None or isinstance(error, kind):
            return error
        error = wrapped(error)
    return None


# Ray's exceptions for a process or node that died without raising (ray.exceptions; Train V2's health check of a
# worker that died, ray/train/v2/_internal/exceptions.py), matched by module and name: no Ray import here, and
# torch.OutOfMemoryError (the trial's own) shares a name with Ray's memory monitor's kill
PROCESS_DEATHS = frozenset({"RayActorError", "WorkerCrashedError", "NodeDiedError", "OutOfMemoryError",
                            "LocalRayletDiedError", "WorkerHealthCheckFailedError", "WorkerHealthCheckTimeoutError"})


def died(error: BaseException | None) -> bool:
    """Whether `error`, or one it wraps, says a process or node died without raising (PROCESS_DEATHS)."""
    for _ in range(10):
        if error is None:
            return False
        if any(c.__module__.split(".")[0] == "ray" and c.__name__ in PROCESS_DEATHS for c in type(error).__mro__):
            return True
        error = wrapped(error)
    return False


def kind_of(error: BaseException | None) -> str:
    """The failure kind of an exception Tune kept for a trial (its pickled error: a RayTaskError whose cause is a
    TrialFailure, or the TrialFailure itself): the TrialFailure's kind; `infra` where its process died without
    raising (the trial actor killed: the OOM killer, a SIGKILL) or the error could not be read back (None); any
    other exception, raised by the trial's code, is its own `error`."""
    failure = find_cause(error, TrialFailure)
    if failure is not None:
        return failure.kind
    return INFRA if error is None or died(error) else ERROR


@dataclass(frozen=True)
class Settled:
    """A trial whose end the store holds as final (`settled`): `tune --resume` ends it as it ended, never trains it
    again. `failure`: how it failed on its own (None: it finished, or ASHA pruned it); `last`: its last reported
    metrics (tracking.settled_trials fills them: Tune needs a last result with the metric)."""

    failure: Failure | None = None
    last: dict = field(default_factory=dict)


def settled(status: str, tags: dict) -> Settled | None:
    """How the store says a trial ended, when that is final; None when it may go on (still running, interrupted, or
    failed for the infrastructure). `status`, `tags`: its MLflow run's (metrics.run_ending wrote them)."""
    outcome = outcome_of_run(status, tags)
    if outcome in (FINISHED, PRUNED):
        return Settled()
    failure = Failure(tags.get(TAG_FAILURE, ERROR), tags.get(TAG_ERROR, "failed")) if outcome == FAILED else None
    return Settled(failure) if failure is not None and failure.final else None


_NOTED: dict[str, str] = {}  # this driver's errored trials' kinds, by Tune trial id (note_kind)


def note_kind(trial_id: str, kind: str) -> None:
    """The driver's MLflow callback, on a trial's error: its kind (kind_of its pickled error). Tune tells a searcher
    only that a trial errored, and before its callbacks run; search.RungTPE reads the kind here at its next call."""
    _NOTED[trial_id] = kind


def noted_kind(trial_id: str) -> str | None:
    return _NOTED.get(trial_id)
