"""The sweep's one answer (raysweep/answer/), from records made by hand where the truth is known: it is the best
trial's recipe and never contradicts the trials; the LR fit recovers the exponent that made the data and says which
rule it supports; a batch the sweep did not run gets a predicted recipe whose numbers add up."""

from __future__ import annotations

import math

import numpy as np
import pytest

from raysweep.metrics import RunRecord, SweepRecord, run_ending

SPEC = """name: t
scaling: {num_workers: 2, use_gpu: false, cpus_per_worker: 1}
train: {epochs: 6, reference_batch_size: 64, lr_rule: sqrt, min_lr: 1.0e-6}
search:
  per_gpu_batch_size: {choice: [16, 32, 64, 128], default: 32}
  base_lr: {loguniform: [1.0e-4, 1.0e-2], default: 1.0e-3}
  warmup_epochs: 1
  weight_decay: {loguniform: [1.0e-5, 1.0e-2], default: 1.0e-4}
tune:
  num_samples: 32
  metric: val_loss
  asha: {grace_period: 2, reduction_factor: 2}
"""
TRAIN_SIZE = 4096


def best_lr(batch: float, exponent: float) -> float:
    """Where the made-up world's loss is lowest at a global batch: 1e-3 at 64, growing as B^exponent."""
    return 1e-3 * (batch / 64) ** exponent


def _loss(batch, lr, exponent, epoch, noise):
    """The made-up world: a bowl in log LR around best_lr, a batch effect, better with epochs."""
    return (0.2 + 0.08 * (math.log(lr) - math.log(best_lr(batch, exponent))) ** 2 + 0.01 * math.log2(batch / 32)
            + 0.3 / epoch + noise)


def _trial(i, per_gpu, base_lr, wd, epochs, exponent, rng, status=None, rate=None):
    global_batch = 2 * per_gpu
    peak = base_lr * (global_batch / 64) ** 0.5
    noise = 0.004 * rng.standard_normal()
    rate = rate or 100.0 * global_batch ** 0.5
    steps = TRAIN_SIZE // global_batch
    history = {"epoch": {}, "val_loss": {}, "train_seconds": {}, "samples_seen": {}, "samples_per_s": {},
               "grad_noise_scale": {}}
    for e in range(1, epochs + 1):
        history["epoch"][e] = float(e)
        history["val_loss"][e] = _loss(global_batch, peak, exponent, e, noise)
        history["samples_seen"][e] = float(e * steps * global_batch)
        history["train_seconds"][e] = e * steps * global_batch / rate
        history["samples_per_s"][e] = rate
        history["grad_noise_scale"][e] = 500.0
    params = {"per_gpu_batch_size": str(per_gpu), "world_size": "2", "grad_accum_steps": "1",
              "global_batch_size": str(global_batch), "base_lr": str(base_lr), "peak_lr": str(peak),
              "lr_rule": "sqrt", "reference_batch_size": "64", "warmup_epochs": "1.0", "weight_decay": str(wd),
              "train_size": str(TRAIN_SIZE), "resolved_epochs": "6"}
    status = status or ("finished" if epochs == 6 else "pruned")
    tags = {"trial_id": f"t{i}", **run_ending(status, epochs, "diverged" if status == "failed" else None,
                                              "loss is nan" if status == "failed" else None).tags}
    return RunRecord(f"run{i}", f"t{i}", status, params, history, tags, 10.0, i == 0)


def _sweep(exponent=0.5, n=32, seed=0, batches=(16, 32, 64, 128)) -> SweepRecord:
    """n trials of random batch, LR and decay; the better half at epoch 2 go on to 4, the better half of those to 6
    (as ASHA would)."""
    rng = np.random.default_rng(seed)
    draws = [(int(rng.choice(batches)), float(np.exp(rng.uniform(math.log(1e-4), math.log(1e-2)))),
              float(np.exp(rng.uniform(math.log(1e-5), math.log(1e-2))))) for _ in range(n)]
    draws[0] = (32, 1e-3, 1e-4)  # the baseline
    at_two = sorted(range(n), key=lambda i: _loss(2 * draws[i][0], draws[i][1] * (draws[i][0] / 32) ** 0.5,
                                                  exponent, 2, 0))
    epochs = {i: 2 for i in range(n)}
    for i in at_two[: n // 2]:
        epochs[i] = 4
    for i in at_two[: n // 4]:
        epochs[i] = 6
    trials = [_trial(i, *draws[i], epochs[i], exponent, rng) for i in range(n)]
    return SweepRecord("sqlite:///mlflow.db", "t", "1", "parent", "t 2026-11-26", "val_loss", "min", SPEC, trials)


def _answer(record, spec_file=None):
    """The sweep's answer as `tune` and `report` make it (with the noise scale's advice)."""
    from raysweep.answer import answer_of
    from raysweep.report import recommendation

    return answer_of(record, spec_file, recommendation(record))


def _predict(record, batch, spec_file=None):
    from raysweep.answer import predict
    from raysweep.report import recommendation

    return predict(record, batch, spec_file, recommendation(record))


def test_the_answer_is_the_sweeps_best_trial_with_its_whole_recipe_and_what_it_expects():
    from raysweep.optim import scaled_lr
    from raysweep.report import ranked

    record = _sweep()
    answer = _answer(record, "spec.yaml")
    best = ranked(record)[0]
    r = answer.recipe
    assert answer.trial_id == best.trial_id and answer.ran and not answer.predicted
    assert r.global_batch == r.per_gpu_batch_size * r.num_workers * r.grad_accum_steps == int(
        best.params["global_batch_size"])
    assert r.peak_lr == pytest.approx(scaled_lr(r.base_lr, r.global_batch, r.reference_batch_size, r.lr_rule))
    assert (r.warmup_epochs, r.weight_decay) == (1.0, float(best.params["weight_decay"]))
    assert answer.expected.value == best.last("val_loss") and "trial " + best.trial_id in answer.expected.source
    assert "cosine to 1e-06 by the end of 6 epochs" in r.schedule
    assert answer.confirm_command == "python -m raysweep confirm spec.yaml"
    roles = [row["role"] for row in answer.trials]
    assert roles[0] == "the answer" and set(roles) <= {"the answer", "same global batch", "best of its global batch"}
    keys = ("global_batch", "per_gpu_batch_size", "num_workers", "grad_accum_steps", "peak_lr", "base_lr",
            "warmup_epochs", "weight_decay", "ran", "predicted", "lr_fit", "confirmed")
    assert tuple(answer.as_json())[:len(keys)] == keys
    assert answer.params()["answer.global_batch"] == str(r.global_batch)
    assert answer.metrics()["answer.peak_lr"] == r.peak_lr


def test_a_best_trial_that_did_not_run_its_budget_is_marked_predicted():
    import dataclasses


    record = _sweep()
    only_pruned = dataclasses.replace(record, trials=[t for t in record.trials if t.status == "pruned"])
    answer = _answer(only_pruned)
    assert answer.predicted and not answer.ran and answer.notes and "did not run its whole budget" in answer.notes[0]
    assert _answer(dataclasses.replace(record, trials=[])) is None


@pytest.mark.parametrize("exponent, rule", [(0.5, "sqrt"), (1.0, "linear")])
def test_the_lr_fit_finds_the_exponent_that_made_the_trials_and_the_rule_it_supports(exponent, rule):

    fit = _answer(_sweep(exponent=exponent, n=40)).lr_fit
    assert fit.supports == rule, (fit.exponent, fit.interval, fit.reason)
    low, high = fit.interval
    assert low <= exponent <= high and abs(fit.exponent - exponent) < 0.25
    assert fit.budget == ("ASHA's rungs at epochs 2, 4 and the end of each trial that ran its whole budget"
                          ) and fit.trials == 40
    assert fit.batches == (32, 64, 128, 256)
    # the fitted best LR at a batch is the world's (B_noise 500 is past every batch here)
    assert fit.optimum(64) == pytest.approx(best_lr(64, exponent), rel=0.3)


def test_noisy_trials_widen_the_interval_until_it_cannot_tell_the_rules_apart():
    """The same world with trial-to-trial noise as large as the bowl's depth over a decade of LR: 16 trials no longer
    tell the rules apart, and the fit says so instead of naming one."""

    record = _sweep(exponent=0.5, n=16, seed=3)
    rng = np.random.default_rng(1)
    for t in record.trials:
        shift = 0.08 * rng.standard_normal()
        t.history["val_loss"].update({e: v + shift for e, v in t.history["val_loss"].items()})
    fit = _answer(record).lr_fit
    assert fit.supports == "inconclusive" and len(fit.consistent) >= 2, (fit.interval, fit.consistent)
    assert fit.interval[1] - fit.interval[0] > 0.5


def test_a_sweep_that_cannot_fit_says_why_and_predicts_by_the_square_root_rule():

    few = _sweep(n=6)
    fit = _answer(few).lr_fit
    assert fit.supports == "undetermined" and fit.exponent is None and "the fit needs 8" in fit.reason
    one_batch = _sweep(n=24, batches=(32,))
    assert "1 global batch" in _answer(one_batch).lr_fit.reason
    base = _answer(few)
    at = _predict(few, 4 * base.recipe.global_batch)
    assert at.recipe.peak_lr == pytest.approx(base.recipe.peak_lr * 2)  # √4: AdamW's square-root rule
    assert "square-root rule" in at.notes[0]


def test_a_predicted_batch_gets_a_recipe_whose_numbers_add_up():
    from raysweep.answer import throughput_at
    from raysweep.errors import UserError
    from raysweep.optim import scaled_lr

    record = _sweep(n=40)
    base = _answer(record, "spec.yaml")
    at = _predict(record, 512, "spec.yaml")
    r = at.recipe
    assert at.predicted and not at.ran and at.trial_id is None
    assert (r.global_batch, r.per_gpu_batch_size, r.num_workers, r.grad_accum_steps) == (512, 256, 2, 1)
    # anchored at the answer: its LR moved along the exponent the check chose (B_noise 500 is past 256, so 512
    # is held at B_noise's)
    used = base.lr_fit.check.used
    assert used in ("fit", "sqrt"), base.lr_fit.check  # the world's exponent is ½: keeping the LR loses the check
    exponent = base.lr_fit.used_exponent
    assert r.peak_lr == pytest.approx(base.recipe.peak_lr * (500 / base.recipe.global_batch) ** exponent)
    assert scaled_lr(r.base_lr, 512, r.reference_batch_size, r.lr_rule) == pytest.approx(r.peak_lr)
    # weight decay keeps the answer's AdamW timescale τ = B / (η λ D): D, 6 epochs of whole steps at 512
    samples = 6 * (TRAIN_SIZE // 512) * 512
    assert 512 / (r.peak_lr * r.weight_decay * samples) == pytest.approx(base.tau)
    # the answer's value after E(B) = E_min (1 + B / B_noise) more samples, at 512's throughput (extrapolated flat
    # past the largest measured batch, 256)
    answer_trial = next(t for t in record.trials if t.trial_id == base.trial_id)
    ratio = (1 + 512 / 500) / (1 + base.recipe.global_batch / 500)
    assert at.expected.samples == pytest.approx(answer_trial.last("samples_seen") * ratio)
    rates = {int(t.params["global_batch_size"]): t.last("samples_per_s") for t in record.trials}
    assert at.expected.seconds == pytest.approx(at.expected.samples / throughput_at(512, rates))
    assert any("past B_noise" in n for n in at.notes)
    # the note's arithmetic is the LR's: 512 held at B_noise (it said "× (512/256)^α", a factor it did not apply)
    assert at.notes[0].startswith(f"peak LR {r.peak_lr:.2e} = the answer's {base.recipe.peak_lr:.2e} × "
                                  f"(500/{base.recipe.global_batch})^{exponent:.2f}, each batch held at B_noise ≈ "
                                  f"500 at most, from "), at.notes[0]
    assert at.confirm_command == "python -m raysweep confirm spec.yaml --batch 512"
    with pytest.raises(UserError, match=r"--batch 513: .* a multiple of 2; the nearest are 512 and 514"):
        _predict(record, 513)


def test_throughput_between_measured_batches_is_interpolated_in_log_log():
    from raysweep.answer import throughput_at

    rates = {64: 100.0, 256: 400.0}
    assert throughput_at(128, rates) == pytest.approx(200.0)
    assert throughput_at(64, rates) == 100.0 and throughput_at(1024, rates) == 400.0
    assert throughput_at(8, rates) == 100.0 and throughput_at(8, {}) is None


def test_seconds_to_a_value_are_interpolated_between_the_epochs_around_it():
    from raysweep.metrics import seconds_to_value

    history = {"train_seconds": {1: 10.0, 2: 20.0, 3: 30.0}, "val_loss": {1: 0.5, 2: 0.3, 3: 0.2}}
    assert seconds_to_value(history, "val_loss", 0.4, "min") == pytest.approx(15.0)
    assert seconds_to_value(history, "val_loss", 0.6, "min") == 10.0
    assert seconds_to_value(history, "val_loss", 0.1, "min") is None


def test_the_report_writes_answer_json_and_shows_the_answer_first(tmp_path, capsys):
    import json

    from raysweep import console, report
    from raysweep.answer import console as answer_console

    record = _sweep(n=40)
    built, _ = report.build(record, tmp_path / "report", spec_args="search_spaces/x.yaml --set train.epochs=6")
    answer = json.loads((tmp_path / "report" / "answer.json").read_text())
    assert answer["global_batch"] == built.answer.recipe.global_batch and answer["ran"] is True
    assert answer["confirm_command"] == "python -m raysweep confirm search_spaces/x.yaml --set train.epochs=6"
    assert answer["lr_fit"]["supports"] == "sqrt" and answer["confirmed"] is None
    page = (tmp_path / "report" / "report.html").read_text()
    assert page.index("id='answer'") < page.index('id="summary"')  # the answer first, the trials after it
    assert "Fastest" not in page and "fastest" not in page  # the batch table is evidence, not a second answer
    assert built.answer.recipe.warmup_epochs == 1 and "<b>1</b> epoch<" in page  # it said "1 epochs"
    console.print_report(built)
    answer_console.print_answer(built.answer)
    out = capsys.readouterr().out
    assert "<- fastest" not in out
    last = out[out.rindex("\nanswer (ran): "):]
    assert f"global batch {built.answer.recipe.global_batch} = per-GPU" in last
    assert "supports the sqrt rule" in last and "confirm:  python -m raysweep confirm search_spaces/x.yaml" in last


def test_where_the_batches_disagree_the_rules_tie_exactly_and_the_square_root_rule_is_kept():
    """Two of benchmarks/answer_check.py's 16-trial sweeps ended with the check's two rules at exactly the same mean
    error (0.5264, and 0.5211 in one whose store was read back). Not chance: that store's best trials had 4.19e-3 at
    batch 32, 1.65e-3 at 64, 3.13e-3 at 128 (these trials'), so 32 says the LR falls with the batch and 64 → 128 says
    it rises faster than √B.
    Predicting 32 and 64 from 128 and 128 from 64, the mean |ln error| at an exponent α is
    (y + 2α·ln 2 + 2·|x − α·ln 2|) / 3, x = ln(lr128 / lr64), y = ln(lr32 / lr128): flat, (y + 2x) / 3, for every α
    in [0, x / ln 2], so keeping the LR (α = 0) and the square-root rule (½) tie. The tie keeps the prior."""
    best = {128: 3.135e-3, 64: 1.645e-3, 32: 4.188e-3}
    rng = np.random.default_rng(0)
    trials = []
    for i, (batch, lr, value) in enumerate([(128, best[128], 0.1338), (64, best[64], 0.1531), (32, best[32], 0.1600),
                                            (64, 3.13e-3, 0.1696), (32, 1.63e-3, 0.1841), (128, 6.37e-4, 0.2255)]):
        t = _trial(i, batch // 2, lr / (batch / 64) ** 0.5, 1e-4, 6, 0.5, rng)
        t.history["val_loss"] = {e: value + 0.01 * (6 - e) for e in range(1, 7)}
        trials.append(t)
    record = SweepRecord("sqlite:///mlflow.db", "t", "1", "parent", "t 2026-11-28", "val_loss", "min", SPEC, trials)
    check = _answer(record).lr_fit.check
    x, y = math.log(best[128] / best[64]), math.log(best[32] / best[128])
    assert check.batches == (32, 64, 128)
    flat = (y + 2 * x) / 3
    assert check.errors["none"] == pytest.approx(flat) and check.errors["sqrt"] == pytest.approx(flat)
    assert (check.used, check.exponent) == ("sqrt", 0.5)


def test_answer_and_confirm_without_a_sweep_are_one_line_naming_the_spec(tmp_path, capsys):
    """No store yet, or a store without a `tune` of this spec's experiment: one line, exit 2, before Ray."""
    from raysweep.cli import main

    from conftest import tiny_spec, write_spec

    path = write_spec(tmp_path, tiny_spec(tmp_path))
    for command in (["answer", str(path)], ["answer", str(path), "--batch", "64"], ["confirm", str(path)]):
        assert main(command) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"raysweep: error: {path}: no MLflow store at "), err
    other = tmp_path / "elsewhere" / "mlflow.db"  # run from another folder: the store named, as report takes it
    for command in (["answer", str(path)], ["confirm", str(path)]):
        assert main([*command, "--tracking-uri", f"sqlite:///{other}"]) == 2
        assert f"no MLflow store at {other}" in capsys.readouterr().err
    for command in ("answer", "confirm"):  # --fitted is the answer's own batch: with --batch, one line, before Ray
        assert main([command, str(path), "--fitted", "--batch", "64"]) == 2
        assert "--fitted with --batch 64: --fitted is the answer's own batch" in capsys.readouterr().err
    assert main(["confirm", str(path), "--fail-above", "-1"]) == 2
    assert "--fail-above -1.0: expected a percentage of 0 or more" in capsys.readouterr().err
    assert main(["confirm", str(path), "--seeds", "1,x"]) == 2
    assert "--seeds '1,x': expected whole numbers" in capsys.readouterr().err
    assert not (tmp_path / "mlflow.db").exists()


def test_a_tie_computed_in_floating_point_still_keeps_the_square_root_rule():
    """Found by benchmarks/answer_check.py (64 trials, sweep seed 1): the rules tied, as they do where the batches
    disagree, but the means came out 0.4009652060457005 (√) and 0.40096520604570046 (keep), so the check kept the
    LR against its own rule that a tie keeps the square-root rule."""
    from raysweep.answer.fit import chosen

    assert chosen({"sqrt": 0.4009652060457005, "none": 0.40096520604570046}) == "sqrt"
    assert chosen({"sqrt": 0.4009652060457005, "none": 0.40096520604570046, "fit": 0.4009652060457004}) == "sqrt"
    assert chosen({"sqrt": 0.41, "none": 0.40, "fit": 0.39}) == "fit"
    assert chosen({"sqrt": 0.41, "none": 0.40}) == "none"


def test_a_fit_whose_leave_one_out_refits_find_no_minimum_says_it_was_not_checked():
    """Found by benchmarks/answer_check.py (32 trials): the sweep's fit had a minimum (B^1.15), but without one batch
    the others' refit had none, so the check compared the two rules alone and the answer's lines named only them: a
    user saw a fitted exponent and predictions by the square-root rule, and nothing said why. Here batches 32 and 128,
    and the baseline's one trial at 64: leaving 32 or 128 out leaves too little to place a slope."""
    from raysweep.answer.console import used_words

    fit = _answer(_sweep(exponent=0.5, n=40, batches=(16, 64))).lr_fit
    assert fit.fitted and fit.batches == (32, 64, 128), fit.reason
    assert fit.check.used in ("sqrt", "none") and "fit" not in fit.check.errors
    assert fit.check.unfitted == (32, 128) and fit.check.as_dict()["fit_unchecked_without"] == [32, 128]
    assert used_words(fit).endswith(f"; the fit's own B^{fit.exponent:.2f} not checked: without batch 32 or 128 the "
                                    "others' fit has no minimum)"), used_words(fit)
    # a fit that was checked names no batch
    checked = _answer(_sweep(exponent=0.5, n=40)).lr_fit
    assert "fit" in checked.check.errors and checked.check.unfitted == () and "not checked" not in used_words(checked)


def test_a_batch_that_is_not_positive_or_larger_than_the_training_set_is_refused_in_one_line_before_a_recipe():
    """`answer --batch 0` said "the nearest are 2 and 2" (0 is a multiple of 2), -4 "2 and -2"; a batch larger than
    the training set got a whole recipe, weight decay and expected time included, for a run that cannot take one step
    (and `confirm --batch` then refused it naming search.per_gpu_batch_size, a key the user never set)."""
    from raysweep.errors import UserError

    record = _sweep(n=40)
    own = _answer(record).recipe.global_batch
    for batch in (0, -4):
        with pytest.raises(UserError, match=rf"^--batch {batch}: expected a positive global batch \(per-GPU batch × "
                                            rf"2 workers × 1 accumulation steps\), such as the answer's {own}$"):
            _predict(record, batch)
    # 4096 images over 2 workers: 2048 a rank, so 4096 is the largest global batch with a whole step an epoch
    assert _predict(record, TRAIN_SIZE).recipe.global_batch == TRAIN_SIZE
    with pytest.raises(UserError, match=r"^--batch 4098: more than the training set holds for one step \(4,096 "
                                        r"images over 2 workers: 2,048 each\); the largest global batch this data "
                                        r"runs is 4,096: ask for that or less, or train on more images$"):
        _predict(record, TRAIN_SIZE + 2)


def test_the_commands_an_answer_prints_name_the_store_with_the_flag_answer_confirm_and_report_take(tmp_path):
    """`answer SPEC --tracking-uri X` from another folder printed `confirm SPEC --set mlflow.tracking_uri=X`: it
    worked, but not as the flag the user had typed, which confirm and report take too."""
    import shlex

    from raysweep.answer.recipe import confirm_command
    from raysweep.cli import build_parser, main
    from raysweep.config import load_config

    from conftest import tiny_spec, write_spec

    path = write_spec(tmp_path, tiny_spec(tmp_path, mlflow={"tracking_uri": None}))
    store = f"sqlite:///{tmp_path / 'elsewhere' / 'my store.db'}"
    config = load_config(path, ["train.epochs=2", f"mlflow.tracking_uri={store}"])
    assert config.command_args == f"{path} --set train.epochs=2 --tracking-uri '{store}'"
    printed = confirm_command(config.command_args, 64)
    assert printed == f"python -m raysweep confirm {path} --set train.epochs=2 --tracking-uri '{store}' --batch 64"
    # the printed command is one each command parses back to the same store
    for command, words in (("confirm", printed.split(" confirm ", 1)[1]), ("answer", printed.split(" confirm ", 1)[1]),
                           ("report", config.command_args)):  # report: `raysweep report <command_args>`
        args = build_parser().parse_args([command, *shlex.split(words)])
        assert args.tracking_uri == store and args.overrides == ["train.epochs=2"]
    assert main(["answer", *shlex.split(config.command_args)]) == 2  # no store there yet: one line, before Ray
