"""A search that learns from its trials (tune.search: tpe) and a report that shows which knob mattered (issue 30).

What Optuna is told is read back from the study itself (Tune's saved searcher, search.restored); the importance
from a record made by hand, where the answer is known; and a TPE sweep end to end on the session's Ray with MLflow
on SQLite: interrupted with Ctrl-C (SIGINT to a real driver process), resumed, its study read back before and
after."""

from __future__ import annotations

import math
import signal
import time

import pytest

from raysweep.cli import main

from conftest import tiny_spec, write_spec

# ---------------------------------------------------------------------------------------------
# What Optuna is told (real Optuna, no Ray cluster)


def _tpe(time_attr: str, max_t: float, rungs: tuple[float, ...]):
    import optuna

    from raysweep.metrics import Horizon
    from raysweep.search import RungTPE

    space = {"base_lr": optuna.distributions.FloatDistribution(1e-4, 1e-2, log=True)}
    return RungTPE(space, Horizon(time_attr, max_t), rungs, metric="val_loss", mode="min",
                   sampler=optuna.samplers.TPESampler(seed=0))


def test_a_trial_asha_cut_reaches_optuna_pruned_with_its_rung_values_at_their_budgets_never_complete():
    """ASHA in seconds (rungs at 5, 10 and 20 training seconds, max_t 30): a trial cut after 12 s is PRUNED with
    the values ASHA recorded at 5 and 10 s, at steps 5 and 10 (the budget, not Tune's iteration); one that ran to
    max_t is COMPLETE with its last value; a failed one FAIL. Tune's own OptunaSearch, told the same, calls the cut
    trial COMPLETE with its 12-second value: the trap this searcher exists for."""
    from optuna.trial import TrialState
    from ray.tune.search.optuna import OptunaSearch

    from raysweep.failures import note_kind

    search = _tpe("train_seconds", 30.0, (5.0, 10.0, 20.0))
    for trial_id in ("cut", "ran", "broke"):
        search.suggest(trial_id)
    reports = [{"train_seconds": 3.0, "val_loss": 2.0}, {"train_seconds": 7.5, "val_loss": 1.5}]
    for result in reports:  # Tune calls on_trial_result for each report ASHA let go on
        search.on_trial_result("cut", result)
    # the report ASHA stopped the trial at never reaches on_trial_result: only on_trial_complete
    search.on_trial_complete("cut", {"train_seconds": 12.0, "val_loss": 1.2})
    for seconds, loss in ((6.0, 1.6), (11.0, 1.1), (21.0, 0.9)):
        search.on_trial_result("ran", {"train_seconds": seconds, "val_loss": loss})
    search.on_trial_complete("ran", {"train_seconds": 30.5, "val_loss": 0.7})
    search.on_trial_result("broke", {"train_seconds": 6.0, "val_loss": 1.9})
    search.on_trial_complete("broke", error=True)
    note_kind("broke", "error")  # what the driver's MLflow callback does right after (its code raised)
    search.on_trial_complete("cut", {"train_seconds": 12.0, "val_loss": 1.2})  # told again (a resume): no change

    cut, ran, broke = (search.study.trials[search.numbers[t]] for t in ("cut", "ran", "broke"))
    assert cut.state == TrialState.PRUNED and cut.intermediate_values == {5: 1.5, 10: 1.2} and cut.value == 1.2
    assert ran.state == TrialState.COMPLETE and ran.value == 0.7 and ran.intermediate_values == {5: 1.6, 10: 1.1,
                                                                                                   20: 0.9}
    assert broke.state == TrialState.FAIL and broke.intermediate_values == {5: 1.9}

    import optuna

    plain = OptunaSearch({"base_lr": optuna.distributions.FloatDistribution(1e-4, 1e-2, log=True)},
                         metric="val_loss", mode="min")
    plain.suggest("cut")
    plain.on_trial_complete("cut", {"train_seconds": 12.0, "val_loss": 1.2})
    assert plain._ot_study.trials[0].state == TrialState.COMPLETE  # upstream: a cut trial is a complete one


def test_failures_are_told_by_kind_and_one_resume_continues_reaches_the_study_through_tunes_limiter():
    """Through Tune's own ConcurrencyLimiter (one trial at a time), as a sweep runs it: a trial that diverged or ran
    out of memory is COMPLETE with a value worse than any (TPE draws fewer like it; FAIL, which TPE ignores, let it
    propose them again), one whose code raised is FAIL, and one that failed for the infrastructure is FAIL too (it
    says nothing of its knobs: left RUNNING, constant_liar counted it among the worst trials for good): when --resume
    continues it, its real end reaches the study as a trial of the same knobs (the limiter had forgotten it)."""
    from optuna.trial import TrialState
    from ray.tune.search import ConcurrencyLimiter

    from raysweep.failures import note_kind

    search = _tpe("epoch", 4, (2.0,))
    limited = ConcurrencyLimiter(search, max_concurrent=1)
    ids = ("kind-nan", "kind-oom", "kind-bug", "kind-lost", "kind-ok")
    for trial_id, kind in zip(ids, ("diverged", "oom", "error", "infra", None), strict=True):
        assert limited.suggest(trial_id) is not None
        assert limited.suggest("kind-waits") is None  # one at a time
        limited.on_trial_result(trial_id, {"epoch": 2, "val_loss": 0.5})
        if kind is None:
            limited.on_trial_complete(trial_id, {"epoch": 4, "val_loss": 0.4})
        else:
            limited.on_trial_complete(trial_id, error=True)  # Tune tells the searcher first,
            note_kind(trial_id, kind)  # then its callbacks run (callbacks.MLflowEvents notes the kind)
    limited.suggest("kind-next")  # the searcher's next call settles what was noted
    state = {t: search.study.trials[search.numbers[t]] for t in ids}
    assert state["kind-nan"].state == TrialState.COMPLETE and state["kind-nan"].value == math.inf
    assert state["kind-oom"].state == TrialState.COMPLETE and state["kind-oom"].value == math.inf
    assert state["kind-bug"].state == TrialState.FAIL
    assert state["kind-lost"].state == TrialState.FAIL
    running = search.study.get_trials(states=(TrialState.RUNNING,))  # what constant_liar counts among the worst
    assert [t.number for t in running] == [search.numbers["kind-next"]]
    # --resume continues the lost trial: its reports and end reach the study through the limiter, as a trial of its
    # knobs with the rung values it had been told
    limited.on_trial_result("kind-lost", {"epoch": 3, "val_loss": 0.35})
    limited.on_trial_complete("kind-lost", {"epoch": 4, "val_loss": 0.3})
    lost = search.study.trials[search.numbers["kind-lost"]]
    assert lost.state == TrialState.COMPLETE and lost.value == 0.3 and lost.number == len(ids) + 1  # after kind-next
    assert lost.params == state["kind-lost"].params and lost.intermediate_values == {2: 0.5}


@pytest.mark.parametrize("kind", ["diverged", "oom"])
def test_a_failed_trial_is_the_worst_value_for_a_study_that_maximises(kind):
    """tune.mode max and no target (one_gpu.yaml with tune.search: tpe): a trial that diverged or ran out of memory
    was told +inf, the best value a maximising study can hold, so TPE drew more of the batches and LRs that blow up."""
    import optuna
    from optuna.trial import TrialState

    from raysweep.failures import note_kind
    from raysweep.metrics import Horizon
    from raysweep.search import RungTPE

    space = {"base_lr": optuna.distributions.FloatDistribution(1e-4, 1e-2, log=True)}
    search = RungTPE(space, Horizon("epoch", 4), (2.0,), metric="val_exact_acc", mode="max", sweep_mode="max",
                     sampler=optuna.samplers.TPESampler(seed=0))
    for trial_id, acc in (("good", 0.6), ("fair", 0.3)):
        search.suggest(trial_id)
        search.on_trial_complete(trial_id, {"epoch": 4, "val_exact_acc": acc})
    search.suggest("blew-up")
    search.on_trial_complete("blew-up", error=True)
    note_kind("blew-up", kind)
    search.suggest("next")
    blew_up = search.study.trials[search.numbers["blew-up"]]
    assert blew_up.state == TrialState.COMPLETE and blew_up.value == -math.inf
    assert search.study.best_trial.number == search.numbers["good"]


def test_a_trial_that_errors_after_the_last_suggestion_is_settled_before_the_study_is_saved(tmp_path):
    """The sweep's last trial errors: Tune tells the searcher, then the driver's callback notes the kind, and no
    suggest follows; the study Tune saves at the end (and `report`, and --resume, read back) held it RUNNING."""
    from optuna.trial import TrialState

    from raysweep.failures import note_kind
    from raysweep.search import restored

    search = _tpe("epoch", 4, (2.0,))
    search.suggest("first")
    search.on_trial_complete("first", {"epoch": 4, "val_loss": 0.4})
    search.suggest("last")
    search.on_trial_result("last", {"epoch": 2, "val_loss": 0.5})
    search.on_trial_complete("last", error=True)
    note_kind("last", "oom")
    search.save_to_dir(str(tmp_path), session_str="end")
    saved = restored(str(tmp_path))
    last = saved.study.trials[saved.numbers["last"]]
    assert last.state == TrialState.COMPLETE and last.value == math.inf


def test_with_a_target_the_study_minimises_what_the_sweep_ranks_by():
    """tune.target val_exact_acc ≥ 0.5 (a max metric): a trial that reached it is told its time to it (a trial
    stopped there was COMPLETE with its accuracy at that epoch, below full-length trials', and TPE steered away
    from the fastest); one that did not is worse than every one that did, ordered by its accuracy."""
    import optuna

    from raysweep.config import TargetConfig
    from raysweep.metrics import Horizon
    from raysweep.search import UNREACHED, RungTPE

    space = {"base_lr": optuna.distributions.FloatDistribution(1e-4, 1e-2, log=True)}
    search = RungTPE(space, Horizon("epoch", 6, stop_at_target=True), (2.0,),
                     target=TargetConfig(metric="val_exact_acc", value=0.5, stop=True), metric="val_exact_acc",
                     mode="min", sweep_mode="max", sampler=optuna.samplers.TPESampler(seed=0))
    results = {"fast": {"epoch": 3, "val_exact_acc": 0.55, "time_to_target_s": 20.0},
               "slow": {"epoch": 5, "val_exact_acc": 0.6, "time_to_target_s": 40.0},
               "never": {"epoch": 6, "val_exact_acc": 0.45}, "worse": {"epoch": 6, "val_exact_acc": 0.3}}
    for trial_id, result in results.items():
        search.suggest(trial_id)
        search.on_trial_complete(trial_id, result)
    values = {t: search.study.trials[search.numbers[t]].value for t in results}
    assert search.study.direction == optuna.study.StudyDirection.MINIMIZE
    assert values == {"fast": 20.0, "slow": 40.0, "never": UNREACHED - 0.45, "worse": UNREACHED - 0.3}
    assert search.study.best_trial.number == search.numbers["fast"]


def test_in_epochs_a_trial_is_told_at_each_rung_it_crossed_and_finishes_at_its_own_last_epoch():
    from optuna.trial import TrialState

    search = _tpe("epoch", 4.0, (1.0, 2.0))
    search.suggest("a")
    for epoch, loss in ((1, 2.0), (2, 1.8), (3, 1.6)):
        search.on_trial_result("a", {"epoch": epoch, "val_loss": loss})
    # finished: its epochs ran out (resolved_epochs, a time budget's) before max_t
    search.on_trial_complete("a", {"epoch": 3, "resolved_epochs": 3, "val_loss": 1.6})
    (a,) = search.study.trials
    assert a.state == TrialState.COMPLETE and a.value == 1.6 and a.intermediate_values == {1: 2.0, 2: 1.8}


# ---------------------------------------------------------------------------------------------
# Which knob mattered (a record made by hand: the answer is known)

SPEC = """search:
  per_gpu_batch_size: {choice: [16, 32, 64], default: 32}
  base_lr: {loguniform: [1.0e-4, 1.0e-2], default: 1.0e-3}
  warmup_epochs: 1
  weight_decay: {loguniform: [1.0e-5, 1.0e-2], default: 1.0e-4}
tune:
  asha: {grace_period: 2}
"""


def _known_record():
    """Twelve trials whose val_loss at epoch 2 is set by base_lr alone (a bowl around 1e-3) plus a little noise;
    the trials with the larger weight decays run on to epoch 4 and end far lower: by last values weight decay
    would look decisive, at the budget every trial reached (epoch 2) only the LR is. One failed trial, no value."""
    import numpy as np

    from raysweep.metrics import RunRecord, SweepRecord, run_ending

    rng = np.random.default_rng(0)
    lrs = np.exp(rng.uniform(math.log(1e-4), math.log(1e-2), 12))
    wds = np.exp(rng.uniform(math.log(1e-5), math.log(1e-2), 12))
    batches = rng.choice([16, 32, 64], 12)
    lrs[0], wds[0], batches[0] = 1e-3, 1e-4, 32  # the baseline
    trials = []
    for i, (lr, wd, batch) in enumerate(zip(lrs, wds, batches)):
        at_two = 1.0 + (math.log10(lr) + 3) ** 2 + 0.01 * rng.standard_normal()
        finished = wd > np.median(wds)
        epochs = 4 if finished else 2
        loss = {1: at_two + 0.5, 2: at_two, 3: at_two - 0.8, 4: at_two - 1.6}
        history = {"epoch": {e: float(e) for e in range(1, epochs + 1)},
                   "val_loss": {e: loss[e] for e in range(1, epochs + 1)}}
        params = {"per_gpu_batch_size": str(int(batch)), "base_lr": str(lr), "warmup_epochs": "1",
                  "weight_decay": str(wd), "global_batch_size": str(2 * int(batch)), "peak_lr": str(lr)}
        status = "finished" if finished else "pruned"
        tags = {"trial_id": f"t{i}", **run_ending(status, epochs).tags}
        trials.append(RunRecord(f"run{i}", f"t{i}", status, params, history, tags, 10.0, i == 0))
    trials.append(RunRecord("run12", "t12", "failed", {"per_gpu_batch_size": "64", "base_lr": "0.01",
                                                        "warmup_epochs": "1", "weight_decay": "0.01"},
                            {"epoch": {1: 1.0}, "val_loss": {1: float("nan")}},
                            {"trial_id": "t12", **run_ending("failed", 1, "diverged", "loss is nan").tags}, 5.0))
    return SweepRecord("sqlite:///mlflow.db", "t", "1", "parent", "t 2026-11-24", "val_loss", "min", SPEC, trials)


def test_importance_is_taken_at_the_budget_every_trial_reached_and_finds_the_knob_that_set_the_metric(tmp_path,
                                                                                                     capsys):
    from raysweep import console, report
    from raysweep.report.importance import _fanova, knob_importance, trial_labels

    record = _known_record()
    imp = knob_importance(record)
    assert (imp.clock, imp.budget, imp.at, len(imp.points)) == ("epoch", 2.0, "epoch 2", 12)  # the failed one out
    assert list(imp.importance)[0] == "base_lr" and imp.importance["base_lr"] > 0.6, imp.importance
    assert imp.importance["weight_decay"] < 0.25 and abs(sum(imp.importance.values()) - 1.0) < 1e-6
    # the same forest on each trial's last value credits weight decay first: the finished trials ran longer
    last = [(t, values, t.last("val_loss")) for t, values, _ in imp.points]
    assert list(_fanova(imp.knobs, last, "min"))[0] == "weight_decay"

    labels = trial_labels(record)
    assert labels["t0"] == "b32 lr1.0e-3 wd1.0e-4 (baseline)"  # warmup_epochs is fixed in this spec: not named
    assert labels["t12"] == "b64 lr1.0e-2 wd1.0e-2"

    built, _ = report.build(record, tmp_path / "report")
    assert "parallel_coordinates.png" in built.files and built.importance == imp
    png = (tmp_path / "report" / "parallel_coordinates.png").read_bytes()
    assert png[:4] == b"\x89PNG"
    page = (tmp_path / "report" / "report.html").read_text()
    assert "<h2 id='importance'>Which knob mattered</h2>" in page and "<td>base_lr</td>" in page
    assert "alt='parallel_coordinates.png'" in page
    console.print_report(built)
    out = capsys.readouterr().out
    assert "knob importance for val_loss at epoch 2 (fANOVA over 12 finished and pruned trials): base_lr " in out


def test_importance_needs_five_compared_trials_and_a_searched_knob():
    import dataclasses

    from raysweep.report.importance import knob_importance

    record = _known_record()
    assert knob_importance(dataclasses.replace(record, trials=record.trials[:5])) is not None
    # five trials and a failed one: four compared
    assert knob_importance(dataclasses.replace(record, trials=[*record.trials[:4], record.trials[-1]])) is None
    assert knob_importance(dataclasses.replace(record, spec_text="search: {base_lr: 0.001}\n")) is None


# ---------------------------------------------------------------------------------------------
# Bad input: one line, before Ray


@pytest.mark.parametrize("tune_section, message", [
    ({"search": "bohb"}, "tune.search: got 'bohb', expected 'random' or 'tpe'"),
    ({"search": "tpe"}, "tune.search: tpe has no searched knob to model; give one a distribution"),
])
def test_an_unknown_search_or_one_tpe_cannot_model_is_one_line_before_anything_starts(tmp_path, capsys,
                                                                                      tune_section, message):
    spec = tiny_spec(tmp_path, tune={"num_samples": 2, **tune_section})
    path = write_spec(tmp_path, spec)
    for command in ("check", "tune"):
        assert main([command, str(path)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0] and str(path) in err[0], err
    assert not (tmp_path / "results").exists() and not (tmp_path / "mlflow.db").exists()


# ---------------------------------------------------------------------------------------------
# A TPE sweep end to end: Ctrl-C, --resume, the study read back


@pytest.mark.ray
@pytest.mark.timeout(600)
def test_a_tpe_sweep_tells_optuna_what_asha_did_and_its_resume_continues_the_same_study(ray_cluster, tmp_path):
    from mlflow.tracking import MlflowClient
    from optuna.trial import TrialState

    from raysweep.search import restored

    from test_resilience import _children, _kill_tree, _start_driver, _wait_for

    # five trials one at a time, ASHA's rungs at epochs 1 and 2; base_lr 1e-6 cannot learn, so ASHA cuts such a
    # trial at its first rung against the baseline's (2e-3); tune.seed 1 draws it among TPE's random start-up trials.
    # 1,536 images: an epoch of about a second here, so that a trial past its first rung stays running with an epoch
    # logged for a few seconds (at 384 images its whole trial took 1 s, and under CI's load the driver's Ctrl-C below
    # missed that window on every trial: the sweep ended first)
    spec = tiny_spec(tmp_path, data={"width": 64, "height": 24, "synthetic": {"train_size": 1536, "val_size": 64}},
                     train={"epochs": 3, "reference_batch_size": 64},
                     search={"per_gpu_batch_size": 16, "base_lr": {"choice": [2.0e-3, 1.0e-6], "default": 2.0e-3},
                             "warmup_epochs": 0, "weight_decay": {"loguniform": [1.0e-5, 1.0e-2], "default": 1.0e-4}},
                     tune={"num_samples": 5, "seed": 1, "search": "tpe",
                           "asha": {"grace_period": 1, "reduction_factor": 2}})
    path = write_spec(tmp_path, spec)
    experiment = tmp_path / "results" / "t"

    def ended():
        return [r for r in _children(tmp_path) if r.info.status in ("FINISHED", "KILLED")]

    driver = _start_driver(path, tmp_path / "run1.log")
    try:  # Ctrl-C once two trials ended and a third has run an epoch
        # the store is read only once the driver made it (two processes migrating one SQLite file fail)
        _wait_for(lambda: "] start " in (tmp_path / "run1.log").read_text(), 240, "the driver's first trial")
        deadline = time.monotonic() + 400
        while not (len(ended()) >= 2 and any(
                r.info.status == "RUNNING" and "epoch" in r.data.metrics for r in _children(tmp_path))):
            assert driver.poll() is None, \
                "the sweep ended before a third trial ran an epoch:\n" + (tmp_path / "run1.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "timed out waiting for two trials ended and a third running"
            time.sleep(0.2)
        _kill_tree(driver, signal.SIGINT)
        assert driver.wait(timeout=120) == 130
    finally:
        if driver.poll() is None:
            _kill_tree(driver, signal.SIGKILL)
    # the command that resumes it, as typed (it said `tune SPEC --resume`)
    last = (tmp_path / "run1.log").read_text().strip().splitlines()[-1]
    assert last == f"raysweep: interrupted (resume with: python -m raysweep tune {path} --resume)", last
    before = restored(str(experiment))
    told = {n: t for n, t in enumerate(before.study.trials) if t.state != TrialState.RUNNING}
    assert len(told) >= 2, before.study.trials

    t0 = time.monotonic()
    assert main(["tune", str(path), "--resume"]) == 0
    assert time.monotonic() - t0 < 400
    after = restored(str(experiment))
    study = after.study
    assert len(study.trials) == 5 and sorted(after.numbers.values()) == [0, 1, 2, 3, 4]
    for number, trial in told.items():  # the same study, continued: what it was told before stays as it was
        again = study.trials[number]
        assert (again.params, again.state, again.value, again.intermediate_values) == \
            (trial.params, trial.state, trial.value, trial.intermediate_values)
    assert study.trials[0].params == {"base_lr": 2.0e-3, "weight_decay": 1.0e-4}  # the baseline first

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = {r.data.tags["trial_id"]: r for r in _children(tmp_path)}
    assert set(runs) == set(after.numbers)
    states = []
    for trial_id, number in after.numbers.items():
        run, trial = runs[trial_id], study.trials[number]
        assert float(run.data.params["base_lr"]) == trial.params["base_lr"]
        losses = {int(m.step): m.value for m in client.get_metric_history(run.info.run_id, "val_loss")}
        if run.info.status == "KILLED":  # pruned by ASHA at a rung (epoch 1 or 2): PRUNED, its rung values
            assert run.data.tags["stopped_by"] == "asha"
            assert trial.state == TrialState.PRUNED and trial.intermediate_values == {
                rung: losses[rung] for rung in (1, 2) if rung <= max(losses)}
        else:
            assert run.info.status == "FINISHED"
            assert trial.state == TrialState.COMPLETE and trial.value == losses[3]
            assert trial.intermediate_values == {1: losses[1], 2: losses[2]}
        states.append(trial.state)
    assert TrialState.PRUNED in states and TrialState.COMPLETE in states, states
    assert runs[next(t for t, n in after.numbers.items() if n == 0)].data.tags.get("raysweep.baseline") == "true"

    # the report: the knobs' importance and the parallel coordinates, in report.html and on the parent run
    page = (experiment / "report" / "report.html").read_text()
    assert "<h2 id='importance'>Which knob mattered</h2>" in page and "alt='parallel_coordinates.png'" in page
    parent_id = next(iter(runs.values())).data.tags["mlflow.parentRunId"]
    parent = client.get_run(parent_id)
    assert {"importance_base_lr", "importance_weight_decay"} <= set(parent.data.metrics)
    artifacts = {a.path for a in client.list_artifacts(parent_id, "report")} | {
        a.path for a in client.list_artifacts(parent_id)}
    assert {"report/parallel_coordinates.png", "importance.json"} <= artifacts, artifacts


@pytest.mark.ray
@pytest.mark.timeout(400)
def test_a_tpe_sweep_under_asha_in_seconds_tells_each_trial_at_the_rungs_training_seconds(ray_cluster, tmp_path):
    """ASHA in training seconds (rungs at 1.5 and 3 s, a budget of 4.5 s): every trial's intermediate values in the
    study are its metric at its first epoch at or past each rung it reached (steps 2 and 3: the rungs in whole
    seconds), whatever epoch that was for its batch; pruned trials PRUNED, the others COMPLETE at their last."""
    from mlflow.tracking import MlflowClient
    from optuna.trial import TrialState

    from raysweep.search import restored

    from test_resilience import _children

    spec = tiny_spec(tmp_path, train={"epochs": 40, "reference_batch_size": 64, "time_budget_s": 4.5},
                     search={"per_gpu_batch_size": {"choice": [8, 32], "default": 8},
                             "base_lr": {"choice": [2.0e-3, 1.0e-6], "default": 2.0e-3}, "warmup_epochs": 0,
                             "weight_decay": 1.0e-4},
                     tune={"num_samples": 3, "seed": 0, "search": "tpe",
                           "asha": {"unit": "seconds", "grace_period": 1.5, "reduction_factor": 2}})
    assert main(["tune", str(write_spec(tmp_path, spec))]) == 0
    search = restored(str(tmp_path / "results" / "t"))
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = {r.data.tags["trial_id"]: r for r in _children(tmp_path)}
    assert set(runs) == set(search.numbers) and len(runs) == 3
    for trial_id, number in search.numbers.items():
        run, trial = runs[trial_id], search.study.trials[number]
        clock = {int(m.step): m.value for m in client.get_metric_history(run.info.run_id, "train_seconds")}
        loss = {int(m.step): m.value for m in client.get_metric_history(run.info.run_id, "val_loss")}
        expected = {}
        for rung, step in ((1.5, 2), (3.0, 3)):
            first = next((e for e in sorted(clock) if clock[e] >= rung), None)
            if first is not None:
                expected[step] = loss[first]
        assert trial.intermediate_values == expected, (trial_id, clock, trial.intermediate_values)
        if run.data.tags.get("stopped_by") == "asha":
            assert trial.state == TrialState.PRUNED
        else:
            assert run.info.status == "FINISHED" and trial.state == TrialState.COMPLETE
            assert trial.value == loss[max(loss)]
