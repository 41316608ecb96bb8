import subprocess
import sys

import pytest

from raysweep.config import load_config
from raysweep.errors import UserError

from conftest import ROOT, tiny_spec, write_spec


def _error(tmp_path, text: str, overrides=()) -> str:
    with pytest.raises(UserError) as e:
        load_config(write_spec(tmp_path, text), list(overrides))
    message = str(e.value)
    assert "\n" not in message  # one line
    return message


@pytest.mark.parametrize("path", sorted((ROOT / "search_spaces").glob("*.yaml")), ids=lambda p: p.name)
def test_every_spec_in_search_spaces_loads(path):
    config = load_config(path)
    assert config.trials.searched(), "a sweep spec searches at least one knob"


def test_defaults_match_design(tmp_path):
    config = load_config(write_spec(tmp_path, "name: defaults\n"))
    assert config.data.charset == "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    assert (config.data.length, config.data.width, config.data.height) == (4, 160, 60)
    assert config.train.lr_rule == "sqrt" and config.train.reference_batch_size == 256
    assert config.train.grad_clip == 1.0 and config.tune.metric == "val_loss"


def test_a_spec_without_a_name_is_named_after_its_file_not_the_quickstart(tmp_path):
    """Its experiment and results folder were `quickstart`'s, mixing its trials with the quickstart's."""
    (tmp_path / "my sweep.v2.yaml").write_text("train: {epochs: 2}\n")
    assert load_config(tmp_path / "my sweep.v2.yaml").name == "my-sweep.v2"
    (tmp_path / "named.yaml").write_text("name: kept\n")
    assert load_config(tmp_path / "named.yaml").name == "kept"


def test_unknown_key_suggests_closest(tmp_path):
    msg = _error(tmp_path, "search:\n  warmup_epoch: 2\n")
    assert msg.startswith(f"{tmp_path / 'spec.yaml'}: search.warmup_epoch: unknown key 'warmup_epoch'")
    assert "did you mean 'warmup_epochs'?" in msg


def test_unknown_key_inside_a_distribution(tmp_path):
    msg = _error(tmp_path, "search:\n  per_gpu_batch_size: {choice: [16, 32], defualt: 16}\n")
    assert "search.per_gpu_batch_size.choice.defualt" in msg or "search.per_gpu_batch_size.defualt" in msg
    assert "did you mean 'default'?" in msg


def test_wrong_type_names_key_and_value(tmp_path):
    msg = _error(tmp_path, "scaling:\n  num_workers: two\n")
    assert "scaling.num_workers" in msg and "'two'" in msg


def test_bool_is_not_a_number(tmp_path):
    assert "expected a number, got True" in _error(tmp_path, "train:\n  min_lr: true\n")


def test_yaml_1e_minus_4_reads_as_a_number(tmp_path):
    config = load_config(write_spec(tmp_path, "search:\n  base_lr: {loguniform: [1e-4, 3e-3], default: 1e-3}\n"))
    assert config.search.base_lr.loguniform == (1e-4, 3e-3)
    assert load_config(write_spec(tmp_path, ""), ["train.min_lr=1e-7"]).train.min_lr == 1e-7


def test_quoted_1e_minus_4_is_rejected_with_the_fix(tmp_path):
    msg = _error(tmp_path, 'search:\n  base_lr: {loguniform: ["1e-4", 3.0e-3]}\n')
    assert "search.base_lr.loguniform[0]: expected a number, got '1e-4' (write it unquoted, e.g. 0.0001)" in msg


@pytest.mark.parametrize("text, key", [
    ("search:\n  base_lr: 0\n", "search.base_lr"),
    ("search:\n  base_lr: -1.0e-3\n", "search.base_lr"),
    ("search:\n  per_gpu_batch_size: 0\n", "search.per_gpu_batch_size"),
    ("search:\n  per_gpu_batch_size: {choice: [32, -64]}\n", "search.per_gpu_batch_size.choice[1]"),
    ("scaling:\n  num_workers: 0\n", "scaling.num_workers"),
    ("search:\n  base_lr: {loguniform: [0.0, 1.0e-3]}\n", "search.base_lr.loguniform[0]"),
])
def test_non_positive_lr_batch_workers(tmp_path, text, key):
    msg = _error(tmp_path, text)
    assert f"{key}: must be above 0" in msg


def test_loguniform_low_not_below_high(tmp_path):
    msg = _error(tmp_path, "search:\n  base_lr: {loguniform: [3.0e-3, 1.0e-4]}\n")
    assert "search.base_lr" in msg and "low 0.003 must be below high 0.0001" in msg


def test_distribution_not_allowed_for_knob(tmp_path):
    msg = _error(tmp_path, "search:\n  per_gpu_batch_size: {loguniform: [16, 64]}\n")
    assert "search.per_gpu_batch_size: 'loguniform' is not allowed here" in msg


def test_missing_spec_file(tmp_path):
    with pytest.raises(UserError, match=r"nope\.yaml: no such spec file"):
        load_config(tmp_path / "nope.yaml")


def test_missing_data_folder(tmp_path):
    msg = _error(tmp_path, f"data:\n  train_dir: {tmp_path / 'missing'}\n")
    assert "data.train_dir: no such folder" in msg and "missing" in msg


def test_grace_shorter_than_warmup_is_refused_unless_allowed(tmp_path):
    text = "search:\n  warmup_epochs: {randint: [0, 3]}\ntune:\n  asha: {grace_period: 2}\n"
    expected = "tune.asha.grace_period: 2 is shorter than the largest warmup_epochs in the search (3)"
    assert expected in _error(tmp_path, text)
    config = load_config(write_spec(tmp_path, text), ["tune.asha.allow_grace_within_warmup=true"])
    assert config.tune.asha.grace_period == 2


def test_unknown_metric(tmp_path):
    assert "did you mean 'val_exact_acc'?" in _error(tmp_path, "tune:\n  metric: val_exact\n")


@pytest.mark.parametrize("metric,mode", [("val_loss", "min"), ("train_loss", "min"), ("val_exact_acc", "max"),
                                         ("val_char_acc", "max")])
def test_mode_follows_the_metric_and_a_contrary_one_is_refused(tmp_path, metric, mode):
    assert load_config(write_spec(tmp_path, f"tune:\n  metric: {metric}\n")).tune.mode == mode  # left out: inferred
    assert load_config(write_spec(tmp_path, f"tune:\n  metric: {metric}\n  mode: {mode}\n")).tune.mode == mode
    contrary = "max" if mode == "min" else "min"
    with pytest.raises(UserError, match=rf"tune: mode '{contrary}' with metric '{metric}', where .* is better: ASHA "
                                        rf"would keep the worst trials; set mode: {mode}"):
        load_config(write_spec(tmp_path, f"tune:\n  metric: {metric}\n  mode: {contrary}\n"))


def test_set_override_parses_yaml(tmp_path):
    path = write_spec(tmp_path, "")
    config = load_config(path, ["search.per_gpu_batch_size={choice: [32, 64]}", "train.epochs=2"])
    assert config.search.per_gpu_batch_size.choice == [32, 64] and config.train.epochs == 2


def test_set_override_error_names_the_override(tmp_path):
    msg = _error(tmp_path, "", ["train.epochs=-1"])
    assert "(--set train.epochs=-1)" in msg and "train.epochs: must be above 0" in msg
    with pytest.raises(UserError, match="expected dotted.key=value"):
        load_config(write_spec(tmp_path, ""), ["train.epochs"])


def test_derived_values_exact(tmp_path):
    config = load_config(write_spec(tmp_path, tiny_spec(tmp_path)), [])
    config3 = config.model_copy(update={"scaling": config.scaling.model_copy(update={"num_workers": 3}),
                                        "train": config.train.model_copy(update={"reference_batch_size": 256})})
    trial = config3.trials.trial({"per_gpu_batch_size": 1024, "base_lr": 2e-4, "warmup_epochs": 2}, train_size=50_000)
    assert trial.global_batch_size == 3072
    assert trial.peak_lr == pytest.approx(6.928e-4, rel=1e-4)  # 2e-4 × sqrt(3072 / 256)
    assert trial.steps_per_epoch == 16  # floor(50000 / 3072): whole steps (drop_last), 848 samples sit out
    assert trial.samples_per_epoch == 16 * 3072
    assert trial.warmup_steps == 32 and trial.total_steps == 3 * 16
    accum = config3.trials.trial({"per_gpu_batch_size": 512, "grad_accum_steps": 2, "base_lr": 2e-4}, train_size=50_000)
    assert accum.global_batch_size == 3072 and accum.peak_lr == trial.peak_lr
    params = trial.params()
    assert params["global_batch_size"] == 3072 and params["world_size"] == 3 and params["samples_per_epoch"] == 49_152


def test_default_knobs_take_default_else_first_choice_or_lower_bound(tmp_path):
    text = ("search:\n  per_gpu_batch_size: {choice: [16, 32], default: 32}\n"
            "  base_lr: {loguniform: [1.0e-4, 1.0e-3]}\n"
            "  warmup_epochs: {randint: [0, 1]}\n  weight_decay: 0.01\n")
    assert load_config(write_spec(tmp_path, text)).trials.default_knobs() == {
        "per_gpu_batch_size": 32, "base_lr": 1e-4, "warmup_epochs": 0, "weight_decay": 0.01}


def test_cli_prints_one_line_exit_2_no_traceback(tmp_path):
    path = write_spec(tmp_path, "train:\n  epoch: 3\n")
    proc = subprocess.run([sys.executable, "-m", "raysweep", "train", str(path)], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"raysweep: error: {path}: train.epoch: unknown key 'epoch' (did you mean 'epochs'?)"]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("text, expected", [
    ("search:\n  weight_decay: -1.0e-4\n", "search.weight_decay: must be at least 0.0, got -0.0001"),
    ("search:\n  warmup_epochs: -1\n", "search.warmup_epochs: must be at least 0.0, got -1"),
    ("search:\n  base_lr: {loguniform: [1.0e-3, 1.0e-3]}\n", "low 0.001 must be below high 0.001"),
    ("search:\n  weight_decay: {uniform: [0.01, 0.0]}\n", "low 0.01 must be below high 0.0"),
    ("search:\n  warmup_epochs: {randint: [2, 0]}\n", "low 2 must not exceed high 0"),
    ("search:\n  base_lr: {loguniform: [1.0e-4, 1.0e-3], default: 1.0e-2}\n",
     "default 0.01 lies outside [0.0001, 0.001]"),
    ("search:\n  warmup_epochs: {randint: [0, 2], default: 3}\n", "default 3 lies outside [0, 2]"),
    ("search:\n  per_gpu_batch_size: {choice: [16, 32], default: 64}\n",
     "default 64 is not one of the choices [16, 32]"),
    ("data:\n  val_dir: /tmp\n", "val_dir is set but train_dir is not"),
    ("tune:\n  asha: {grace_period: 7}\n", "tune.asha.grace_period: 7 exceeds max_t 6"),
    ("train:\n  epochs: 4\ntune:\n  asha: {max_t: 6}\n", "tune.asha.max_t: 6 exceeds train.epochs 4"),
    ("tune:\n  asha: {unit: seconds}\n", "tune.asha.unit: seconds needs a horizon in seconds; set tune.asha.max_t"),
    ("tune:\n  asha: {grace_period: 1.5}\n", "tune.asha.grace_period: 1.5 is not a whole number of epochs"),
    ("train:\n  time_budget_s: 60.0\ntune:\n  asha: {unit: seconds, max_t: 90}\n",
     "tune.asha.max_t: 90 s exceeds train.time_budget_s 60"),
    ("tune:\n  asha: {unit: minutes}\n", "tune.asha.unit: got 'minutes', expected 'epochs' or 'seconds'"),
    ("tune:\n  target: {metric: val_exact, value: 0.7}\n",
     "unknown metric 'val_exact' (did you mean 'val_exact_acc'?)"),
    ("tune:\n  target: {metric: val_exact_acc}\n", "tune.target.value: missing required key"),
    ("train:\n  time_budget_s: 0\n", "train.time_budget_s: must be above 0.0, got 0"),
])
def test_bad_values_are_one_line_errors(tmp_path, text, expected):
    msg = _error(tmp_path, text)
    assert msg.startswith(str(tmp_path / "spec.yaml")) and expected in msg, msg


def test_missing_val_dir_folder(tmp_path):
    (tmp_path / "train").mkdir()
    msg = _error(tmp_path, f"data:\n  train_dir: {tmp_path / 'train'}\n  val_dir: {tmp_path / 'nope'}\n")
    assert "data.val_dir: no such folder" in msg and "nope" in msg


def test_invalid_yaml_names_the_line(tmp_path):
    msg = _error(tmp_path, "train:\n  epochs: [3\n")
    assert f"{tmp_path / 'spec.yaml'}: line" in msg and "invalid YAML" in msg


def test_spec_that_is_not_a_mapping(tmp_path):
    assert "expected a mapping of sections" in _error(tmp_path, "- name: x\n")


def test_set_into_a_scalar_is_refused(tmp_path):
    msg = _error(tmp_path, "train:\n  epochs: 3\n", ["train.epochs.value=3"])
    assert msg == "--set train.epochs.value=3: 'train.epochs' is a value, not a section"
    msg = _error(tmp_path, "name: x\n", ["name.first=3"])
    assert msg == "--set name.first=3: 'name' is a value, not a section"


def test_train_ignores_asha_so_epochs_can_be_shortened(tmp_path):
    """Bug: `train --set train.epochs=2` exited 2 with `tune.asha.max_t 6 exceeds train.epochs 2`."""
    path = write_spec(tmp_path, "train:\n  epochs: 6\ntune:\n  asha: {max_t: 6}\n")
    assert load_config(path, ["train.epochs=2"], sweep=False).train.epochs == 2
    with pytest.raises(UserError, match="tune.asha.max_t: 6 exceeds train.epochs 2"):
        load_config(path, ["train.epochs=2"])  # `tune` still refuses a contradiction the user wrote
    quickstart = ROOT / "search_spaces" / "quickstart.yaml"
    assert load_config(quickstart, ["train.epochs=3"]).max_t == 3  # unset max_t follows the epochs
    # each command checks what it runs: `train` runs the default warmup (1 epoch), `tune` draws up to 2 (it was
    # refused for `train` too, for a warmup `train` never runs)
    assert load_config(quickstart, ["train.epochs=2"], sweep=False).train.epochs == 2
    with pytest.raises(UserError, match=r"search\.warmup_epochs: the largest warmup_epochs in the search \(2\) is not "
                                        r"shorter than train\.epochs \(2\)"):
        load_config(quickstart, ["train.epochs=2"])
    with pytest.raises(UserError, match=r"search\.warmup_epochs: the default warmup_epochs \(1\), which `train` runs, "
                                        r"is not shorter than train\.epochs \(1\)"):
        load_config(quickstart, ["train.epochs=1"], sweep=False)
    # the `train` command gets past the spec (and fails later, on the bad address, without starting Ray)
    proc = subprocess.run([sys.executable, "-m", "raysweep", "train", str(path), "--set", "train.epochs=2",
                           "--address", "not-an-address"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("raysweep: error: --address not-an-address:"), proc.stderr


def test_quickstart_runs_auto_precision():
    assert load_config(ROOT / "search_spaces" / "quickstart.yaml").train.precision == "auto"


def test_data_too_small_for_the_trial_is_a_one_line_error(tmp_path):
    config = load_config(write_spec(tmp_path, tiny_spec(tmp_path, search={
        "per_gpu_batch_size": {"choice": [1, 16]}, "grad_accum_steps": {"choice": [1, 8]},
        "base_lr": 1.0e-3, "warmup_epochs": 1, "weight_decay": 0.0})))
    config.trials.check_data_fits(256)  # 128 per rank: the largest, batch 16 × 8 accumulation steps, fits
    with pytest.raises(UserError) as e:
        config.trials.check_data_fits(14)  # 7 per rank, but batch 1 × 8 accumulation steps is one step of 8
    assert str(e.value) == (
        "search.per_gpu_batch_size: 1 × 8 accumulation step(s) is more than a rank's share of the training set (14 "
        "images over 2 workers: 7 each), so not one whole step fits in an epoch; the largest per-GPU batch this data "
        "runs is 1: lower the batch, or use more training images")
    config.trials.check_data_fits(14, searched=False)  # the defaults (batch 1, 1 step) fit
    # a per-GPU batch cut into micro-batches by a cap still takes whole steps: batch 2 capped at 1 on 6 images is one
    # step of 2 micro-batches of 1 per rank (a share of 3: one sample sits out)
    import dataclasses

    two = dataclasses.replace(config.trials, search=config.search.model_copy(update={"per_gpu_batch_size": 2}))
    two.check_data_fits(6, batch_cap=1, searched=False, source="spec.yaml")
    capped = two.trial({}, 6, batch_cap=1)
    assert (capped.steps_per_epoch, capped.micro_batch_size, capped.accumulation_steps) == (1, 1, 2)



def test_the_trial_factory_is_the_specs_slice_that_makes_trials_and_travels_to_tune(tmp_path):
    """`config.trials` holds only the sections a trial reads; Tune's actors get it through Ray's cloudpickle."""
    from ray import cloudpickle

    config = load_config(write_spec(tmp_path, tiny_spec(tmp_path, search={
        "per_gpu_batch_size": {"choice": [16, 64], "default": 16, "max": 32}, "grad_accum_steps": {"choice": [1, 2]},
        "base_lr": 2.0e-3, "warmup_epochs": 1, "weight_decay": 0.0})))
    trials = cloudpickle.loads(cloudpickle.dumps(config.trials))
    assert set(trials.searched()) == {"per_gpu_batch_size", "grad_accum_steps"} and trials.batch_cap == 32
    assert trials.default_knobs() == {"per_gpu_batch_size": 16, "grad_accum_steps": 1, "base_lr": 2.0e-3,
                                      "warmup_epochs": 1, "weight_decay": 0.0}
    assert trials.is_baseline({"per_gpu_batch_size": 16, "grad_accum_steps": 1})
    assert not trials.is_baseline({"per_gpu_batch_size": 64, "grad_accum_steps": 1})
    assert trials.global_batches() == [32, 64, 128, 256]  # {16, 64} × 2 workers × {1, 2}
    trial = trials.trial({"per_gpu_batch_size": 64, "grad_accum_steps": 2}, train_size=1024, batch_cap=32)
    assert (trial.micro_splits, trial.micro_batch_size, trial.accumulation_steps) == (2, 32, 4)
    assert trial.global_batch_size == 256  # the cap cuts the micro-batch, not the global batch
    assert (trial.image.width, trial.image.height, trial.image.num_classes) == (64, 24, 36)
    assert trial.to_dict() == config.trials.trial({"per_gpu_batch_size": 64, "grad_accum_steps": 2}, 1024, 32).to_dict()
    trials.check_data_fits(1024, batch_cap=32)
    with pytest.raises(UserError, match=r"^search.per_gpu_batch_size: 16 × 1 accumulation step\(s\) is more than a "):
        trials.check_data_fits(2)  # batch 16 on a share of 1: one step of 1 sample, the LR scaled for 16

@pytest.mark.parametrize("argv, expected", [
    (["tune", "SPEC", "--resume"], "--resume: no sweep at"),
    (["tune", "SPEC", "--cap-batch", "0"], "--cap-batch 0: expected a positive per-GPU batch size"),
])
def test_cli_flags_that_cannot_work_are_one_line_errors(tmp_path, capsys, argv, expected):
    from raysweep.cli import main

    path = write_spec(tmp_path, tiny_spec(tmp_path))
    assert main([str(path) if a == "SPEC" else a for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"raysweep: error: {expected}") and err.count("\n") == 1, err


@pytest.mark.parametrize("knob, value, expected", [
    ("base_lr", "{uniform: [0, 3.0e-3]}", "search.base_lr.uniform[0]: must be above 0.0, got 0"),
    ("base_lr", "{choice: [0.0, 1.0e-3]}", "search.base_lr.choice[0]: must be above 0.0, got 0.0"),
    ("per_gpu_batch_size", "{randint: [0, 64], default: 32}", "search.per_gpu_batch_size.randint[0]: must be above 0"),
    ("warmup_epochs", "{randint: [-1, 2]}", "search.warmup_epochs.randint[0]: must be at least 0, got -1"),
    ("warmup_epochs", "{uniform: [-0.5, 2]}", "search.warmup_epochs.uniform[0]: must be at least 0.0, got -0.5"),
    ("weight_decay", "{uniform: [-1.0e-4, 1.0e-2]}", "search.weight_decay.uniform[0]: must be at least 0.0"),
    ("grad_accum_steps", "{randint: [0, 4]}", "search.grad_accum_steps.randint[0]: must be above 0, got 0"),
])
def test_every_knob_range_is_checked_against_what_a_trial_takes(tmp_path, capsys, knob, value, expected):
    """A range that draws a value a trial refuses (base_lr 0, batch 0) is one line where it is written: `check` printed
    pydantic's traceback, and `tune` failed every trial that drew it."""
    from raysweep.cli import main

    assert expected in _error(tmp_path, f"search:\n  {knob}: {value}\n")
    assert main(["check", str(tmp_path / "spec.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and expected in err


@pytest.mark.parametrize("text, overrides, expected", [
    # `train`'s and `tune`'s trial: a fixed warmup as long as the epochs
    ("train: {epochs: 2}\nsearch: {warmup_epochs: 5}\n", (), "search.warmup_epochs: warmup_epochs (5) is not shorter "
     "than train.epochs (2): a trial would end before its LR reaches peak_lr; lower warmup_epochs below 2"),
    # ASHA in seconds checks no warmup against grace: the epochs still end every trial
    ("train: {epochs: 3, time_budget_s: 30}\nsearch: {warmup_epochs: {randint: [0, 3]}}\ntune: {asha: {unit: seconds, "
     "grace_period: 5}}\n", (), "search.warmup_epochs: the largest warmup_epochs in the search (3) is not shorter"),
    # allow_grace_within_warmup lets ASHA judge trials in warmup, not trials that never leave it
    ("train: {epochs: 4}\nsearch: {warmup_epochs: {choice: [1, 4]}}\ntune: {asha: {grace_period: 1, "
     "allow_grace_within_warmup: true}}\n", (), "search.warmup_epochs: the largest warmup_epochs in the search (4)"),
    # ASHA ends every trial at max_t
    ("train: {epochs: 8}\nsearch: {warmup_epochs: {randint: [0, 4]}}\ntune: {asha: {max_t: 4, grace_period: 4}}\n", (),
     "search.warmup_epochs: the largest warmup (4) is not shorter than tune.asha.max_t (4), where every trial ends"),
])
def test_a_warmup_as_long_as_the_trial_is_refused_naming_warmup(tmp_path, text, overrides, expected):
    assert expected in _error(tmp_path, text, overrides)


def test_train_refuses_a_warmup_as_long_as_its_epochs_and_probe_does_not_ask(tmp_path):
    path = write_spec(tmp_path, "search: {warmup_epochs: 5}\n")
    with pytest.raises(UserError, match=r"spec\.yaml: search\.warmup_epochs: warmup_epochs \(5\) is not shorter than "
                                        r"train\.epochs \(2\)"):
        load_config(path, ["train.epochs=2"], sweep=False)
    assert load_config(path, ["train.epochs=2"], sweep=False, trial=False).train.epochs == 2  # probe trains nothing


def test_a_grace_period_inside_the_warmup_names_warmup_as_a_fix_too(tmp_path):
    msg = _error(tmp_path, "train: {epochs: 6}\nsearch: {warmup_epochs: {randint: [0, 3]}}\ntune: {asha: "
                           "{grace_period: 2}}\n")
    assert msg.endswith("raise grace_period, lower the largest warmup_epochs, or set "
                        "tune.asha.allow_grace_within_warmup: true")


def test_a_charset_a_byte_cannot_index_is_refused(tmp_path):
    charset = "".join(chr(0x100 + i) for i in range(257))
    msg = _error(tmp_path, f"data:\n  charset: \"{charset}\"\n")
    assert "data.charset: 257 characters, at most 256 (a label's characters are stored one byte each)" in msg
    assert "data.charset: repeats a character" in _error(tmp_path, "data:\n  charset: \"AAB\"\n")
