"""ASHA for a sweep: the plan built once from the spec (time attribute, max_t, rungs, where a slot waits for a
decision), the scheduler it makes, and the rung keeper that carries ASHA's rungs across a resume.

This is the only module that touches `AsyncHyperBandScheduler`'s private fields (`_brackets`, a bracket's `_rungs`
and `on_result`, `_time_attr`, `_metric`, `_metric_op`: ray python/ray/tune/schedulers/async_hyperband.py); each
touch is pinned against Ray 2.60 by tests/test_asha.py.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from ray.tune import Callback

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AshaPlan:
    """What a sweep's ASHA is, in its time attribute: `epoch` (worker-reported: Tune's training_iteration restarts
    at 1 after a restore) or `train_seconds` (tune.asha.unit: seconds)."""

    time_attr: str
    max_t: float
    grace_period: float
    reduction_factor: float
    epochs: int  # train.epochs: a max_t in epochs at or past it never cuts a trial
    rungs: tuple[float, ...]  # the milestones ASHA records trials at (its one bracket's)

    @classmethod
    def of(cls, config) -> AshaPlan:
        """From a spec (config.SweepConfig): its tune.asha section, ASHA's horizon and train.epochs."""
        a = config.tune.asha
        plan = cls(config.time_attr, float(config.max_t), float(a.grace_period), float(a.reduction_factor),
                   config.train.epochs, ())
        return dataclasses.replace(plan, rungs=milestones(plan.scheduler()))

    def scheduler(self):
        """A new `ASHAScheduler` of this plan (Tune sets its metric and mode)."""
        from ray.tune.schedulers import ASHAScheduler

        return ASHAScheduler(time_attr=self.time_attr, max_t=self.max_t, grace_period=self.grace_period,
                             reduction_factor=self.reduction_factor)

    @property
    def decision_points(self) -> tuple[float, ...]:
        """Where ASHA may stop a trial: its rungs, and max_t (in epochs, where it comes before the last epoch). It
        decides at the first report at or past each; between them it always lets a trial go on, so a slot waits
        for Tune only at a report that crosses one (slots.Broker.report)."""
        points = set(self.rungs)
        if self.time_attr != "epoch" or self.max_t < self.epochs:
            points.add(self.max_t)
        return tuple(sorted(points))


def milestones(scheduler) -> tuple[float, ...]:
    """The rung milestones of an ASHA scheduler, ascending (Ray keeps them in each bracket's `_rungs`, descending)."""
    return tuple(sorted({float(m) for bracket in scheduler._brackets for m, _ in bracket._rungs}))


def rung_table(plan: AshaPlan, batches: list[int], epoch_seconds: dict[int, float]) -> list[list[str]]:
    """ASHA's rungs (then max_t) in the spec's unit and in the other one for each global batch (`epoch_seconds`:
    training seconds an epoch per global batch, as measured; a batch without one gets '?'): `check` prints it."""
    points = sorted({*plan.rungs, plan.max_t})
    seconds = plan.time_attr == "train_seconds"
    rows = []
    for i, point in enumerate(points):
        row = [f"rung {i + 1}" if i < len(points) - 1 else "max_t", f"{point:g} {'s' if seconds else 'ep'}"]
        for batch in batches:
            per_epoch = epoch_seconds.get(batch)
            if per_epoch is None:
                row.append("?")
            else:
                row.append(f"{point / per_epoch:.1f} ep" if seconds else f"{point * per_epoch:.0f} s")
        rows.append(row)
    return rows


class RungKeeper(Callback):
    """A Tune callback that saves ASHA's rung records with the experiment and puts them back on restore.

    `Tuner.restore` does not save the scheduler (ray #30838): without this a resumed sweep forgets every rung
    recorded before the crash and stops cutting trials until the rungs refill. The callback and the scheduler are
    pickled together in the tuner's state, so after a restore this callback holds the restored scheduler; Tune
    saves callback states beside its experiment state, on `storage_path`.

    That state is only as new as Tune's last periodic save: a trial recorded at a rung after it (and before a crash)
    would be missing, and its resumed run judged again at that rung. So on restore the rungs are also replayed from
    the MLflow store (the sweep's parent run: every trial's reported history, which the slots never run ahead of),
    through ASHA's own bookkeeping: what a rung already holds stays; what only the store knew is added. Rung records
    are per time attribute (epoch, train_seconds): a state of another unit is not used.
    """

    def __init__(self, scheduler, tracking_uri: str | None = None, parent_run_id: str | None = None):
        self.scheduler = scheduler
        self.tracking_uri, self.parent_run_id = tracking_uri, parent_run_id

    def get_state(self) -> dict:
        return {"time_attr": self.scheduler._time_attr,
                "rungs": [[(milestone, dict(recorded)) for milestone, recorded in bracket._rungs]
                          for bracket in self.scheduler._brackets]}

    def set_state(self, state: dict) -> None:
        if state["time_attr"] == self.scheduler._time_attr:  # rungs of another unit: not these
            for bracket, rungs in zip(self.scheduler._brackets, state["rungs"]):
                for (milestone, recorded), (saved_milestone, saved) in zip(bracket._rungs, rungs):
                    if milestone == saved_milestone:
                        recorded.update(saved)
        if self.tracking_uri and self.parent_run_id:
            try:
                from raysweep.tracking import trial_histories

                self.replay(trial_histories(self.tracking_uri, self.parent_run_id, self.scheduler._time_attr,
                                            self.scheduler._metric))
            except Exception as e:  # the saved rungs still hold; say what could not be added
                log.warning("ASHA's rungs not refilled from MLflow (%s: %s)", type(e).__name__, e)

    def replay(self, histories: dict[str, list[tuple[float, float]]]) -> None:
        """Each trial's (time, metric) reports in order, through ASHA's own rung bookkeeping (a trial is recorded
        once per rung, at its first report at or past it); its decisions are not acted on here."""
        op = self.scheduler._metric_op
        for trial_id, reports in histories.items():
            trial = _TrialId(trial_id)
            for time_value, metric in reports:
                for bracket in self.scheduler._brackets:
                    bracket.on_result(trial, time_value, op * metric)


@dataclass(frozen=True)
class _TrialId:
    """What a bracket's `on_result` reads of a trial: its id."""

    trial_id: str
