"""asha.py against Ray 2.60's AsyncHyperBandScheduler: each private field raysweep touches is pinned here, so an
upgrade that moves one fails this file rather than a sweep (ray python/ray/tune/schedulers/async_hyperband.py)."""

import pytest
from ray.tune.schedulers import ASHAScheduler, TrialScheduler

from raysweep.asha import AshaPlan, RungKeeper, milestones, rung_table
from raysweep.config import load_config

from conftest import tiny_spec, write_spec


class Trial:  # what ASHA reads of a trial
    def __init__(self, trial_id):
        self.trial_id, self.config = trial_id, {}


def test_the_private_fields_raysweep_reads_are_where_and_what_it_expects():
    scheduler = ASHAScheduler(time_attr="train_seconds", max_t=64, grace_period=8, reduction_factor=2)
    scheduler.set_search_properties("val_acc", "max")
    # _time_attr and _metric: what the rung keeper saves and replays
    assert scheduler._time_attr == "train_seconds" and scheduler._metric == "val_acc"
    # _metric_op: +1 for max, -1 for min; rungs record op × metric
    assert scheduler._metric_op == 1.0
    # _brackets: one bracket (ASHA's default) whose _rungs are (milestone, {trial id: op × metric}), largest first
    (bracket,) = scheduler._brackets
    assert [m for m, _ in bracket._rungs] == [64, 32, 16, 8]
    assert all(recorded == {} for _, recorded in bracket._rungs)
    # a bracket's on_result(trial, time, op × metric) records a trial once per rung, at its first report at or past it
    bracket.on_result(Trial("a"), 9.0, 0.5)
    bracket.on_result(Trial("a"), 12.0, 0.9)
    assert dict(bracket._rungs)[8] == {"a": 0.5} and dict(bracket._rungs)[16] == {}
    minimize = ASHAScheduler(time_attr="epoch", max_t=4, grace_period=1, reduction_factor=2)
    minimize.set_search_properties("val_loss", "min")
    assert minimize._metric_op == -1.0
    assert milestones(minimize) == (1.0, 2.0, 4.0)


def test_the_plan_is_built_once_from_the_spec_in_either_unit(tmp_path):
    spec = write_spec(tmp_path, tiny_spec(tmp_path))
    epochs = AshaPlan.of(load_config(spec, ["train.epochs=8", "tune.asha.grace_period=1",
                                            "tune.asha.reduction_factor=2"]))
    assert (epochs.time_attr, epochs.max_t, epochs.rungs) == ("epoch", 8, (1, 2, 4, 8))
    assert epochs.decision_points == (1, 2, 4, 8)
    cut = AshaPlan.of(load_config(spec, ["train.epochs=8", "tune.asha.grace_period=1", "tune.asha.max_t=6",
                                         "tune.asha.reduction_factor=2"]))
    assert cut.decision_points == (1, 2, 4, 6)  # max_t before the last epoch: ASHA stops every trial there
    seconds = AshaPlan.of(load_config(spec, ["train.epochs=40", "train.time_budget_s=64", "tune.asha.unit=seconds",
                                             "tune.asha.grace_period=8", "tune.asha.reduction_factor=2"]))
    assert (seconds.time_attr, seconds.decision_points) == ("train_seconds", (8, 16, 32, 64))
    scheduler = seconds.scheduler()
    assert milestones(scheduler) == seconds.rungs and scheduler._time_attr == "train_seconds"
    rows = rung_table(seconds, [96, 192], {96: 2.0})
    assert rows[0] == ["rung 1", "8 s", "4.0 ep", "?"] and rows[-1][0] == "max_t"


@pytest.mark.parametrize("mode", ["min", "max"])
def test_replayed_histories_fill_the_rungs_as_live_reports_would(mode):
    """The keeper's replay (a resume's store → ASHA's rungs) leaves the scheduler in the state the same reports
    made live, so its next decision is the same."""
    histories = {"a": [(1.0, 0.5), (2.0, 0.3)], "b": [(1.0, 0.4), (2.0, 0.35)], "c": [(1.0, 0.6)]}

    def scheduler():
        s = ASHAScheduler(time_attr="epoch", max_t=4, grace_period=1, reduction_factor=2)
        s.set_search_properties("val_loss", mode)
        for trial_id in (*histories, "d"):
            s.on_trial_add(None, Trial(trial_id))
        return s

    live = scheduler()
    for trial_id, reports in histories.items():
        for epoch, value in reports:
            live.on_trial_result(None, Trial(trial_id), {"epoch": epoch, "val_loss": value})
    replayed = scheduler()
    RungKeeper(replayed).replay(histories)
    assert [dict(r) for _, r in replayed._brackets[0]._rungs] == [dict(r) for _, r in live._brackets[0]._rungs]
    for s in (live, replayed):
        decision = s.on_trial_result(None, Trial("d"), {"epoch": 1, "val_loss": 0.55})
        assert decision == (TrialScheduler.STOP if mode == "min" else TrialScheduler.CONTINUE)
