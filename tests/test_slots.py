"""The warm worker groups' broker (raysweep/slots/broker.py), driven as Tune's trials and a slot's rank 0 drive it,
with a stand-in for Ray Train's fit(); and the start-up and busy figures. The same broker on Ray runs every sweep
test."""

import asyncio

import pytest

from raysweep.metrics import STARTUP_NAMES, startup_phases
from raysweep.protocol import RETIRE
from raysweep.slots import Broker
from raysweep.sweep import busy_share

CPU2 = {"num_workers": 2, "use_gpu": False, "cpus_per_worker": 1}
CPU3 = {"num_workers": 3, "use_gpu": False, "cpus_per_worker": 1}


def trial(scaling=CPU2):
    return {"scaling": scaling}


class Fits:
    """Stand-in for the slots' trainers: each launch is a fit() that runs until the slot leaves (or is failed)."""

    def __init__(self, fail_with: str | None = None):
        self.launched: list[tuple[int, dict]] = []
        self.ends: dict[int, asyncio.Future] = {}
        self.fail_with = fail_with

    async def launch(self, slot_id: int, first_trial: dict) -> None:
        self.launched.append((slot_id, first_trial))
        if self.fail_with:
            raise RuntimeError(self.fail_with)
        self.ends[slot_id] = asyncio.get_running_loop().create_future()
        await self.ends[slot_id]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


async def settle():
    for _ in range(5):
        await asyncio.sleep(0)


def test_trials_share_one_warm_slot_in_turn_and_only_the_first_pays_for_the_group():
    async def go():
        fits = Fits()
        b = Broker(1, fits.launch)
        a1 = await b.submit("a", trial(), "/runs/trial-a", 1)
        a2 = await b.submit("b", trial(), "/runs/trial-b", 1)
        await settle()
        assert [s for s, _ in fits.launched] == [0]  # one group for both
        first = await b.next_assignment(0, None)
        assert first.trial_id == "a" and first.slot_opened_at is not None  # built for this trial
        assert await b.report(a1, {"epoch": 1, "epoch_time_s": 2.0}, {"probed": 1.0}) is True
        assert await b.report(a1, {"epoch": 1, "epoch_time_s": 9.0}, resent=True) is True  # nothing trained
        await b.finish(a1)
        polled = await b.poll("a", a1, 0, wait_s=0)
        assert polled.done and polled.failure is None and len(polled.reports) == 2
        assert polled.timeline == {"probed": 1.0} and polled.timeline_at == 0
        second = await b.next_assignment(0, first.seq)
        assert second.trial_id == "b" and second.seq == a2 and second.slot_opened_at is None  # warm
        assert [s for s, _ in fits.launched] == [0]
        assert b.busy_s == 2.0
        return b

    run(go())


def test_a_trial_the_driver_ends_stops_at_its_next_report_and_the_slot_takes_the_next():
    async def go():
        b = Broker(1, Fits().launch)
        a1 = await b.submit("a", trial(), "/runs/a", 1)
        await b.submit("b", trial(), "/runs/b", 1)
        got = await b.next_assignment(0, None)
        assert await b.report(a1, {"epoch": 1}) is True
        await b.end("a")  # ASHA stopped it
        assert await b.report(a1, {"epoch": 2}) is False  # every rank stops after this epoch
        await b.finish(a1)
        assert (await b.next_assignment(0, got.seq)).trial_id == "b"
        # a trial ended while still queued never reaches a group
        await b.submit("c", trial(), "/runs/c", 1)
        await b.end("c")
        assert (await b.poll("c", b.trials["c"].seq, 0, wait_s=0)).done
        assert b.queue == []

    run(go())


def test_a_group_that_asks_again_after_a_slow_answer_is_not_counted_as_a_restart():
    """Rank 0's ask for work timed out (a broker slow to answer) and it asked again: the same group, by its token,
    is not a restart; a new group (another token) is."""
    async def go():
        b = Broker(1, Fits().launch)
        seq = await b.submit("a", trial(), "/runs/a", 1)
        assert (await b.next_assignment(0, None, "group-1")).seq == seq
        for _ in range(3):  # the first answer never reached it
            assert (await b.next_assignment(0, None, "group-1")).seq == seq
        assert b.trials["a"].restarts == 0
        assert (await b.next_assignment(0, None, "group-2")).seq == seq and b.trials["a"].restarts == 1
        assert (await b.next_assignment(0, None, "group-2")).seq == seq and b.trials["a"].restarts == 1

    run(go())


def test_a_restarted_group_resumes_its_trial_until_the_restarts_are_spent_then_the_trial_fails_with_the_cause():
    async def go():
        b = Broker(1, Fits().launch)
        seq = await b.submit("a", trial(), "/runs/a", 1)
        assert (await b.next_assignment(0, None)).seq == seq
        await b.group_error(0, "rank 1: A worker health check failed: the actor died unexpectedly")
        again = await b.next_assignment(0, None)  # the new group's rank 0: the same trial, from its checkpoint
        assert again.seq == seq and b.trials["a"].restarts == 1
        assert again.slot_opened_at is None  # a restart is not this trial's start-up
        assert await b.next_assignment(0, None) is None  # a second restart: max_failures 1 spent; nothing else
        polled = await b.poll("a", seq, 0, wait_s=0)
        assert polled.done and "train.max_failures 1" in polled.failure.message
        assert "died unexpectedly" in polled.failure.message  # metrics.error_line names it a worker death
        assert polled.failure.kind == "error"  # restarts spent: the trial's own (a crash in its step looks so)

    run(go())


def test_a_trial_of_another_shape_gets_a_group_of_its_own_in_place_of_an_idle_one():
    async def go():
        fits = Fits()
        b = Broker(1, fits.launch)
        a1 = await b.submit("a", trial(CPU2), "/runs/a", 0)
        got = await b.next_assignment(0, None)
        await b.finish(a1)
        await b.submit("b", trial(CPU3), "/runs/b", 0)
        await settle()
        assert [(s, t["scaling"]["num_workers"]) for s, t in fits.launched] == [(0, 2), (1, 3)]
        assert await b.next_assignment(0, got.seq) == RETIRE  # the 2-worker group leaves
        assert (await b.next_assignment(1, None)).trial_id == "b"

    run(go())


def test_a_slot_whose_group_cannot_start_fails_its_trial_with_the_cause():
    async def go():
        b = Broker(1, Fits(fail_with="ControllerError: The worker group startup timed out after 15.0 seconds").launch)
        seq = await b.submit("a", trial(), "/runs/a", 3)
        polled = await b.poll("a", seq, 0, wait_s=5)
        failure = polled.failure
        assert polled.done and "startup timed out" in failure.message
        assert "worker group lost" in failure.message
        assert failure.kind == "infra"  # not the trial's fault: its relay submits it again
        assert b.slots == {}

    run(go())


def test_a_group_whose_set_up_fails_every_time_ends_its_slot_and_no_trial_of_that_shape_waits_forever():
    async def go():
        fits = Fits()
        b = Broker(1, fits.launch)
        shape = {"scaling": {**CPU2, "max_setup_failures": 3}}
        seq = await b.submit("a", shape, "/runs/a", 5)
        queued = await b.submit("b", shape, "/runs/b", 5)
        await settle()
        for n in range(1, 3):  # Ray Train restarts the group after each; its rank 0 never gets to ask
            await b.group_error(0, f"rank 0: RuntimeError: CUDA error: no device ({n})")
            assert 0 in b.slots and not fits.ends[0].done()
        await b.group_error(0, "rank 0: RuntimeError: CUDA error: no device (3)\nrank 1: RuntimeError: same")
        await settle()
        assert fits.ends[0].cancelled()  # its fit() (on Ray: the slot host, with the controller) is ended
        polled = await b.poll("a", seq, 0, wait_s=0)
        assert polled.done and polled.failure.kind == "infra"
        message = polled.failure.message
        assert "set-up failed 3 times in a row (scaling.max_setup_failures 3)" in message
        assert "CUDA error: no device (3)" in message and "\n" not in message  # the workers' error, one line
        # no group of this shape ever set up: the queued trial, and any later one, fails at once (no new slot)
        assert (await b.poll("b", queued, 0, wait_s=0)).failure.kind == "infra"
        late = await b.submit("c", shape, "/runs/c", 5)
        assert (await b.poll("c", late, 0, wait_s=1)).done
        assert [s for s, _ in fits.launched] == [0] and b.slots == {}

    run(go())


def test_set_up_failures_count_in_a_row_and_a_failure_mid_trial_is_a_restart_not_a_set_up_failure():
    async def go():
        fits = Fits()
        b = Broker(1, fits.launch)
        shape = {"scaling": {**CPU2, "max_setup_failures": 2}}
        seq = await b.submit("a", shape, "/runs/a", 5)
        await settle()
        await b.group_error(0, "rank 0: set-up 1")  # one set-up fails
        assert (await b.next_assignment(0, None)).seq == seq  # the next one gets through: the count restarts
        await b.group_error(0, "rank 1: died mid-trial", "oom")  # a restart, counted against the trial's max_failures
        await b.group_error(0, "rank 0: set-up 1")  # the restarted group's set-up fails once: not yet the limit
        assert (await b.next_assignment(0, None)).seq == seq and b.trials["a"].restarts == 1
        assert b.trials["a"].last_error_kind == "oom" and 0 in b.slots

    run(go())


def test_an_idle_slot_with_nothing_queued_leaves_after_keep_warm_s(monkeypatch):
    import raysweep.slots.broker as broker  # the module Broker reads it from

    monkeypatch.setattr(broker, "ASK_WAIT_S", 0.05)

    async def go():
        b = Broker(1, Fits().launch, keep_warm_s=0.2)
        seq = await b.submit("a", trial(), "/runs/a", 1)
        got = await b.next_assignment(0, None)
        await b.finish(seq)
        assert await b.next_assignment(0, got.seq) is None  # idle, but not for long yet
        await asyncio.sleep(0.25)
        assert await b.next_assignment(0, got.seq) == RETIRE  # its resources go back to the cluster
        await b.submit("b", trial(), "/runs/b", 1)  # a later trial gets a new group
        await settle()
        assert len([s for s in b.slots.values() if not s.retiring]) == 1

    run(go())


def test_close_retires_every_slot_and_waits_for_its_group_to_leave():
    async def go():
        fits = Fits()
        b = Broker(2, fits.launch)
        await b.submit("a", trial(), "/runs/a", 0)
        await b.submit("b", trial(), "/runs/b", 0)
        await settle()
        assert sorted(b.slots) == [0, 1]
        closing = asyncio.ensure_future(b.close(wait_s=10))
        await settle()
        assert await b.next_assignment(0, None) == RETIRE
        for end in fits.ends.values():  # the groups' fit() return once their workers have left
            end.set_result(None)
        assert await closing == 0

    run(go())


def test_startup_phases_sum_to_trial_start_to_first_step_and_a_clock_skew_counts_as_zero():
    stamps = {"trial_started": 100.0, "relay_started": 101.5, "slot_asked": 101.6, "group_started": 111.6,
              "data_ready": 112.6, "model_ready": 113.0, "probed": 113.5}
    phases = startup_phases(stamps)
    assert set(phases) == set(STARTUP_NAMES)
    assert phases["startup_driver_s"] == pytest.approx(1.5) and phases["startup_group_s"] == pytest.approx(10.0)
    assert phases["startup_s"] == pytest.approx(13.5)
    warm = {**stamps, "slot_asked": 102.0, "group_started": 102.0, "data_ready": 102.0, "model_ready": 102.2,
            "probed": 102.4}
    assert startup_phases(warm)["startup_group_s"] == 0 and startup_phases(warm)["startup_s"] == pytest.approx(2.4)
    skewed = {**stamps, "group_started": 101.0}  # a worker node's clock 0.6 s behind
    assert startup_phases(skewed)["startup_group_s"] == 0
    assert startup_phases(skewed)["startup_data_s"] == pytest.approx(11.0)


def test_busy_share_is_training_seconds_over_wall_time_times_slots():
    assert busy_share(60.0, 100.0, 2) == pytest.approx(0.3)


def test_a_slot_waits_for_tunes_decision_only_at_the_epochs_where_asha_decides(tmp_path):
    """Between rungs ASHA never stops a trial: the slot goes on at once; at a rung its answer waits for Tune (the
    trial's ack, or its end), so a cut trial trains no epoch past its rung."""
    from ray.tune.schedulers import TrialScheduler

    from raysweep.asha import AshaPlan
    from raysweep.config import load_config

    from conftest import tiny_spec, write_spec

    config = load_config(write_spec(tmp_path, tiny_spec(tmp_path)), ["train.epochs=8", "tune.asha.grace_period=1",
                                                                    "tune.asha.reduction_factor=2"])
    plan = AshaPlan.of(config)
    scheduler = plan.scheduler()
    scheduler.set_search_properties(config.tune.metric, "min")
    epochs = plan.decision_points
    assert epochs == (1, 2, 4, 8)

    class Trial:  # what ASHA reads of a trial
        def __init__(self, trial_id):
            self.trial_id, self.config = trial_id, {}

    # ASHA's own decisions: a worse trial is stopped at a rung, never between rungs
    for name in ("good0", "good1", "good2", "bad"):
        scheduler.on_trial_add(None, Trial(name))
    for t in range(3):
        for epoch in range(1, 9):
            decision = scheduler.on_trial_result(None, Trial(f"good{t}"), {"epoch": epoch, "val_loss": 1.0 / epoch})
    stopped = [e for e in range(1, 9)
               if scheduler.on_trial_result(None, Trial("bad"), {"epoch": e, "val_loss": 9.0}) == TrialScheduler.STOP]
    assert stopped and set(stopped) <= set(epochs), (stopped, decision)

    async def go():
        b = Broker(1, Fits().launch)
        seq = await b.submit("a", trial(), "/runs/a", 0, epochs)
        await b.next_assignment(0, None)
        assert await b.report(seq, {"epoch": 2}, resent=True) is True  # a restored checkpoint's: never waits
        assert await b.report(seq, {"epoch": 3}) is True  # not a rung: no wait
        at_rung = asyncio.ensure_future(b.report(seq, {"epoch": 4}))
        await settle()
        assert not at_rung.done()  # waiting for Tune
        await b.end("a")  # ASHA cut it at the rung
        assert await at_rung is False
        seq2 = await b.submit("b", trial(), "/runs/b", 0, epochs)
        await b.next_assignment(0, seq)
        at_rung = asyncio.ensure_future(b.report(seq2, {"epoch": 1}))
        await settle()
        await b.ack("b", seq2, 1)  # Tune let it go on
        assert await at_rung is True

    run(go())


def test_asha_in_seconds_decides_on_train_seconds_and_a_slot_waits_where_they_cross_a_rung(tmp_path):
    """tune.asha.unit: seconds. Two trials learn the same per epoch, one at 2 s an epoch, one at 10 s: by epochs
    they tie, by the seconds they cost the slow one is worse, and ASHA cuts it at the first report past a rung in
    train_seconds (its first epoch, 10 s ≥ the 8 s rung). The broker waits for Tune exactly at reports that cross
    a rung."""
    from ray.tune.schedulers import TrialScheduler

    from raysweep.asha import AshaPlan
    from raysweep.config import load_config

    from conftest import tiny_spec, write_spec

    config = load_config(write_spec(tmp_path, tiny_spec(tmp_path)), [
        "train.epochs=40", "train.time_budget_s=64", "tune.asha.unit=seconds", "tune.asha.grace_period=8",
        "tune.asha.reduction_factor=2"])
    assert (config.time_attr, config.max_t) == ("train_seconds", 64)
    points = AshaPlan.of(config).decision_points
    assert points == (8, 16, 32, 64)  # grace × 2^k up to max_t, in seconds

    class Trial:
        def __init__(self, trial_id):
            self.trial_id, self.config = trial_id, {}

    def decisions(unit_config, pace):
        scheduler = AshaPlan.of(unit_config).scheduler()
        scheduler.set_search_properties("val_loss", "min")
        for name in ("fast0", "fast1", "slow"):
            scheduler.on_trial_add(None, Trial(name))
        attr = unit_config.time_attr
        for t in range(2):
            for epoch in range(1, 33):
                scheduler.on_trial_result(None, Trial(f"fast{t}"), {"epoch": epoch, "train_seconds": 2.0 * epoch,
                                                                      "val_loss": 1.0 / epoch})
        for epoch in range(1, 7):
            result = {"epoch": epoch, "train_seconds": pace * epoch, "val_loss": 1.0 / epoch}
            if scheduler.on_trial_result(None, Trial("slow"), result) == TrialScheduler.STOP:
                return result[attr]
        return None

    assert decisions(config, 10.0) == 10.0  # cut at 10 s: the fast ones were at 1/4 by 8 s, it at 1/1
    by_epochs = load_config(write_spec(tmp_path, tiny_spec(tmp_path), "epochs.yaml"), [
        "train.epochs=40", "tune.asha.grace_period=1", "tune.asha.reduction_factor=2"])
    assert decisions(by_epochs, 10.0) is None  # in epochs the same curves tie: nothing cut in 6 epochs

    async def go():
        b = Broker(1, Fits().launch)
        seq = await b.submit("a", trial(), "/runs/a", 0, points, "train_seconds")
        await b.next_assignment(0, None)
        assert await b.report(seq, {"epoch": 1, "train_seconds": 5.0}) is True  # below the first rung
        crossing = asyncio.ensure_future(b.report(seq, {"epoch": 2, "train_seconds": 10.0}))  # 8 s crossed
        await settle()
        assert not crossing.done()
        await b.ack("a", seq, 2)
        assert await crossing is True
        assert await b.report(seq, {"epoch": 3, "train_seconds": 15.0}) is True  # 8 < 15 < 16: no rung
        crossing = asyncio.ensure_future(b.report(seq, {"epoch": 4, "train_seconds": 40.0}))  # past 16 and 32
        await settle()
        assert not crossing.done()
        await b.end("a")
        assert await crossing is False

    run(go())


def test_a_checkpoint_waits_until_the_store_holds_every_earlier_epoch_and_close_stops_what_runs():
    """A slot runs ahead of the driver's MLflow writer by at most one epoch: it checkpoints epoch k only once the
    store holds every epoch before it, so a driver stopped in between leaves no checkpoint past epochs MLflow
    never recorded."""
    async def go():
        b = Broker(1, Fits().launch)
        seq = await b.submit("a", trial(), "/runs/a", 0)
        await b.next_assignment(0, None)
        assert await b.recorded_through(seq, 0, wait_s=0)  # nothing before epoch 1: it may checkpoint
        await b.report(seq, {"epoch": 1})
        waiting = asyncio.ensure_future(b.recorded_through(seq, 1, wait_s=10))
        await settle()
        assert not waiting.done()
        await b.ack("a", seq, 1)  # Tune let it go on: not enough, the store must hold it
        await settle()
        assert not waiting.done()
        await b.recorded("a", 1)
        assert await waiting is True
        await b.report(seq, {"epoch": 2})
        waiting = asyncio.ensure_future(b.recorded_through(seq, 2, wait_s=10))
        await settle()
        await asyncio.wait_for(b.close(wait_s=0), 5)  # Ctrl-C: the sweep closes its slots
        assert await waiting is False  # no checkpoint of epoch 3
        assert await b.report(seq, {"epoch": 3}) is False
        # what the store holds is the trial's, not the assignment's: a retry that re-sent a logged epoch goes on
        b2 = Broker(1, Fits().launch)
        await b2.recorded("r", 4)
        seq_r = await b2.submit("r", trial(), "/runs/r", 0)
        await b2.next_assignment(0, None)
        assert await b2.recorded_through(seq_r, 4, wait_s=0)
        await b2.recorded("r", 2)  # a late, older notice does not move it back
        assert await b2.recorded_through(seq_r, 4, wait_s=0)
        # a driver that stopped recording fails the trial instead of leaving it silently short
        seq2 = await b2.submit("b", trial(), "/runs/b", 0)
        await b2.end("r")
        await b2.next_assignment(0, seq_r)
        await b2.report(seq2, {"epoch": 1})
        assert await b2.recorded_through(seq2, 1, wait_s=0.05) is False
        failure = (await b2.poll("b", seq2, 0, wait_s=0)).failure
        assert "MLflow recorded none of the trial's epochs after 0" in failure.message and failure.kind == "infra"

    run(go())
