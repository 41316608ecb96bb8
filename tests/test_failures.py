"""Largest batch that fits, OOM downshifts and divergence: real Ray, CPU workers, injected faults."""

import json

import pytest
import torch

from raysweep.cli import main
from raysweep.config import ImageSpec, Knobs, ModelConfig, ScalingConfig, TrainConfig, TrialConfig, load_config
from raysweep.model import CaptchaCNN
from raysweep.optim import build_optimizer
from raysweep.worker.faults import FaultInjection, TrialFailure
from raysweep.worker.net import RankModel
from raysweep.worker.probe_step import probe_step
from raysweep.worker.step import DivergenceWatch

from conftest import tiny_spec, write_spec


def _trial(batch=64, accum=1, workers=2):
    return TrialConfig(
        knobs=Knobs(per_gpu_batch_size=batch, base_lr=1e-3, warmup_epochs=1, weight_decay=1e-4,
                    grad_accum_steps=accum, lr_rule="sqrt"),
        train=TrainConfig(epochs=2, reference_batch_size=64), model=ModelConfig(),
        scaling=ScalingConfig(num_workers=workers),
        image=ImageSpec(width=64, height=24, length=4, num_classes=36), train_size=1000,
    )


def test_downshift_keeps_global_batch_lr_and_steps():
    t = _trial(batch=96)
    d = t.downshifted()
    assert (d.micro_batch_size, d.accumulation_steps) == (48, 2)
    assert (d.global_batch_size, d.peak_lr, d.steps_per_epoch, d.total_steps) == (
        t.global_batch_size, t.peak_lr, t.steps_per_epoch, t.total_steps)
    assert d.downshifted().micro_batch_size == 24
    # micro-batches divide the per-GPU batch (a step takes the whole batch): 100 → 50 → 25 → 10; a prime → 1
    shifts = [_trial(batch=100).downshifted()]
    while len(shifts) < 3:
        shifts.append(shifts[-1].downshifted())
    assert [t.micro_batch_size for t in shifts] == [50, 25, 10] and shifts[-1].accumulation_steps == 10
    assert _trial(batch=97).downshifted().micro_batch_size == 1


def test_batch_cap_runs_large_batches_as_micro_batches(tmp_path):
    config = load_config(write_spec(tmp_path, tiny_spec(tmp_path)))
    capped = config.trials.trial({"per_gpu_batch_size": 1024}, train_size=50_000, batch_cap=512)
    plain = config.trials.trial({"per_gpu_batch_size": 1024}, train_size=50_000)
    assert (capped.micro_batch_size, capped.accumulation_steps) == (512, 2)
    assert capped.global_batch_size == plain.global_batch_size and capped.peak_lr == plain.peak_lr
    assert config.trials.trial({"per_gpu_batch_size": 256}, 50_000, batch_cap=512).micro_splits == 1


def test_max_probe_is_only_for_the_batch_knob(tmp_path):
    ok = load_config(write_spec(tmp_path, "search:\n  per_gpu_batch_size: {choice: [256, 512], max: probe}\n"))
    assert ok.trials.batch_cap == "probe"
    from raysweep.errors import UserError

    with pytest.raises(UserError, match="'max' applies to per_gpu_batch_size only"):
        load_config(write_spec(tmp_path, "search:\n  base_lr: {choice: [1.0e-3], max: 3}\n"))


def test_probe_step_leaves_the_training_state_as_it_found_it_and_catches_oom():
    """A restored trial runs the probe step at start-up: it must leave the checkpoint's moments, step counts,
    loss scale and RNG as they were (it once cleared the optimizer state: every restart forgot AdamW)."""
    torch.manual_seed(0)
    model = CaptchaCNN(24, 64, 4, 36).to(memory_format=torch.channels_last)
    opt = build_optimizer(model, 1e-3, 1e-4, "cpu")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)  # growth every step: any step shows
    net = RankModel(model, model, opt, scaler, "fp32", torch.device("cpu"))
    for _ in range(2):  # a trained state, as a checkpoint restores it
        x, y = torch.rand(8, 1, 24, 64), torch.randint(0, 2, (8, 144)).float()
        scaler.scale(torch.nn.functional.multilabel_soft_margin_loss(model(x), y)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    moments = {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    scale, rng = scaler.state_dict(), torch.get_rng_state()
    assert moments and all(float(s["step"]) == 2 for s in moments.values())

    ok = probe_step(net, _trial(), 32)
    assert ok.fits and ok.step_time_s > 0 and ok.peak_rss_gb > 0 and ok.per_gpu_batch_size == 32
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k  # weights and BatchNorm statistics restored
    assert {id(p) for p in opt.state} == set(moments)
    for p, s in opt.state.items():
        for k, v in s.items():
            assert torch.equal(v, moments[id(p)][k]), k  # exp_avg, exp_avg_sq, step: the checkpoint's
    assert scaler.state_dict() == scale and torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in model.parameters())

    fresh = build_optimizer(model, 1e-3, 1e-4, "cpu")  # a trial's start: no state, and none after the probe
    probe_step(RankModel(model, model, fresh, torch.amp.GradScaler("cpu", enabled=False), "fp32",
                         torch.device("cpu")), _trial(), 32)
    assert not fresh.state

    from raysweep.worker import faults

    real, faults.FAULTS = faults.FAULTS, FaultInjection(oom_above=16)
    try:
        assert not probe_step(net, _trial(), 32).fits
    finally:
        faults.FAULTS = real


_PROBE_AFTER_A_LARGER_STEP = """
import torch
from raysweep.config import ModelConfig
from raysweep.worker.device import setup_device
from raysweep.worker.net import RankModel
from raysweep.worker.probe_step import probe_step
from test_gpu import _trial
torch.set_num_threads(1)
import threading
def probe():  # on a thread, as Ray Train runs a worker's loop (and, by worker_env, on glibc's main arena)
    setup_device(torch.device("cpu"))  # as a CPU worker: glibc keeps freed tensors in its heap (keep_host_memory)
    trial = _trial(batch=32, size=(60, 160))
    net = RankModel.build(trial, torch.device("cpu"))
    print(*(probe_step(net, trial, b).peak_rss_gb for b in (128, 256, 129)))
thread = threading.Thread(target=probe)
thread.start()
thread.join()
"""


@pytest.mark.timeout(300)
def test_a_cpu_probe_step_reads_its_own_peak_not_what_a_larger_step_left_in_the_heap():
    """On a CPU worker the heap keeps what a step freed (device.keep_host_memory), so every probe step after a larger
    one read the larger one's resident memory as its own (at 129-192 after 256: all 'OOM' under --max-memory-gb,
    and the bisection found nothing). Handing the heap's free pages back before each step was not enough once the
    workers allocate from the main arena (trainer.worker_env): the next step's tensors landed in the gaps the larger
    one left, and 129 read 1.57 GiB after 128's 1.33 (device.own_host_blocks). A fresh process with a worker's
    environment, the steps on a thread as in a worker: 128, then 256, then 129."""
    import os
    import subprocess
    import sys

    from raysweep.trainer import worker_env

    from conftest import ROOT

    proc = subprocess.run([sys.executable, "-c", _PROBE_AFTER_A_LARGER_STEP], capture_output=True, text=True,
                          timeout=240, cwd=ROOT / "tests", env={**os.environ, **worker_env()})
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, large, again = map(float, proc.stdout.split())
    assert large > first + 0.3, (first, large)  # 256's step holds more than 128's: the test can tell them apart
    assert again < first + 0.15 * (large - first), (first, large, again)  # one image more than the first


def test_divergence_watch_raises_on_cpu_at_once():
    watch = DivergenceWatch(torch.device("cpu"))
    watch.check(~torch.isfinite(torch.tensor(3.0)), 1, 1)
    with pytest.raises(TrialFailure, match="diverged: non-finite loss or gradient norm at epoch 2, step 7"):
        watch.check(~torch.isfinite(torch.tensor(float("nan"))), 2, 7)


def test_a_failures_kind_travels_typed_through_pickling_and_rays_wrapper():
    import pickle

    from ray.exceptions import RayTaskError

    from raysweep.failures import TrialFailure, kind_of, settled

    failure = TrialFailure("oom", "OOM at per-GPU batch 128 (micro-batch 64 after 1 downshifts)")
    again = pickle.loads(pickle.dumps(failure))  # Tune pickles the trial's error; Ray pickles it across processes
    assert (again.kind, again.message, str(again)) == ("oom", failure.message, failure.message)
    assert failure.failure.raised().failure == failure.failure and failure.final  # the record, raised again
    assert pickle.loads(pickle.dumps(failure.failure)) == failure.failure  # as it crosses to the broker and relay
    # what Tune keeps for a trial function that raised: Ray's wrapper, the failure as its cause (no message parsed)
    import cloudpickle  # as Tune writes a trial's error.pkl

    wrapped = cloudpickle.loads(
        cloudpickle.dumps(RayTaskError("run_trial", "traceback", failure).as_instanceof_cause())
    )
    assert kind_of(wrapped) == "oom"
    assert kind_of(TrialFailure("infra", "worker group lost")) == "infra" and not TrialFailure("infra", "x").final
    assert kind_of(ValueError("OOM at per-GPU batch 128 diverged")) == "error"  # a message says nothing
    with pytest.raises(ValueError, match="not one of"):
        TrialFailure("flaky", "x")
    # what --resume does with a trial, from its run in the store
    from raysweep.failures import Failure, Settled

    assert settled("FINISHED", {}) == Settled()
    assert settled("KILLED", {"stopped_by": "asha"}) == Settled()  # pruned stays pruned
    assert settled("KILLED", {"interrupted": "true"}) is None  # Ctrl-C: it goes on
    assert settled("FAILED", {"failure": "infra", "error": "worker group lost"}) is None
    assert settled("FAILED", {"failure": "diverged", "error": "diverged: at epoch 2"}) == Settled(
        Failure("diverged", "diverged: at epoch 2"))
    assert settled("RUNNING", {}) is None


def test_a_process_that_died_without_raising_is_the_infrastructures_and_what_the_trial_raised_its_own():
    """Ray's own exception objects, as Tune and Train V2 hand them over: a trial actor or a worker whose process
    died (killed from outside, its node lost) is `infra`; an unreadable error too; what the trial's code raised is
    its own (`error`, or `oom` where torch ran out of memory), a peer's collective error beside a death a symptom."""
    import cloudpickle
    import torch
    from ray.exceptions import ActorDiedError, NodeDiedError, RayTaskError, WorkerCrashedError
    from ray.exceptions import OutOfMemoryError as RayOOM
    from ray.train.v2._internal.exceptions import UserExceptionWithTraceback, WorkerHealthCheckFailedError

    from raysweep.failures import kind_of
    from raysweep.slots.actors import group_failure_kind

    def as_tune_keeps(error):
        return cloudpickle.loads(cloudpickle.dumps(error))

    for death in (ActorDiedError(), WorkerCrashedError(), NodeDiedError("node lost"), RayOOM("memory monitor")):
        assert kind_of(as_tune_keeps(death)) == "infra", type(death)
    assert kind_of(None) == "infra"  # the trial's error file could not be read back
    assert kind_of(as_tune_keeps(RayTaskError("run_trial", "tb", KeyError("x")).as_instanceof_cause())) == "error"
    killed = WorkerHealthCheckFailedError("rank 1 died", failure=ActorDiedError())
    peer = UserExceptionWithTraceback(RuntimeError("Connection closed by peer"), "tb")
    raised = UserExceptionWithTraceback(ValueError("bad shape"), "tb")
    oom = UserExceptionWithTraceback(torch.OutOfMemoryError("CUDA out of memory"), "tb")  # no __cause__: _base_exc
    assert group_failure_kind([killed, peer]) == "infra"
    assert group_failure_kind([raised, raised]) == "error"
    assert group_failure_kind([oom, peer]) == "oom"


@pytest.mark.ray
def test_probe_finds_the_injected_limit_exactly(ray_cluster, tmp_path, monkeypatch, capsys):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("RAYSWEEP_TEST_OOM_ABOVE", "96")
    path = write_spec(tmp_path, tiny_spec(tmp_path))
    assert main(["probe", str(path), "--start", "8"]) == 0
    out = capsys.readouterr().out
    assert "largest per-GPU batch that fits: 96" in out and "recommended: 96" in out
    table = json.loads(next((tmp_path / "results" / "t" / "probe").rglob("probe.json")).read_text())
    tried = [(r["per_gpu_batch_size"], r["fits"]) for r in table["results"]]
    assert tried == [(8, True), (16, True), (32, True), (64, True), (128, False),  # doubling
                     (96, True), (112, False), (104, False), (100, False), (98, False), (97, False)]  # bisection
    assert table["world_size"] == 2
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("t").experiment_id], "tags.`raysweep.kind` = 'probe'")
    assert run.data.params["largest_per_gpu_batch"] == "96"
    assert {a.path for a in client.list_artifacts(run.info.run_id)} >= {"probe.json", "probe.png", "spec.yaml"}
    assert [m.step for m in client.get_metric_history(run.info.run_id, "fits")] == sorted(b for b, _ in tried)


@pytest.mark.ray
def test_sweep_survives_oom_and_divergence(ray_cluster, tmp_path, monkeypatch, capsys):
    from mlflow.tracking import MlflowClient
    from ray.tune import ExperimentAnalysis

    monkeypatch.setenv("RAYSWEEP_TEST_OOM_ABOVE", "32")  # 64 fits after one downshift; 128 does not
    monkeypatch.setenv("RAYSWEEP_TEST_NAN_AT_STEP", "10")  # only batch-16 trials take 10 optimizer steps
    spec = tiny_spec(
        tmp_path,
        # 128 per rank: the batch-128 trials have a share to run (a per-GPU batch above it is refused before Ray)
        data={"width": 64, "height": 24, "synthetic": {"train_size": 256, "val_size": 64, "seed": 0}},
        train={"epochs": 2, "reference_batch_size": 64, "max_downshifts": 1},
        search={"per_gpu_batch_size": {"choice": [16, 64, 128], "default": 16},
                "base_lr": {"loguniform": [1.0e-4, 1.0e-3]},
                "warmup_epochs": 0, "weight_decay": 1.0e-4},
        tune={"num_samples": 5, "seed": 3, "asha": {"grace_period": 2, "max_t": 2}},  # no pruning
    )
    assert main(["tune", str(write_spec(tmp_path, spec))]) == 0  # some trials failed; the sweep ran
    analysis = ExperimentAnalysis(str(tmp_path / "results" / "t"))
    status = {t.trial_id: (t.config["per_gpu_batch_size"], t.status) for t in analysis.trials}
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    children = [r for r in client.search_runs([client.get_experiment_by_name("t").experiment_id])
                if "mlflow.parentRunId" in r.data.tags]
    seen = set()
    for run in children:
        batch, tune_status = status[run.info.run_name]
        seen.add(batch)
        if batch == 128:
            assert tune_status == "ERROR" and run.info.status == "FAILED"
            assert run.data.tags["failure"] == "oom" and "OOM at per-GPU batch 128" in run.data.tags["error"]
        elif batch == 16:
            assert tune_status == "ERROR" and run.info.status == "FAILED" and run.data.tags["failure"] == "diverged"
            epochs = [m.step for m in client.get_metric_history(run.info.run_id, "train_loss")]
            assert epochs == [1]  # the finite epoch kept, the diverged one never reported
        else:  # grace_period = max_t: ASHA cannot cut a trial, so every other one finishes
            assert tune_status == "TERMINATED" and run.info.status == "FINISHED"
            p = run.data.params
            # what ran: 64 images a rank per step (128 a rank, 2 steps) OOM'd above 32, so 2 micro-batches of 32
            assert (p["micro_batch_size"], p["accumulation_steps"], p["oom_downshifts"]) == ("32", "2", "1")
            assert p["global_batch_size"] == "128"  # 64 × 2 workers × 1, as sampled
    assert seen == {16, 64, 128}, f"seed 3 no longer samples every batch: {seen}"
