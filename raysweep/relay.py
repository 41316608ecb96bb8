"""One trial, in its Tune trial actor: hands the trial to a warm worker group (slots/) and relays each epoch's report
to Tune, where ASHA judges it.

The trial function is `run_trial`; `SweepContext` is what it needs from the driver (it travels once, through
`tune.with_parameters`).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from raysweep import layout

log = logging.getLogger(__name__)

POLL_ANSWER_S = 30.0  # a poll of the broker waits at most this long beyond its own long poll (slots.ASK_WAIT_S)
INFRA_RETRIES = "infra_retries"  # reported by a trial submitted again after an infrastructure failure (MLflow tag)
STARTUP_STAMPS = "startup_stamps"  # the first report's start-up stamps (JSON): callbacks.SweepClock reads them


@dataclass(frozen=True)
class SweepContext:
    """What every trial needs from the driver."""

    trials: Any  # config.TrialFactory: a trial's config from its knobs
    train_size: int
    train_storage: str  # absolute folder or URI: each trial's folder is <storage>/<name>/train/trial-<id>
    broker: Any  # the sweep's slots.Broker actor: trials run on its warm worker groups
    batch_cap: int | None = None  # per-GPU batches above it run as smaller micro-batches
    decision_points: tuple[float, ...] = ()  # where ASHA may stop a trial, in time_attr (asha.AshaPlan)
    time_attr: str = "epoch"  # what ASHA counts: epoch or train_seconds
    settled: dict = field(default_factory=dict)  # --resume: trial id → failures.Settled, how the store says it ended


def run_trial(knobs: dict, context: SweepContext) -> None:
    """Tune function trainable: relays the trial's reports until it ends as it ended (failures.TrialFailure, typed:
    its own failures are final; an infrastructure failure is submitted again, to resume from its checkpoint on
    another group, at most train.max_infra_retries times). A trial the store already settled (--resume: pruned,
    finished, or failed on its own) ends at once, as it ended: it never trains again."""
    from ray import tune
    from ray.exceptions import GetTimeoutError, RayActorError

    from raysweep.failures import INFRA, TrialFailure
    from raysweep.slots.broker import BROKER_STALL_S

    relay_started = time.time()
    trial_id = tune.get_context().get_trial_id()
    if trial_id in context.settled:
        ended = context.settled[trial_id]
        if ended.failure is not None:
            raise ended.failure.raised()
        tune.report(ended.last)  # Tune needs a last result with the metric; the store is not written again
        return
    trial = context.trials.trial(knobs, context.train_size, context.batch_cap)
    # the folder comes from the trial id: a trial run again (restart, --resume) continues from its checkpoint there
    run_dir = layout.trial_dir(context.train_storage, trial_id)
    retries = 0
    while True:
        try:
            failure = _relay(context, trial_id, trial, run_dir, relay_started, retries)
        except RayActorError as e:  # the broker is gone: no group can run the trial (the driver ends the sweep)
            raise TrialFailure(INFRA, f"the sweep's broker was lost ({type(e).__name__})") from None
        except GetTimeoutError:  # alive, but silent past BROKER_STALL_S: an infrastructure failure like any other
            failure = TrialFailure(INFRA, f"the sweep's broker did not answer in {BROKER_STALL_S:.0f} s")
        if failure is None:
            return
        if failure.final or retries >= trial.train.max_infra_retries:
            if not failure.final:
                failure = TrialFailure(INFRA, f"{failure.message} (train.max_infra_retries {retries} spent)")
            raise failure
        retries += 1
        log.warning("trial %s: %s; submitted again (%d of train.max_infra_retries %d)", trial_id, failure.message,
                    retries, trial.train.max_infra_retries)


def _relay(context: SweepContext, trial_id: str, trial, run_dir: str, relay_started: float, retries: int):
    """One attempt: submit the trial to the broker, relay its reports to Tune until it is done; returns how it
    failed (failures.TrialFailure) or None."""
    from ray import tune

    from raysweep.slots import ASK_WAIT_S

    broker = context.broker
    seq = _ask(lambda: broker.submit.remote(trial_id, trial.to_dict(), run_dir, trial.train.max_failures,
                                            context.decision_points, context.time_attr), POLL_ANSWER_S, trial_id)
    since = 0
    while True:
        out = _ask(lambda since=since: broker.poll.remote(trial_id, seq, since), ASK_WAIT_S + POLL_ANSWER_S, trial_id)
        for i, metrics in enumerate(out.reports, start=since):
            if i == out.timeline_at and not retries:  # the first epoch: how long the trial took to start
                metrics = {**metrics, STARTUP_STAMPS: json.dumps({**out.timeline, "relay_started": relay_started})}
            if retries:
                metrics = {**metrics, INFRA_RETRIES: retries}
            tune.report(metrics)  # returns once Tune has let the trial go on (a stop ends this process's trial here)
            broker.ack.remote(trial_id, seq, i + 1)
        since += len(out.reports)
        if out.done:
            return out.failure.raised() if out.failure is not None else None


def _ask(call, wait_s: float, trial_id: str):
    """The answer of `call()`, a call to the broker that may be repeated (a poll; a submit, whose repeat supersedes
    the first), asked again each `wait_s` it goes unanswered until slots.broker.BROKER_STALL_S (then
    GetTimeoutError). One slow answer failed the trial at once before, as `infra` outside train.max_infra_retries,
    saying the broker was lost while it lived."""
    import ray
    from ray.exceptions import GetTimeoutError

    from raysweep.slots.broker import BROKER_STALL_S

    deadline = time.monotonic() + BROKER_STALL_S
    while True:
        try:
            return ray.get(call(), timeout=wait_s)
        except GetTimeoutError:
            if time.monotonic() > deadline:
                raise
            log.warning("trial %s: the sweep's broker has not answered in %.0f s; asking again (for up to %.0f s)",
                        trial_id, wait_s, BROKER_STALL_S)
