"""The answer in a made-up world that is *not* the fit's own model (tests/answer_world.py): the best LR moves with the
budget (2× higher early than at the end), the bowl is asymmetric with a divergence cliff, the sweep runs under a
time budget whose trials end below ASHA's max_t, ASHA promotes on noisy values, and the clock of the budget counts
evaluation that the throughput does not. Each test names the defect it pins; each failed on the answer before the
fit read the trials' ends and the predictions were anchored at the answer."""

from __future__ import annotations

import dataclasses
import math

import pytest
from answer_world import (
    BUDGET_S,
    EVAL_SHARE,
    SPEC,
    TRAIN_SIZE,
    answer_to,
    final_best,
    left_out_clauses,
    predict_at,
    rate,
    world,
)

from raysweep.answer.records import FROM_BOTTOM
from raysweep.metrics import ConfirmationRecord, SweepRecord


@pytest.fixture(scope="module")
def sweep() -> SweepRecord:
    return world()


def test_the_world_is_what_the_tests_say(sweep):
    """Its finished trials end below ASHA's max_t (20 s: only the rungs were read before), some diverged, ASHA
    pruned most."""
    statuses = [t.status for t in sweep.trials]
    assert statuses.count("failed") >= 3 and statuses.count("pruned") > statuses.count("finished") >= 6
    ends = [t.last("train_seconds") for t in sweep.trials if t.status == "finished"]
    assert all(18.0 <= s < BUDGET_S for s in ends)


def test_the_fit_reads_where_each_finished_trial_ended_not_only_the_rungs(sweep):
    """Findings 1 and 2: under a time budget the fit saw only rung values (2, 6 and 18 s of 20), so its best LR was
    the early optimum: 1.64-1.79× the final one at every batch in this world with a symmetric bowl, over five seeds.
    Read at the trials' ends, with the bottom's move over training fitted, it is the final one."""
    fit = answer_to(sweep).lr_fit
    assert fit.fitted and "the end of each trial that ran its whole budget" in fit.budget, fit.reason
    errors = []
    for seed in range(5):
        fit = answer_to(world(seed=seed, steeper=1.0)).lr_fit
        errors += [abs(math.log(fit.optimum(b) / final_best(b))) for b in (32, 256)]
    assert sum(errors) / len(errors) < math.log(1.25), errors  # the rung-only fit: ln 1.71 ≈ 0.54


def test_a_predicted_lr_is_the_answers_moved_along_the_checked_slope(sweep):
    """Finding 2 and 9: predictions went through the fitted vertex (1.75-1.84× the final best in such a world).
    Now: the answer's LR × (B / B_answer)^α, α the check's choice, and close to the world's best."""
    base = answer_to(sweep)
    r, fit = base.recipe, base.lr_fit
    assert fit.check is not None and fit.check.used in ("fit", "sqrt"), fit.check  # the world's rule is √B
    assert fit.check.errors["none"] > min(fit.check.errors["fit"], fit.check.errors["sqrt"])
    for batch in (32, 512):
        if batch == r.global_batch:
            continue
        at = predict_at(sweep, batch)
        b_noise = fit.b_noise or math.inf
        ratio = min(batch, b_noise) / min(r.global_batch, b_noise)
        assert at.recipe.peak_lr == pytest.approx(r.peak_lr * ratio ** fit.used_exponent)
        assert at.notes[0].startswith(f"peak LR {at.recipe.peak_lr:.2e} = the answer's")
    assert r.peak_lr / final_best(r.global_batch) == pytest.approx(1.0, abs=0.35)


def test_values_read_inside_warmup_do_not_place_the_best_lr():
    """Found by benchmarks/answer_check.py: ASHA's first rung (2.2 s) read every trial at the end of its first epoch,
    its warmup, where the values fall with the LR (the peak was only just reached), and the fit put the best LR 1.5-2.6×
    below the grid's at every batch. In such a world the fit with those values was 1.8× off (geometric mean over
    five sweeps and four batches; 1.34× without them); it reads only values from after each trial's warmup (and
    every trial's end)."""
    errors = []
    for seed in range(5):
        fit = answer_to(world(seed=seed, warmup=True)).lr_fit
        assert fit.fitted, fit.reason
        errors += [abs(math.log(fit.optimum(b) / final_best(b))) for b in (32, 64, 128, 256)]
    assert sum(errors) / len(errors) < math.log(1.4), errors  # with them: ln 1.8 ≈ 0.59


def test_an_answer_says_when_ashas_first_rung_judged_trials_inside_their_warmup():
    """Seen in benchmarks/answer_check.py: under tune.asha.unit: seconds nothing can refuse a grace period shorter
    than the warmup before the sweep (an epoch's seconds are measured by the trials), and its first rung (2.2 s) read
    every trial at the end of its first epoch, its warmup: ASHA pruned on values from before the LR peaked, and the
    fit left them out (25 of 64 trials kept). Here the first rung (2 s) ends inside the warmup at batches 32 and 64
    (3.98 s and 2.81 s an epoch) and after it at 128 and 256. The answer says so in one note: how many trials the
    rung read inside their warmup, how many it stopped there, and the grace period past the longest warmup that ran."""
    record = world(seed=0, warmup=True)
    rung = 2.0
    compared = inside = stopped = 0
    longest = 0.0
    for t in record.trials:
        if t.status not in ("finished", "pruned"):
            continue
        times = t.history["train_seconds"]
        first = min(e for e, s in times.items() if s >= rung)
        compared += 1
        inside += first <= 1
        stopped += first <= 1 and t.status == "pruned" and t.epoch == first
        longest = max(longest, times[1])
    assert 0 < stopped < inside < compared, (stopped, inside, compared)
    notes = [n for n in answer_to(record).notes if "ASHA's first rung" in n]
    assert notes == [f"ASHA's first rung (2 training seconds) read {inside} of the {compared} trials it compared "
                     f"inside their warmup and stopped {stopped} of them there, before their LR reached its peak (the "
                     f"LR fit leaves such values out): raise tune.asha.grace_period past {longest:.3g} training "
                     f"seconds, the longest warmup a trial took"], notes
    later = SPEC.replace("grace_period: 2,", "grace_period: 4.5,")  # past every trial's first epoch
    assert not [n for n in answer_to(dataclasses.replace(record, spec_text=later)).notes if "first rung" in n]


def test_the_check_compares_exponents_not_where_the_answers_sampled_lr_fell():
    """The check moved the answer's own sampled LR to each left-out batch: its mean error was lowest for whichever
    exponent made up for where that LR fell on those batches (smaller than the answer's, mostly), and the prediction
    for a larger batch inherited the opposite error. Anchored at each batch's measured best (the bottom of the
    sweep's bowl there), over twelve sweeps of the warmup world the prediction at 512 (twice the largest batch) is
    1.25× off the world's best (geometric mean); anchored at the sampled LR it was 1.66× off (1.54× with the warmup
    values already left out of the fit). In the world without the warmup's values (the fit's own model, where the
    first rung's values are as good as any), this check is the worse one: 1.46× against 1.29×."""
    errors = []
    for seed in range(12):
        sweep = world(seed=seed, warmup=True)
        errors.append(abs(math.log(predict_at(sweep, 512).recipe.peak_lr / final_best(512))))
    assert sum(errors) / len(errors) < math.log(1.4), errors


def test_a_sweep_whose_batches_have_no_measured_best_says_why_it_is_unchecked(sweep):
    """Where fewer than two batches have a best LR the check can measure (a bottom inside their LRs, or a best trial
    that ran whole), there is no check: the answer said "one global batch ran" of a sweep over four."""
    from raysweep.answer.console import used_words
    from raysweep.answer.predict import _lr_at

    base = answer_to(sweep)
    unchecked = dataclasses.replace(base, lr_fit=dataclasses.replace(base.lr_fit, check=None))
    assert len(unchecked.lr_fit.batches) == 4
    assert "(unchecked: fewer than two of its global batches have a best LR it could place" in used_words(
        unchecked.lr_fit)
    lr, notes = _lr_at(unchecked, 2 * base.recipe.global_batch)
    assert lr == pytest.approx(base.recipe.peak_lr * 2 ** 0.5)  # the square-root rule, unchecked
    assert "the square-root rule (B^0.5; unchecked: fewer than two of its global batches" in notes[0], notes[0]


def test_the_answers_own_batch_returns_the_answer(sweep):
    """Finding 3: `answer --batch <its own batch>` gave 1.44-1.80× its LR and 0.40-0.70× its decay."""
    base = answer_to(sweep)
    same = predict_at(sweep, base.recipe.global_batch)
    assert same.recipe == base.recipe and same.expected == base.expected
    assert same.confirm_command == f"python -m raysweep confirm w.yaml --batch {base.recipe.global_batch}"


def test_weight_decay_keeps_tau_with_one_D_on_the_budgets_clock(sweep):
    """Findings 4 and 5: τ took D from the samples the answer's trial saw, predictions from the budget × the
    training-only throughput. Now one D for both: the budget's seconds at samples_seen / train_seconds."""
    from raysweep.answer import rates

    base = answer_to(sweep)
    r = base.recipe
    measured = rates(sweep)
    assert measured[r.global_batch] == pytest.approx(rate(r.global_batch) / (1 + EVAL_SHARE))
    d_answer = measured[r.global_batch] * BUDGET_S
    assert base.samples == pytest.approx(d_answer)
    assert base.tau == pytest.approx(r.global_batch / (r.peak_lr * r.weight_decay * d_answer))
    other = 256 if r.global_batch != 256 else 128
    at = predict_at(sweep, other)
    d_other = rate(other) / (1 + EVAL_SHARE) * BUDGET_S
    assert at.samples == pytest.approx(d_other)
    assert other / (at.recipe.peak_lr * at.recipe.weight_decay * d_other) == pytest.approx(base.tau)
    assert at.expected.seconds == pytest.approx(at.expected.samples / (rate(other) / (1 + EVAL_SHARE)))


def test_answer_json_says_what_ran_under_a_time_budget(sweep):
    """Finding 8: `epochs` was the cap (500) and nothing said the epochs, steps and warmup that ran."""
    base = answer_to(sweep)
    best = next(t for t in sweep.trials if t.trial_id == base.trial_id)
    out = base.as_json()
    steps = TRAIN_SIZE // out["global_batch"]
    assert out["epochs"] == 500 and out["resolved_epochs"] == int(best.params["resolved_epochs"]) < 500
    assert (out["steps_per_epoch"], out["total_steps"], out["warmup_steps"]) == (
        steps, out["resolved_epochs"] * steps, steps)
    assert out["train_seconds"] == best.last("train_seconds") and out["clock"].startswith("train_seconds")
    assert out["image"] == {"height": 60, "width": 160, "channels": 1, "length": 4, "num_classes": 36}
    assert out["seed"] == 0 and "MultiLabelSoftMarginLoss" in out["loss"]
    assert f"{out['resolved_epochs']} epochs here" in out["schedule"]


def test_diverged_trials_bound_a_predicted_lr_from_above():
    """Finding 9: the cliff's evidence was dropped. A linear world's fit at 8× the answer's batch would put the
    LR past where trials diverged; the prediction stays a factor 2 below the cliff, moved along the slope."""
    from raysweep.answer.fit import ceiling_at

    sweep = world(seed=1)
    base = answer_to(sweep)
    fit = base.lr_fit
    assert fit.ceilings and all(lr / final_best(b) > 5 for b, lr in fit.ceilings)
    forced = dataclasses.replace(base, lr_fit=dataclasses.replace(fit, ceilings=((base.recipe.global_batch,
                                                                                   base.recipe.peak_lr * 1.5),)))
    from raysweep.answer.predict import _lr_at

    lr, notes = _lr_at(forced, base.recipe.global_batch * 4)
    assert lr == pytest.approx(ceiling_at(forced.lr_fit, base.recipe.global_batch * 4, fit.used_exponent))
    assert any("diverged" in n for n in notes)


def test_a_best_lr_at_the_top_of_the_searched_range_is_said_with_the_range_to_search_next():
    """Finding 9: nothing checked that the best LR lies inside the LRs tried. A sweep whose LRs stop below the
    world's best says so in one line, with a range that reaches past it."""
    spec = SPEC.replace("{loguniform: [1.0e-4, 1.0e-2], default: 1.0e-3}",
                        "{loguniform: [1.0e-5, 3.0e-4], default: 1.0e-4}")
    low = world(spec=spec, seed=4)  # its draws span 1e-4 to 1e-2: those below the narrower range's top are kept
    lows = dataclasses.replace(low, trials=[t for t in low.trials if t.number("base_lr") <= 3e-4])
    answer = answer_to(lows)
    edge = answer.lr_fit.edge
    assert edge and "at the top of the LRs tried" in edge and "search.base_lr: {loguniform:" in edge, answer.notes
    assert edge in answer.notes
    top = float(edge.rsplit(", ", 1)[1].rstrip("]}"))
    assert top > 3e-4


def test_a_trial_stopped_at_asha_max_t_below_the_epochs_did_not_run_its_budget():
    """Finding 7: a trial ASHA stopped at max_t below train.epochs counted as `ran`."""
    spec = SPEC.replace("time_budget_s: 20, ", "").replace("epochs: 500", "epochs: 6").replace(
        "{grace_period: 2, reduction_factor: 3, unit: seconds}", "{grace_period: 1, reduction_factor: 2, max_t: 3}")
    record = world(spec=spec, n=12)
    trials = []
    for t in record.trials:  # ASHA's max_t 3: the survivors end at epoch 3 of 6, finished
        if t.status == "failed":
            continue
        history = {k: {e: v for e, v in h.items() if e <= 3} for k, h in t.history.items()}
        trials.append(dataclasses.replace(t, history=history, status="finished" if t.epoch >= 3 else "pruned",
                                          params={**t.params, "resolved_epochs": "6"}))
    answer = answer_to(dataclasses.replace(record, trials=trials))
    assert not answer.ran and answer.predicted
    assert "stopped at tune.asha.max_t" in answer.expected.at and "epoch 3 of 6" in answer.expected.at


def test_a_trial_that_ran_its_seconds_ran_its_budget_though_its_pace_promised_one_epoch_more(sweep):
    """Found by benchmarks/answer_check.py: under a time budget ASHA's max_t is the budget, and a trial whose epochs
    ran slower than its pace estimate crossed it one epoch before its resolved_epochs: it ran its whole budget."""
    base = answer_to(sweep)
    best = next(t for t in sweep.trials if t.trial_id == base.trial_id)
    last = best.last("train_seconds")
    slower = dataclasses.replace(best, params={**best.params, "resolved_epochs": str(best.epoch + 1)}, history={
        **best.history, "train_seconds": {e: v * 20.2 / last for e, v in best.history["train_seconds"].items()}})
    answer = answer_to(dataclasses.replace(sweep, trials=[slower if t is best else t for t in sweep.trials]))
    assert answer.ran and answer.expected.at == "the whole budget"
    cut = dataclasses.replace(slower, history={**slower.history, "train_seconds": {
        e: v * 0.5 for e, v in slower.history["train_seconds"].items()}})
    answer = answer_to(dataclasses.replace(sweep, trials=[cut if t is best else t for t in sweep.trials]))
    assert not answer.ran and "stopped at tune.asha.max_t" in answer.expected.at


def _confirmation(statuses, values, batch=64, lr=1e-3) -> ConfirmationRecord:
    runs = [{"trial_id": f"c{i}", "seed": i + 1, "status": s, "epoch": 6 if s == "finished" else 2, "value": v,
             "time_to_target_s": None, "train_seconds": 20.0, "seconds_to_value": None}
            for i, (s, v) in enumerate(zip(statuses, values))]
    return ConfirmationRecord(f"confirm-{'-'.join(statuses)}", batch, lr, {"value": 0.3}, runs)


def test_a_confirmation_counts_only_its_finished_seeds_and_the_newest_complete_one_is_reported(sweep):
    """Finding 6: the mean took a diverged or interrupted seed's last value, and the newest confirmation was
    reported even when partial."""
    from raysweep.answer.confirmations import miss

    partial = _confirmation(("finished", "failed"), (0.31, 0.9))
    assert not partial.complete and partial.measured("value") == pytest.approx(0.31)
    assert partial.as_dict()["seeds_counted"] == [1]
    base = answer_to(sweep)
    r = base.recipe
    done = dataclasses.replace(_confirmation(("finished", "finished"), (0.30, 0.32)), global_batch=r.global_batch,
                               peak_lr=r.peak_lr)
    newer = dataclasses.replace(partial, global_batch=r.global_batch, peak_lr=r.peak_lr)
    answer = answer_to(dataclasses.replace(sweep, confirmations=[done, newer]))
    assert answer.confirmed is done and answer.confirmed.measured("value") == pytest.approx(0.31)
    assert any("partial" in n and "newest complete" in n for n in answer.notes)
    assert miss(0.33, 0.30, "min") == pytest.approx(0.1) and miss(0.29, 0.30, "min") == 0.0
    assert miss(0.6, 0.8, "max") == pytest.approx(0.25)


def test_confirms_exit_code_gates_on_partial_seeds_and_on_fail_above(capsys):
    """Finding 6: `confirm` exited 0 whatever happened."""
    from raysweep.confirm import verdict

    done = _confirmation(("finished", "finished"), (0.31, 0.33))
    assert verdict(done, 0.30, "min", None) == 0
    assert verdict(done, 0.30, "min", 0.10) == 0 and "passed" in capsys.readouterr().out
    assert verdict(done, 0.30, "min", 0.05) == 1 and "misses the expected value by 6.7%" in capsys.readouterr().out
    assert verdict(_confirmation(("finished", "failed"), (0.3, 0.9)), 0.30, "min", None) == 1
    assert verdict(None, 0.30, "min", None) == 1


def test_an_answer_without_a_fit_leaves_no_earlier_fit_in_mlflow(tmp_path):
    """Finding 11: a later answer with no fit left the previous answer.lr_exponent* in place."""
    import mlflow

    from raysweep.tracking.published import log_answer

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri)
    # the experiment's artifacts in tmp_path: a SQLite store's default artifact root is ./mlruns, the repository
    run = client.create_run(client.create_experiment("w", str(tmp_path / "artifacts"))).info.run_id
    sweep = world()
    fitted = answer_to(sweep)
    assert fitted.lr_fit.fitted
    log_answer(uri, run, fitted)
    assert client.get_run(run).data.metrics["answer.lr_exponent"] == pytest.approx(fitted.lr_fit.exponent)
    few = dataclasses.replace(sweep, trials=[t for t in sweep.trials if t.status != "pruned"][:5])
    unfitted = answer_to(few)
    assert not unfitted.lr_fit.fitted
    log_answer(uri, run, unfitted)
    metrics = client.get_run(run).data.metrics
    assert math.isnan(metrics["answer.lr_exponent"]) and math.isnan(metrics["answer.confirmed_value"])
    assert metrics["answer.peak_lr"] == pytest.approx(unfitted.recipe.peak_lr)


def _fitted_world():
    """The world's answer with its check forced to choose the fit, and the sweep's sampled LR at the answer's batch
    2.5× below the fit's bottom: what the grid side by side found (the best trial's LR 3.9× off the grid's best)."""
    from raysweep.answer.recipe import fitted_recipe

    sweep = world()
    base = answer_to(sweep)
    fit = base.lr_fit
    check = dataclasses.replace(fit.check, used="fit", exponent=fit.exponent)
    fit = dataclasses.replace(fit, check=check)
    r = dataclasses.replace(base.recipe, peak_lr=fit.optimum(base.recipe.global_batch) / 2.5)
    return sweep, dataclasses.replace(base, recipe=r, lr_fit=fit, better=fitted_recipe(r, fit, base.tau, base.samples))


def test_where_the_checked_fit_puts_the_best_lr_elsewhere_a_better_recipe_is_predicted_and_how_to_measure_it():
    """Deliverable 5: the answer was never better than its best trial although the sweep held the evidence."""
    from raysweep.answer.recipe import fitted_answer, fitted_recipe, kept

    sweep, base = _fitted_world()
    b, r, fit = base.better, base.recipe, base.lr_fit
    assert b.global_batch == r.global_batch and b.peak_lr == pytest.approx(fit.optimum(r.global_batch))
    assert b.global_batch / (b.peak_lr * b.weight_decay * base.samples) == pytest.approx(base.tau)  # τ kept
    said = kept(sweep, base)
    assert said.recipe == r and any("a better recipe is predicted" in n and "w.yaml --fitted" in n for n in said.notes)
    assert said.as_json()["better"]["peak_lr"] == pytest.approx(b.peak_lr)
    fitted = fitted_answer(said)
    assert fitted.recipe == b and fitted.predicted and fitted.confirm_command.endswith("--fitted")
    # within √2 of the answer's LR, or unchecked: nothing better is claimed
    assert fitted_recipe(dataclasses.replace(r, peak_lr=b.peak_lr * 1.3), fit, base.tau, base.samples) is None
    # the slope unchecked: the bowl's own bottom at the answer's batch places the LR, and with none there nothing
    unchecked = dataclasses.replace(fit, check=dataclasses.replace(fit.check, used="sqrt"))
    assert fitted_recipe(r, dataclasses.replace(unchecked, bottoms=()), base.tau, base.samples) is None
    bottom = dataclasses.replace(unchecked, bottoms=((r.global_batch, r.peak_lr * 2),))
    assert fitted_recipe(r, bottom, base.tau, base.samples).peak_lr == pytest.approx(r.peak_lr * 2)


def test_where_the_fits_slope_lost_the_check_the_bowls_bottom_at_the_answers_batch_predicts_a_better_recipe():
    """Seen in benchmarks/answer_check.py (2026-12-02): the slope did not survive the check, so no better recipe was
    predicted, and the answer's sampled LR, 1.47× below its batch's best, missed the 5 % goal and set every
    prediction off by as much. At the answer's own batch no slope is needed: the check's own measure of each batch's
    best LR (the sweep's bowl with a bottom per batch) places it. In this world the best trial's LR is 1.64× the
    final best at its batch, and that bottom within 5 % of it."""
    from raysweep.answer.recipe import fitted_answer, kept

    sweep = world(seed=18)
    answer = answer_to(sweep)
    r, fit = answer.recipe, answer.lr_fit
    truth = final_best(r.global_batch)
    assert fit.check is not None and fit.check.used != "fit", fit.check
    assert r.peak_lr / truth > 1.6
    assert answer.better is not None and answer.better_source == FROM_BOTTOM
    assert answer.better.peak_lr == pytest.approx(dict(fit.bottoms)[r.global_batch])
    assert abs(math.log(answer.better.peak_lr / truth)) < math.log(1.05)
    assert any(n.startswith(f"{FROM_BOTTOM} puts the best peak LR at global batch {r.global_batch}") and
               "a better recipe is predicted" in n for n in kept(sweep, answer).notes)
    assert answer.as_json()["better"]["source"] == FROM_BOTTOM
    assert fitted_answer(answer).recipe == answer.better


def test_the_fitted_recipe_becomes_the_answer_only_where_it_measured_better_on_the_same_seeds():
    from raysweep.answer.recipe import kept

    sweep, base = _fitted_world()
    b, r = base.better, base.recipe
    ours = dataclasses.replace(_confirmation(("finished", "finished"), (0.30, 0.32)), global_batch=r.global_batch,
                               peak_lr=r.peak_lr)
    for values, wins in (((0.27, 0.29), True), ((0.33, 0.35), False)):
        theirs = dataclasses.replace(_confirmation(("finished", "finished"), values), global_batch=b.global_batch,
                                     peak_lr=b.peak_lr, parent_run_id="fitted")
        answer = kept(dataclasses.replace(sweep, confirmations=[ours, theirs]),
                      dataclasses.replace(base, confirmed=ours))
        if wins:
            assert answer.recipe == b and answer.ran and answer.trial_id is None and answer.confirmed is theirs
            assert answer.expected.value == pytest.approx(0.28)
            assert "measured val_loss 0.28 against the best trial's recipe's 0.31 (9.7% better)" in answer.notes[-1]
        else:
            assert answer.recipe == r and answer.better is None
            assert "(9.7% worse): the best trial's recipe is kept" in answer.notes[-1]


def test_a_batch_whose_own_trials_make_an_almost_flat_bowl_does_not_crash_the_answer():
    """Found writing the tests/test_confirm_fitted.py world: in this 36-trial sweep the check's bowl through one
    batch's own trials is almost flat, its bottom past any float (OverflowError: math range error, from answer_of:
    the report, `answer` and `confirm` all crashed). Such a bottom lies outside the LRs tried: the best trial's LR."""
    answer = answer_to(world(n=36, seed=7))
    assert answer is not None and answer.lr_fit.check is not None and answer.lr_fit.fitted
    flat = dataclasses.replace(answer.lr_fit, coef=(-1.0, 1e-300, 0.0))  # the whole fit's bowl as flat: no crash
    assert math.isfinite(flat.optimum(64)) and flat.optimum(64) > flat.lr_range[1]


def test_where_neither_rule_is_the_worlds_the_prediction_for_a_left_out_batch_beats_both_rules():
    """benchmarks/answer_check.py's clause "closer than both trivial predictors" can hold only where neither rule is
    the truth: on its CPU grid the square-root rule was (the check chose it, and the prediction, that rule, was 1.04×
    and 1.085× off). In worlds whose best LR grows past √B the check uses the fit, and its prediction for the batch
    the sweep left out (256, from sweeps over 32 to 128) lies closer than both rules: B^1 in 34 of 40 sweeps, B^0.8
    in 24 (benchmarks/fit_worlds.py, which also counts the worlds where it cannot). A check that always chose a rule
    would meet it in none."""
    for exponent, least in ((1.0, 0.75), (0.8, 0.5)):
        rows = [left_out_clauses(exponent, seed) for seed in range(40)]
        assert sum(r["beats_rules"] for r in rows) >= least * len(rows), (exponent, rows)
        assert sum(r["fit_used"] for r in rows) >= least * len(rows), exponent
