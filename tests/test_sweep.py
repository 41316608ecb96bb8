"""`tune` end to end on the real local cluster (2 CPUs → room for 1 trial), MLflow on SQLite."""

import pytest

from raysweep.cli import main
from raysweep.cluster import plan_concurrency
from raysweep.config import load_config
from raysweep.errors import UserError
from raysweep.tracking import resolve_tracking_uri

from conftest import tiny_spec, write_spec

SWEEP = dict(
    train={"epochs": 4, "reference_batch_size": 64},
    search={
        "per_gpu_batch_size": {"choice": [16, 32], "default": 16},
        "base_lr": {"loguniform": [1.0e-5, 3.0e-3], "default": 2.0e-3},
        "warmup_epochs": {"randint": [0, 1], "default": 1},
        "weight_decay": {"loguniform": [1.0e-5, 1.0e-2], "default": 1.0e-4},
    },
    tune={"num_samples": 6, "metric": "val_loss", "mode": "min", "seed": 0,
          "asha": {"max_t": 4, "grace_period": 1, "reduction_factor": 2}},
)


@pytest.mark.ray
@pytest.mark.timeout(480)
def test_quickstart_sized_sweep_end_to_end(ray_cluster, tmp_path, capsys):
    import ray
    from mlflow.tracking import MlflowClient
    from ray.tune import ExperimentAnalysis
    from ray.util.state import list_actors

    gcs = ray.get_runtime_context().gcs_address  # this cluster's (a State API call without one looks for every Ray
    # instance on the machine, and the other lane's test hosts are ones: conftest.py)
    before = {a.actor_id for a in list_actors(address=gcs, limit=10_000, raise_on_missing_output=False)}
    path = write_spec(tmp_path, tiny_spec(tmp_path, **SWEEP))
    assert main(["tune", str(path), "--progress-every", "20", "--confirm"]) == 0
    out = capsys.readouterr().out
    assert "plan: 2 CPU, 2 workers/trial → 1 trial at a time; ASHA prunes sequentially" in out
    assert "top trials by val_loss (min); Δ against the baseline" in out and "mlflow ui --backend-store-uri" in out

    # Tune's own record of the sweep, one that `tune --resume` can restore (the line an interrupted one ends with)
    from raysweep.resume import resume_hint

    assert resume_hint(str(tmp_path / "results" / "t"), str(path), ["tune.seed=3"]) == \
        f"python -m raysweep tune {path} --set tune.seed=3 --resume"
    analysis = ExperimentAnalysis(str(tmp_path / "results" / "t"))
    trials = {t.trial_id: t for t in analysis.trials}
    assert len(trials) == 6 and all(t.status == "TERMINATED" for t in trials.values())
    last_epoch = {tid: int(t.last_result["epoch"]) for tid, t in trials.items()}
    pruned = {tid for tid, e in last_epoch.items() if e < 4}
    assert pruned, "ASHA stopped no trial"

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("t")
    runs = client.search_runs([experiment.experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags and r.data.tags["raysweep.kind"] == "tune"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id]
    assert len(parents) == 1 and len(children) == 6
    parent = parents[0]
    assert parent.info.status == "FINISHED" and "best_val_loss" in parent.data.metrics
    assert parent.data.tags["best_trial_id"] in trials
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"spec.yaml", "recommendation.json", "answer.json"} <= artifacts
    # the noise scale's table, from the trials' own B_noise (2 DDP workers) and samples/s: evidence, not an answer
    assert "the gradient noise scale B_noise ≈" in out and "fastest" not in out
    assert parent.data.metrics["grad_noise_scale"] > 0 and "recommended_global_batch" not in parent.data.metrics
    _assert_one_answer_confirmed(client, parent, runs, out, tmp_path, path, capsys)
    for child in children:
        tid = child.info.run_name
        assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id and child.data.tags["trial_id"] == tid
        for param in ("global_batch_size", "peak_lr", "per_gpu_batch_size", "base_lr", "warmup_steps", "device_name"):
            assert param in child.data.params, param
        for metric in ("train_loss", "val_exact_acc", "lr", "peak_mem_allocated_gb", "rss_gb"):
            steps = [m.step for m in client.get_metric_history(child.info.run_id, metric)]
            assert steps == list(range(1, last_epoch[tid] + 1)), (tid, metric)
        if tid in pruned:  # statuses match Tune's: cut early → KILLED by ASHA
            assert child.info.status == "KILLED" and child.data.tags["stopped_by"] == "asha"
        else:
            assert child.info.status == "FINISHED"

    # room for one trial: the plan held, no two trials ran at once
    spans = sorted((c.info.start_time, c.info.end_time) for c in children)
    assert all(prev_end <= start for (_, prev_end), (start, _) in zip(spans, spans[1:]))

    # warm worker groups: one group ran every trial; each trial's start-up is on its run, with its first epoch
    from raysweep.metrics import STARTUP_NAMES

    startups = {}
    for child in sorted(children, key=lambda c: c.info.start_time):
        phases = {}
        for name in STARTUP_NAMES:
            (m,) = client.get_metric_history(child.info.run_id, name)  # logged once
            assert m.step == 1, (name, m.step)
            phases[name] = m.value
        assert phases["startup_s"] == pytest.approx(sum(v for k, v in phases.items() if k != "startup_s"), abs=1e-6)
        startups[child.info.run_name] = phases
    first, *later = startups.values()
    assert all(p["startup_group_s"] == 0 and p["startup_data_s"] == 0 for p in later)  # the group was warm
    assert first["startup_group_s"] + first["startup_data_s"] > 0  # it was built for (or beside) the first
    assert all(f"up     {tid}: started in {p['startup_s']:.1f}s (driver " in out for tid, p in startups.items())
    busy = parent.data.metrics["busy_share"]
    assert 0 < busy < 1 and parent.data.metrics["sweep_wall_s"] > 0
    assert f"busy {busy:.0%}: 1 slot × " in out and f"{len(later)} on warm groups" in out
    # the slot's workers are gone with the sweep (its placement group freed for the next test's)
    alive = [a.class_name for a in list_actors(address=gcs, filters=[("state", "=", "ALIVE")], limit=10_000,
                                               raise_on_missing_output=False) if a.actor_id not in before]
    assert not {"RayTrainWorker", "TrainController", "SlotHost", "BrokerActor"} & set(alive), alive


def _assert_one_answer_confirmed(client, parent, runs, out, tmp_path, path, capsys):
    """The sweep's one answer is its best trial, the same on the console (its last block before the confirmation),
    in answer.json, the parent's answer.* params and metrics and report.html; `--confirm` ran it on seeds 1 and 2 for
    the whole budget, and what they measured is beside the prediction everywhere."""
    import json

    from raysweep.cli import main as cli

    best = parent.data.tags["best_trial_id"]
    params = parent.data.params
    assert params["answer.trial_id"] == best and params["answer.ran"] == "True"
    best_run = next(r for r in runs if r.data.tags.get("trial_id") == best)
    assert params["answer.global_batch"] == best_run.data.params["global_batch_size"]
    assert float(params["answer.peak_lr"]) == pytest.approx(float(best_run.data.params["peak_lr"]))
    assert parent.data.metrics["answer.global_batch"] == float(params["answer.global_batch"])
    sweep_block = out[out.index("\nanswer (ran): "):out.index("confirm: the sweep's answer")]
    assert f"global batch {params['answer.global_batch']} = per-GPU" in sweep_block and best in sweep_block
    # the confirmation: its own parent run (kind confirm) naming the sweep, one run per seed, whole budget, no ASHA
    (confirm,) = [r for r in runs if r.data.tags.get("raysweep.kind") == "confirm"]
    assert confirm.data.tags["raysweep.confirms"] == parent.info.run_id and confirm.info.status == "FINISHED"
    seeds = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == confirm.info.run_id]
    assert sorted(r.data.params["seed"] for r in seeds) == ["1", "2"]
    assert all(r.info.status == "FINISHED" and r.data.metrics["epoch"] == 4 for r in seeds)
    assert all(r.data.params["global_batch_size"] == params["answer.global_batch"] for r in seeds)
    assert "measured_value" in confirm.data.metrics and "predicted_value" in confirm.data.metrics
    answer = json.loads((tmp_path / "results" / "t" / "report" / "answer.json").read_text())
    assert answer["trial_id"] == best and answer["confirmed"]["parent_run_id"] == confirm.info.run_id
    measured = answer["confirmed"]["measured"]["value"]
    assert measured == pytest.approx(sum(r.data.metrics["val_loss"] for r in seeds) / 2)
    assert client.get_run(parent.info.run_id).data.metrics["answer.confirmed_value"] == pytest.approx(measured)
    assert "confirmation of global batch" in out and "\n  confirmed: seed 1: " in out
    page = (tmp_path / "results" / "t" / "report" / "report.html").read_text()
    assert page.index("id='answer'") < page.index('id="summary"') and "confirmed" in page
    # a batch the sweep did not run: its predicted recipe, from the store alone
    assert cli(["answer", str(path), "--batch", "128"]) == 0
    said = capsys.readouterr().out
    assert "answer (predicted, not yet run): global batch 128 = per-GPU 64 × 2 workers × 1 accumulation" in said
    assert f"confirm:  python -m raysweep confirm {path} --batch 128" in said


@pytest.mark.ray
@pytest.mark.timeout(400)
def test_a_time_budget_sweep_with_asha_in_seconds_and_a_target(ray_cluster, tmp_path, capsys):
    """train.time_budget_s, tune.asha.unit: seconds and tune.target together, from the store: a trial faster per
    sample resolves to more epochs than a slower one; every ASHA cut falls on the first report past a rung in
    train_seconds; time_to_target_s is what the per-epoch history implies; the sweep ranks by it."""
    from mlflow.tracking import MlflowClient

    # a cap (train.epochs) neither batch reaches on a fast machine: batch 4 ran 0.64 s an epoch here, so a cap of 8
    # fit both into 6 s and the comparison below tied at the cap; batch 32 (0.18 s) now stops at the budget
    spec = tiny_spec(tmp_path, train={"epochs": 40, "reference_batch_size": 64, "time_budget_s": 6.0},
                     search={"per_gpu_batch_size": {"choice": [4, 32], "default": 4}, "base_lr": 2.0e-3,
                             "warmup_epochs": 1, "weight_decay": 1.0e-4},
                     tune={"num_samples": 2, "seed": 0, "asha": {"unit": "seconds", "grace_period": 1.5},
                           "target": {"metric": "val_loss", "value": 0.3}})
    assert main(["tune", str(write_spec(tmp_path, spec))]) == 0
    out = capsys.readouterr().out
    assert "top trials by time to val_loss ≤ 0.3 (training seconds), then val_loss (min)" in out

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("t").experiment_id])
    parent = next(r for r in runs if "mlflow.parentRunId" not in r.data.tags)
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]

    def history(run, name):
        return {int(m.step): m.value for m in client.get_metric_history(run.info.run_id, name)}

    resolved = {}
    for child in children:
        batch, epochs = int(child.data.params["per_gpu_batch_size"]), int(child.data.params["resolved_epochs"])
        resolved.setdefault(batch, []).append(epochs)
        clock, loss = history(child, "train_seconds"), history(child, "val_loss")
        assert sorted(clock) == list(range(1, max(clock) + 1))
        assert all(clock[e] < clock[e + 1] for e in range(1, max(clock)))  # monotonic
        last = max(clock)
        if child.data.tags.get("stopped_by") == "asha":  # cut at the first report past a rung (1.5, 3 s), only there
            before = clock.get(last - 1, 0.0)
            assert any(before < rung <= clock[last] for rung in (1.5, 3.0)), (before, clock[last])
        else:
            assert child.info.status == "FINISHED" and (last == epochs or clock[last] >= 6.0)
        reached = [e for e in sorted(loss) if loss[e] <= 0.3]
        if reached:  # interpolated between the epochs that straddle 0.3
            e = reached[0]
            if e == 1:  # from the start of training (the untrained model's loss, 0.69, is not logged): inside epoch 1
                assert 0 < child.data.metrics["time_to_target_s"] < clock[1]
            else:
                expected = clock[e - 1] + (0.3 - loss[e - 1]) / (loss[e] - loss[e - 1]) * (clock[e] - clock[e - 1])
                assert child.data.metrics["time_to_target_s"] == pytest.approx(expected, rel=1e-6)
        else:
            assert "time_to_target_s" not in child.data.metrics
    assert set(resolved) == {4, 32}, resolved  # both batches ran
    assert min(resolved[32]) > max(resolved[4])  # faster per sample: more epochs in the same budget

    reached = [c for c in children if "time_to_target_s" in c.data.metrics]
    assert reached, "no trial reached val_loss 0.3"
    best = min(reached, key=lambda c: c.data.metrics["time_to_target_s"])
    assert parent.data.tags["best_trial_id"] == best.info.run_name
    assert parent.data.metrics["best_time_to_target_s"] == pytest.approx(best.data.metrics["time_to_target_s"])
    assert parent.data.tags["raysweep.target_metric"] == "val_loss"
    report = {a.path for a in client.list_artifacts(parent.info.run_id, "report")}
    assert "report/metric_time.png" in report
    html = (tmp_path / "results" / "t" / "report" / "report.html").read_text()
    assert "<th>time to val_loss ≤ 0.3 (s)</th>" in html and "ranked by the time to <b>val_loss ≤ 0.3</b>" in html
    if len({int(c.data.params["global_batch_size"]) for c in reached}) > 1:  # the prediction held against the sweep
        assert "<table id='held'>" in html and "held against this sweep" in out

    # `check` now prints the rungs in epochs too, from the seconds an epoch each batch measured
    capsys.readouterr()
    assert main(["check", str(tmp_path / "spec.yaml")]) == 0
    out = capsys.readouterr().out
    rung = next(line for line in out.splitlines() if line.startswith("#   rung 1"))
    import statistics

    at_64 = statistics.median(r.data.metrics["train_seconds"] / r.data.metrics["epoch"] for r in children
                              if r.data.params["global_batch_size"] == "64")
    assert "1.5 s" in rung and "?" not in rung and f"{1.5 / at_64:.1f} ep" in rung, rung


@pytest.mark.parametrize("overrides, message", [
    (["scaling.num_workers=3"], "a trial needs 3 CPUs (3 workers × 1) but the cluster has 2"),
    (["scaling.use_gpu=true"], "scaling.use_gpu: true but the cluster has no GPU"),
])
def test_impossible_spec_errors_before_start(ray_cluster, tmp_path, capsys, overrides, message):
    path = write_spec(tmp_path, tiny_spec(tmp_path, **SWEEP))
    assert main(["tune", str(path), *[a for o in overrides for a in ("--set", o)]]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and "data:" not in captured.out  # nothing was generated or started
    assert not (tmp_path / "mlflow.db").exists()


@pytest.mark.ray
def test_data_too_small_for_the_trial_fails_before_any_trial_starts(ray_cluster, tmp_path, capsys):
    spec = tiny_spec(tmp_path, data={"width": 64, "height": 24, "synthetic": {"train_size": 14, "val_size": 8}},
                     search={"per_gpu_batch_size": 1, "grad_accum_steps": 8, "base_lr": 1.0e-3, "warmup_epochs": 1,
                             "weight_decay": 0.0})
    assert main(["train", str(write_spec(tmp_path, spec))]) == 2
    captured = capsys.readouterr()
    error = captured.err.strip()
    assert error == (f"raysweep: error: {tmp_path / 'spec.yaml'}: search.per_gpu_batch_size: 1 × 8 accumulation "
                     f"step(s) is more than a rank's share of the training set (14 images over 2 workers: 7 each), so "
                     f"not one whole step fits in an epoch; the largest per-GPU batch this data runs is 1: lower the "
                     f"batch, or use more training images"), captured.err
    assert "data:" not in captured.out  # refused from the spec's sizes, before Ray and before any data was made
    assert "epoch 1" not in captured.out and not (tmp_path / "mlflow.db").exists()  # no trial, no MLflow run


def test_plan_for_three_gpus_three_workers(tmp_path):
    config = load_config_from(tmp_path, {"scaling": {"num_workers": 3, "use_gpu": True, "cpus_per_worker": 4}})
    plan = plan_concurrency({"CPU": 48, "GPU": 3, "trial_driver": 8}, config, num_samples=20)
    assert plan.trials_at_once == 1
    assert plan.message == "3 GPU, 3 workers/trial → 1 trial at a time; ASHA prunes sequentially"
    assert plan_concurrency({"CPU": 48, "GPU": 8, "trial_driver": 8}, config, 20).trials_at_once == 2
    with pytest.raises(UserError, match=r"a trial needs 12 CPUs \(3 workers × 4\) but the cluster has 8"):
        plan_concurrency({"CPU": 8, "GPU": 8, "trial_driver": 8}, config, 20)


def test_three_workers_sharing_one_gpu_plan_a_third_each_and_bad_shares_are_one_line(tmp_path):
    from raysweep.slots.resources import group_resources

    scaling = {"num_workers": 3, "use_gpu": True, "workers_per_gpu": 3, "cpus_per_worker": 1}
    config = load_config_from(tmp_path, {"scaling": scaling})
    plan = plan_concurrency({"CPU": 16, "GPU": 1, "trial_driver": 8}, config, num_samples=4)
    assert plan.trials_at_once == 1
    assert plan.message == "1 GPU, 3 workers/trial (3 to a GPU, gloo) → 1 trial at a time; ASHA prunes sequentially"
    assert plan_concurrency({"CPU": 16, "GPU": 2, "trial_driver": 8}, config, 4).trials_at_once == 2
    assert group_resources(config.scaling.model_dump()) == {"CPU": 3, "GPU": 1.0}  # what a slot waits for
    with pytest.raises(UserError, match=r"a trial needs 1 GPU\(s\) \(3 workers × 1/3\) but the cluster has 0.5"):
        plan_concurrency({"CPU": 16, "GPU": 0.5, "trial_driver": 8}, config, 4)
    for bad, said in (({"workers_per_gpu": 3}, "workers_per_gpu 3 needs use_gpu: true"),
                      ({"use_gpu": True, "workers_per_gpu": 4}, "workers_per_gpu 4 is more than num_workers 3")):
        path = write_spec(tmp_path, tiny_spec(tmp_path, scaling={"num_workers": 3, **bad}))
        with pytest.raises(UserError, match=said):
            load_config(path)


def test_plan_respects_cpus_cap_and_trial_drivers(tmp_path):
    config = load_config_from(tmp_path, {"scaling": {"num_workers": 2, "cpus_per_worker": 2},
                                         "tune": {"max_concurrent_trials": 3}})
    assert plan_concurrency({"CPU": 32, "trial_driver": 64}, config, 10).trials_at_once == 3  # capped
    assert plan_concurrency({"CPU": 8, "trial_driver": 64}, config, 10).trials_at_once == 2  # CPUs
    assert plan_concurrency({"CPU": 32, "trial_driver": 1}, config, 10).trials_at_once == 1  # drivers
    with pytest.raises(UserError, match="no 'trial_driver' resource"):
        plan_concurrency({"CPU": 32}, config, 10)


def test_search_space_maps_each_distribution(tmp_path):
    from ray.tune.search.sample import Categorical, Float, Integer, LogUniform, Uniform

    from raysweep.search import tune_space

    search = {**SWEEP["search"], "weight_decay": {"uniform": [0.0, 0.01]}, "grad_accum_steps": 2}
    space = tune_space(load_config_from(tmp_path, {**SWEEP, "search": search}).search.knobs())
    assert isinstance(space["per_gpu_batch_size"], Categorical) and space["per_gpu_batch_size"].categories == [16, 32]
    lr = space["base_lr"]
    assert isinstance(lr, Float) and isinstance(lr.get_sampler(), LogUniform) and (lr.lower, lr.upper) == (1e-5, 3e-3)
    wd = space["weight_decay"]
    assert isinstance(wd, Float) and isinstance(wd.get_sampler(), Uniform) and (wd.lower, wd.upper) == (0.0, 0.01)
    assert isinstance(space["warmup_epochs"], Integer) and space["warmup_epochs"].upper == 2  # inclusive 1
    assert space["grad_accum_steps"] == 2  # fixed values pass through
    assert "lr_rule" not in space  # unset knobs are not in the space


def test_tracking_uri_is_absolute_and_file_store_refused(tmp_path):
    assert resolve_tracking_uri(None, tmp_path) == f"sqlite:///{tmp_path}/mlflow.db"
    assert resolve_tracking_uri("sqlite:///sub/m.db", tmp_path) == f"sqlite:///{tmp_path}/sub/m.db"
    assert resolve_tracking_uri("http://127.0.0.1:5000") == "http://127.0.0.1:5000"
    for bad in ("./mlruns", "file:///tmp/mlruns"):
        with pytest.raises(UserError, match="refuses the file store"):
            resolve_tracking_uri(bad, tmp_path)


def load_config_from(tmp_path, sections: dict):
    return load_config(write_spec(tmp_path, tiny_spec(tmp_path, **sections)))


def test_cluster_yaml_passes_rays_own_validation():
    import copy

    import yaml
    from ray.autoscaler._private.commands import _bootstrap_config
    from ray.autoscaler._private.util import prepare_config, validate_config

    from conftest import ROOT

    raw = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    config = prepare_config(copy.deepcopy(raw))
    validate_config(config)
    booted = _bootstrap_config(config, no_config_cache=True)  # the rest of `ray up`'s offline path
    assert booted["provider"]["type"] == "local"
    head = " ".join(raw["head_start_ray_commands"])
    assert "trial_driver" in head and "--dashboard-host=127.0.0.1" in head
    assert any('ray[default,train,tune]==2.60.*' in c for c in raw["setup_commands"])
    # token authentication: every `ray start` runs in token mode, and the token (in ~/.ray, never in the
    # repository) reaches every node; a head without it is open, a worker without it cannot join
    starts = [c for c in raw["head_start_ray_commands"] + raw["worker_start_ray_commands"] if "ray start" in c]
    exports = [c.split("ray start")[0].split("export ")[-1] for c in starts]
    assert len(starts) == 2 and all("RAY_AUTH_MODE=token" in e.split(";")[0].split() for e in exports)
    # autoscaler v1 (every listed machine joins: v2 left one out; tests/test_ray_up.py): the head's export must come
    # after the `export RAY_enable_autoscaler_v2=1;` that `ray up` puts in front of its start commands
    assert "RAY_enable_autoscaler_v2=0" in exports[0].split(";")[0].split()
    assert raw["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    # and the nodes' shells (README's `ray exec ... --address auto`): raysweep sets no mode with --address
    assert any("export RAY_AUTH_MODE=token" in c and "~/.bashrc" in c for c in raw["initialization_commands"])


def test_large_batch_spec_is_the_users_sweep():
    from conftest import ROOT

    config = load_config(ROOT / "search_spaces" / "large_batch.yaml")
    assert (config.scaling.num_workers, config.scaling.use_gpu, config.train.precision) == (3, True, "bf16")
    assert config.search.per_gpu_batch_size.choice == [256, 512, 768, 1024]
    assert config.search.base_lr.loguniform == (1e-4, 3e-3) and config.train.lr_rule == "sqrt"
    assert config.search.warmup_epochs.randint == (0, 10)
    # it spans batch sizes, so it counts in seconds (docs/batch-size.md): a budget per trial, rungs in seconds,
    # ranked by time to a target; epochs are only the cap
    assert (config.train.time_budget_s, config.tune.asha.unit, config.tune.asha.grace_period) == (90, "seconds", 10)
    assert config.tune.target.metric == "val_exact_acc" and config.tune.target.stop
    assert (config.train.epochs, config.data.synthetic.train_size, config.data.synthetic.val_size) \
        == (500, 50_000, 5_000)


def test_only_a_tune_sweep_that_tune_saved_is_named_for_resume_when_it_is_interrupted_or_fails(tmp_path):
    """A Ctrl-C or a failed sweep's line said `resume with: python -m raysweep tune SPEC --resume` after any command:
    `confirm`, `train` and `probe` (which resume nothing), `tune --confirm` in its confirmation, a `tune` stopped
    before Tune saved anything. Now: only where the sweep can be restored, as the user typed it (test_search.py's
    Ctrl-C of a real driver checks that line)."""
    import argparse

    from raysweep.cli import _resume_line
    from raysweep.errors import BrokerLost, RayNotStarted

    path = write_spec(tmp_path, tiny_spec(tmp_path))
    config = load_config(path)
    tune = argparse.Namespace(command="tune", spec=str(path), overrides=[], resumable=config)
    assert not (tmp_path / "results" / "t").exists()  # interrupted before its first trial: Tune saved nothing
    for e in (KeyboardInterrupt(), BrokerLost.of("gone"), RayNotStarted("no raylet")):
        assert _resume_line(tune, e) == ""
    (tmp_path / "results" / "t").mkdir(parents=True)  # a folder that is no Tune experiment (a probe's output)
    assert _resume_line(tune, KeyboardInterrupt()) == ""
    for command in ("train", "confirm", "probe"):  # their args never carry a sweep to resume
        other = argparse.Namespace(command=command, spec=str(path), overrides=[])
        assert _resume_line(other, KeyboardInterrupt()) == ""
    tune.resumable = None  # `tune --confirm` once the sweep ended: its confirmation's runs are new
    assert _resume_line(tune, KeyboardInterrupt()) == ""
