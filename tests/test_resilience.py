"""Sweeps that survive: a worker SIGKILLed mid-trial, the driver SIGKILLed or Ctrl-C'd and resumed, ASHA's
memory across a resume. Real Ray (the session cluster, or a driver process the test starts), real MLflow."""

import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from raysweep.cli import main

from conftest import ROOT, tiny_spec, write_spec
from process_tree import sigkill_driver

_CLIENTS = {}


def _client(tmp_path):
    """One client per store: a new one opens a new engine (seconds of CPU), and polling with fresh ones
    starved the 2-core machine until a trial's workers missed their 60 s start-up window. The product's client:
    these tests poll from a thread of the process whose sweep creates the store, and two creations at once in one
    process break each other (tracking.store.mlflow_client)."""
    from raysweep.tracking.store import mlflow_client

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    if uri not in _CLIENTS:
        _CLIENTS[uri] = mlflow_client(uri)
    return _CLIENTS[uri]


def _children(tmp_path, experiment="t"):
    client = _client(tmp_path)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return []
    return [r for r in client.search_runs([found.experiment_id]) if "mlflow.parentRunId" in r.data.tags]


def _steps(tmp_path, run, metric="val_loss"):
    return [m.step for m in _client(tmp_path).get_metric_history(run.info.run_id, metric)]


def _wait_for(predicate, timeout_s, what):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(1.0)
    raise AssertionError(f"timed out waiting for {what}")


def _train_workers():
    import ray
    from ray.util.state import list_actors

    return [a for a in list_actors(address=ray.get_runtime_context().gcs_address,
                                   filters=[("class_name", "=", "RayTrainWorker"), ("state", "=", "ALIVE")],
                                   raise_on_missing_output=False)]


def _kill_a_worker_after_epoch(tmp_path, epoch, killed: list):
    """In a thread: once MLflow holds `epoch`, SIGKILL one rank of the running trial (by the pid Ray lists)."""
    def run():
        def logged():
            runs = _children(tmp_path)
            return runs and len(_steps(tmp_path, runs[0])) >= epoch

        _wait_for(logged, 240, f"epoch {epoch} in MLflow")
        worker = _wait_for(_train_workers, 60, "a live train worker")[-1]
        os.kill(worker.pid, signal.SIGKILL)
        killed.append(worker.pid)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _losses(tmp_path, run, experiment="t"):
    return {m.step: m.value for m in _client(tmp_path).get_metric_history(run.info.run_id, "train_loss")}


def _final_weights(train_storage, trial_id):
    """The model of a trial's newest Train checkpoint (its last epoch): {name: tensor}."""
    import torch

    from raysweep.layout import CHECKPOINT_FILE

    files = train_storage.glob(f"trial-{trial_id}/checkpoint_*/{CHECKPOINT_FILE}")
    states = [torch.load(f, weights_only=True) for f in files]
    assert states, f"no checkpoint of trial {trial_id} under {train_storage}"
    return max(states, key=lambda s: s["epoch"])["model"]


def _assert_twins(weights, twin_weights, what):
    """Bitwise: CPU kernels at a fixed thread count and gloo's sum of two ranks are deterministic."""
    import torch

    assert weights.keys() == twin_weights.keys()
    diff = max(float((weights[k].double() - twin_weights[k].double()).abs().max()) for k in weights)
    assert diff == 0.0, f"{what}: final weights differ from the uninterrupted twin's by up to {diff:.3g}"
    assert all(torch.equal(weights[k], twin_weights[k]) for k in weights)


@pytest.mark.ray
@pytest.mark.timeout(480)
def test_worker_killed_mid_trial_restarts_from_its_checkpoint_and_ends_as_its_uninterrupted_twin(ray_cluster, tmp_path,
                                                                                                capsys):
    # checkpoints every 2 epochs: a rank killed during epoch 4 restarts from epoch 2, so epoch 3 is
    # reported a second time; MLflow must still hold one value per (metric, epoch); and the restarted trial must
    # be the trial it would have been: the same losses and weights as the same spec run without a kill
    # 1,536 images: an epoch of about 1.5 s here, longer than MLflow's write of epoch 3 and the kill that follows
    # it (with 384, an epoch took 0.4 s on a fast machine and the kill landed after epoch 4's checkpoint)
    spec = tiny_spec(tmp_path, data={"width": 64, "height": 24, "synthetic": {"train_size": 1536, "val_size": 64}},
                     train={"epochs": 5, "reference_batch_size": 64, "checkpoint_every": 2, "max_failures": 1})
    killed = []
    thread = _kill_a_worker_after_epoch(tmp_path, 3, killed)
    assert main(["train", str(write_spec(tmp_path, spec))]) == 0
    thread.join(timeout=10)
    assert killed, "no worker was killed"
    (run,) = _children(tmp_path)
    assert run.info.status == "FINISHED"
    from raysweep.metrics import METRIC_NAMES, TARGET_NAMES

    for name in (n for n in METRIC_NAMES if n not in TARGET_NAMES):  # no tune.target: no time to it
        steps = _steps(tmp_path, run, name)
        if name == "grad_noise_scale":  # absent at an epoch whose estimate of |G|² came out ≤ 0 (noise.py)
            assert steps == sorted(set(steps)) and set(steps) <= {1, 2, 3, 4, 5}, steps
        else:
            assert steps == [1, 2, 3, 4, 5], name  # each epoch once, none lost
    samples = {m.step: m.value for m in _client(tmp_path).get_metric_history(run.info.run_id, "samples_seen")}
    assert samples[5] == 5 * 1536  # the restart resumed the count from the checkpoint, not from zero
    # the clock: epoch 3 was trained twice (its first run's seconds are in no checkpoint), so the re-run's clock goes
    # on from the first run's reported one, and epoch 4's counts the re-run once (before, it went on from epoch 2's
    # and the lost run vanished: the re-run's clock came out about where the first run's had). The re-run is read
    # where the driver printed it (MLflow keeps one value an epoch, the first) and held against epoch 4, its
    # neighbour on the same group: a fresh-clone run failed an earlier form that held epoch 4's step against epochs
    # 2 and 3, trained before the kill while the other lane was busier (4.5-4.8 s against 3.1-3.8 s after it)
    clock = {m.step: m.value for m in _client(tmp_path).get_metric_history(run.info.run_id, "train_seconds")}
    step = {e: clock[e] - clock[e - 1] for e in (2, 3, 4, 5)}
    assert min(step.values()) > 0, clock
    printed = [(int(e), float(s)) for e, s in re.findall(r"^epoch (\d)/5 .* ([\d.]+) s trained$",
                                                         capsys.readouterr().out, re.M)]
    thirds = [s for e, s in printed if e == 3]
    assert len(thirds) == 2, printed  # epoch 3 twice: before the kill, and again after it
    first, rerun = thirds
    assert first == pytest.approx(clock[3], abs=0.06), (printed, clock)  # printed to 0.1 s
    assert rerun - first > 0.5 * (clock[4] - rerun), (printed, clock)  # the re-run's own seconds, added

    twin_dir = tmp_path / "twin"
    twin_dir.mkdir()
    twin_spec = {**spec, "storage_path": str(twin_dir / "results"),
                 "mlflow": {"tracking_uri": f"sqlite:///{twin_dir / 'mlflow.db'}"}}
    assert main(["train", str(write_spec(twin_dir, twin_spec))]) == 0
    (twin,) = _children(twin_dir)
    assert _losses(tmp_path, run) == _losses(twin_dir, twin)  # epochs 3-5 ran after the restart
    _assert_twins(_final_weights(tmp_path / "results" / "t-train" / "train", run.data.tags["trial_id"]),
                  _final_weights(twin_dir / "results" / "t-train" / "train", twin.data.tags["trial_id"]),
                  "worker killed")


@pytest.mark.ray
def test_trial_whose_restarts_are_spent_ends_failed_with_the_cause(ray_cluster, tmp_path, capsys):
    # a worker SIGKILLed died without raising: the infrastructure's failure (failures.py), so with its restarts and
    # infra retries spent the trial fails as `infra`, which --resume continues (it was `error`, never run again)
    spec = tiny_spec(tmp_path, data={"width": 64, "height": 24, "synthetic": {"train_size": 384, "val_size": 64}},
                     train={"epochs": 4, "reference_batch_size": 64, "max_failures": 0, "max_infra_retries": 0})
    killed = []
    thread = _kill_a_worker_after_epoch(tmp_path, 1, killed)
    assert main(["train", str(write_spec(tmp_path, spec))]) == 1  # no trial succeeded
    thread.join(timeout=10)
    assert killed
    (run,) = _children(tmp_path)
    assert run.info.status == "FAILED"
    error = run.data.tags["error"]
    assert error.startswith("worker died: a training worker process was killed or crashed"), error
    assert run.data.tags["failure"] == "infra"
    assert _steps(tmp_path, run)[0] == 1  # the epochs before the crash stay recorded


@pytest.mark.ray
@pytest.mark.timeout(240)
def test_a_store_that_refuses_the_clock_ends_the_trial_as_the_infrastructures_failure(ray_cluster, tmp_path, capsys):
    """train.checkpoint_every 3: epochs 1 and 2 leave only their clock (rank 0 writes it off the epoch's path). Once
    epoch 1's is written, its file becomes a folder: the store refuses epoch 2's. A restart would forget those
    seconds, so the trial stops at its next report and fails as `infra` (it resumes from its checkpoint on another
    group within train.max_infra_retries; 0 here), not as its own `error`, which --resume never runs again."""
    from raysweep.layout import CLOCK_FILE

    spec = tiny_spec(tmp_path, data={"width": 64, "height": 24, "synthetic": {"train_size": 384, "val_size": 64}},
                     train={"epochs": 4, "reference_batch_size": 64, "checkpoint_every": 3, "max_infra_retries": 0})
    broken = []

    def break_the_clock():
        deadline = time.monotonic() + 200
        while time.monotonic() < deadline:
            found = list((tmp_path / "results").glob(f"t-train/train/trial-*/{CLOCK_FILE}"))
            if found:
                found[0].unlink()
                found[0].mkdir()
                broken.append(found[0])
                return
            time.sleep(0.02)

    thread = threading.Thread(target=break_the_clock, daemon=True)
    thread.start()
    assert main(["train", str(write_spec(tmp_path, spec))]) == 1  # no trial succeeded
    thread.join(timeout=10)
    assert broken, "no clock was written"
    (run,) = _children(tmp_path)
    assert run.info.status == "FAILED" and run.data.tags["failure"] == "infra"
    assert "the trial's clock could not be written under" in run.data.tags["error"], run.data.tags["error"]
    assert "IsADirectoryError" in run.data.tags["error"]
    assert _steps(tmp_path, run) == [1, 2]  # epoch 3's report never went: the trial stopped before it


def test_resumed_asha_keeps_its_rungs_and_cuts_against_them():
    """Ray does not save the scheduler (#30838); the RungKeeper callback does, and a restored scheduler
    cuts a new trial against the rungs recorded before the crash."""
    import ray.cloudpickle as cloudpickle
    from ray.tune.schedulers import ASHAScheduler, TrialScheduler

    from raysweep.asha import RungKeeper

    class Trial:
        def __init__(self, trial_id):
            self.trial_id = trial_id

    def fresh():
        scheduler = ASHAScheduler(time_attr="epoch", metric="val_loss", mode="min", max_t=4, grace_period=1,
                                  reduction_factor=2)
        return scheduler, RungKeeper(scheduler)

    before, keeper = fresh()
    for trial_id, loss in (("a", 0.5), ("b", 0.4), ("c", 0.6)):
        before.on_trial_add(None, Trial(trial_id))
        before.on_trial_result(None, Trial(trial_id), {"epoch": 1, "val_loss": loss})
    state = keeper.get_state()  # what Tune saves with the experiment

    def decision(restore: bool):
        scheduler, callback = cloudpickle.loads(cloudpickle.dumps(fresh()))  # as Tuner.restore unpickles them
        assert callback.scheduler is scheduler
        if restore:
            callback.set_state(state)
        scheduler.on_trial_add(None, Trial("d"))
        return scheduler.on_trial_result(None, Trial("d"), {"epoch": 1, "val_loss": 0.9})

    assert decision(restore=True) == TrialScheduler.STOP  # 0.9 is worse than the pre-crash cutoff
    assert decision(restore=False) == TrialScheduler.CONTINUE  # what Ray alone does: an empty rung cuts nothing


def test_resumed_asha_refills_its_rungs_from_the_store_past_tunes_last_save(tmp_path):
    """Tune saves the RungKeeper's state every few seconds; a trial recorded at a rung after the last save (and
    before a crash) is in the MLflow store only. On restore the rungs are replayed from it (in seconds here), so
    the rung cuts as it did, and a resumed trial is not judged again at a rung it passed."""
    import ray.cloudpickle as cloudpickle
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient
    from ray.tune.schedulers import ASHAScheduler, TrialScheduler

    from raysweep.asha import RungKeeper

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    experiment = client.create_experiment("t")
    parent = client.create_run(experiment).info.run_id
    histories = {"a": [(2.0, 0.5), (4.0, 0.3)], "b": [(3.0, 0.4), (6.0, 0.2)], "c": [(2.5, 0.6)]}
    for trial_id, reports in histories.items():
        run = client.create_run(experiment, run_name=trial_id, tags={"mlflow.parentRunId": parent,
                                                                      "trial_id": trial_id}).info.run_id
        client.log_batch(run, metrics=[Metric(k, v, 0, epoch) for epoch, (t, loss) in enumerate(reports, 1)
                                       for k, v in (("train_seconds", t), ("val_loss", loss))])

    class Trial:
        def __init__(self, trial_id):
            self.trial_id = trial_id

    def fresh():
        scheduler = ASHAScheduler(time_attr="train_seconds", metric="val_loss", mode="min", max_t=8, grace_period=2,
                                  reduction_factor=2)
        return scheduler, RungKeeper(scheduler, uri, parent)

    saved = fresh()[1].get_state()  # Tune's last save came before any trial reached a rung
    scheduler, callback = cloudpickle.loads(cloudpickle.dumps(fresh()))
    callback.set_state(saved)
    rungs = {milestone: recorded for milestone, recorded in scheduler._brackets[0]._rungs}
    assert rungs[2.0] == {"a": -0.5, "b": -0.4, "c": -0.6}  # each at its first report at or past 2 s
    assert rungs[4.0] == {"a": -0.3, "b": -0.2}  # b's 6 s report is its first past 4 s
    scheduler.on_trial_add(None, Trial("d"))
    assert scheduler.on_trial_result(None, Trial("d"), {"train_seconds": 2.0, "val_loss": 0.9}) == TrialScheduler.STOP
    # a state of another unit is not used; the store still refills
    other = {**saved, "time_attr": "epoch", "rungs": [[(m, {"zzz": -0.01}) for m, _ in b] for b in saved["rungs"]]}
    scheduler, callback = cloudpickle.loads(cloudpickle.dumps(fresh()))
    callback.set_state(other)
    assert "zzz" not in scheduler._brackets[0]._rungs[-1][1] and "a" in scheduler._brackets[0]._rungs[-1][1]


# ---------------------------------------------------------------------------------------------
# A restart is exact: the rank code of a run restored from a checkpoint continues as the uninterrupted run would


def _run_with_a_restart(rank: int, world: int, device_type: str, folder: str, factory: str | None = None,
                        restart_after: int = 2) -> dict:
    """Four epochs of a 2-rank DDP run (dropout, warmup, accumulation, the noise meter), checkpointed after epoch
    `restart_after` and run on uninterrupted; then the run dropped and rebuilt from that checkpoint (start-up probe
    included), as a restarted worker group does, and its last epochs run again. `factory`: a model of the user's
    (examples/models/) instead of the built-in CNN. Returns each epoch's train loss and the final weights of both:
    {"twin": ..., "restarted": ...}. One set of processes for both runs: the restarted one is rebuilt from the
    file alone, after the twin moved every global random stream on (the run seeds its own per epoch)."""
    import torch
    from torch import nn

    from raysweep.worker.run import TrainingRun

    from test_gpu import _data, _trial

    cuda = device_type == "cuda"
    device = torch.device("cuda:0" if cuda else "cpu")
    trial = _trial(batch=16, accum=2, n=256, precision="bf16" if cuda else "fp32", dropout=0.3, epochs=4,
                   world=world, warmup=1)
    if factory is not None:
        from raysweep.config import ModelConfig

        trial = trial.model_copy(update={"model": ModelConfig(factory=factory, kwargs={"width": 8})})
    data = _data(256)

    def started(state):
        run = TrainingRun.build(trial, data, rank, world, device, wrap=lambda m: nn.parallel.DistributedDataParallel(m))
        start = run.restore(state)
        run.fit_in_memory()  # the OOM check at start-up, as every (re)started rank runs it
        return run, start

    def kept(run, name: str) -> str:
        # the weights in a file: a queue's pipe holds 64 KiB, and the spawned rank cannot exit before it is read
        path = os.path.join(folder, f"weights-{name}-rank{rank}.npz")
        np.savez(path, **{k: v.detach().cpu().numpy() for k, v in run.net.core.state_dict().items()})
        return path

    path = os.path.join(folder, f"state-rank{rank}.pt")
    run, start = started(None)
    twin = {}
    for epoch in range(start, trial.train.epochs + 1):
        twin[epoch] = run.epoch(epoch).train_loss
        if epoch == restart_after:
            torch.save(run.state(epoch, {}), path)  # as the checkpoint saves it, read back as entry.load_latest does
    out = {"twin": {"losses": twin, "weights": kept(run, "twin")}}
    del run
    run, resumed_at = started(torch.load(path, map_location=device, weights_only=True))
    assert resumed_at == restart_after + 1
    restarted = {epoch: twin[epoch] for epoch in range(1, resumed_at)}  # the epochs before the checkpoint: the same
    for epoch in range(resumed_at, trial.train.epochs + 1):
        restarted[epoch] = run.epoch(epoch).train_loss
    out["restarted"] = {"losses": restarted, "weights": kept(run, "restarted")}
    return out


@pytest.mark.parametrize("device_type,factory", [("cpu", None), ("cpu", "resnet:build"), ("cpu", "crnn:build"),
                                                 pytest.param("cuda", None, marks=[pytest.mark.gpu, pytest.mark.skipif(
                                                     "not __import__('torch').cuda.is_available()",
                                                     reason="needs a CUDA device")])])
def test_a_run_restored_from_its_checkpoint_continues_exactly_as_the_uninterrupted_run(device_type, factory, tmp_path,
                                                                                       monkeypatch):
    """The rank code of a worker restart and of `--resume` (the Ray paths are the sweep tests below), for the
    built-in CNN and for users' models (examples/models/: BatchNorm's running statistics, a GRU). CPU: bitwise
    (gloo sums two ranks, CPU kernels are deterministic at a fixed thread count). CUDA: cuDNN's backward may
    accumulate in any order, so 1e-3 relative: a restart that forgets AdamW moved epoch 3's loss by 10-20 %."""
    from conftest import EXAMPLE_MODELS
    from ranks import run_ranks

    monkeypatch.syspath_prepend(str(EXAMPLE_MODELS))  # the spawned ranks start with this process's sys.path
    both = run_ranks(_run_with_a_restart, 2, device_type=device_type, folder=str(tmp_path), factory=factory)[0]
    twin, restarted = both["twin"], both["restarted"]
    exact = device_type == "cpu"
    assert sorted(restarted["losses"]) == sorted(twin["losses"]) == [1, 2, 3, 4]
    for epoch, loss in twin["losses"].items():
        got = restarted["losses"][epoch]
        assert got == loss if exact else abs(got - loss) <= 1e-3 * abs(loss), (epoch, got, loss)
    twin_weights, restarted_weights = np.load(twin["weights"]), np.load(restarted["weights"])
    for name, weight in twin_weights.items():
        other = restarted_weights[name]
        assert np.array_equal(other, weight) if exact else np.allclose(other, weight, rtol=1e-3, atol=1e-5), name


# ---------------------------------------------------------------------------------------------
# Files that cannot tear


def test_raysweeps_own_files_are_never_seen_half_written(tmp_path):
    """storage.write_bytes (checkpoints, the probe table, the report, the compile cache's artifacts): a
    reader, or a kill, between its first byte and its last finds the old file or the new, never a part."""
    from raysweep import storage

    target = str(tmp_path / "marker.json")
    payloads = [b"a" * (8 << 20), b"b" * (8 << 20)]
    storage.write_bytes(target, payloads[0])
    done, seen = threading.Event(), []

    def write():
        for i in range(30):
            storage.write_bytes(target, payloads[i % 2])
        done.set()

    writer = threading.Thread(target=write)
    writer.start()
    while not done.is_set():
        data = storage.read_bytes(target)
        seen.append(data in payloads)
    writer.join()
    assert seen and all(seen), f"{seen.count(False)} of {len(seen)} reads saw a torn file"
    assert os.listdir(tmp_path) == ["marker.json"]  # no temporary file left behind


# ---------------------------------------------------------------------------------------------
# The driver killed: SIGINT (Ctrl-C) and SIGKILL, each followed by `tune --resume`, in driver processes the
# test starts (each starts its own local Ray cluster, 2 CPUs).


def _start_driver(spec_path, log_path, *extra):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log_path, "w") as log:
        return subprocess.Popen([sys.executable, "-m", "raysweep", "tune", str(spec_path), *extra], cwd=ROOT, env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _kill_tree(proc, sig):
    """Send `sig` to the driver; with SIGKILL also stop what it started (Ray's agents can outlive it), by pid:
    process_tree.sigkill_driver, which benchmarks/soak.py uses too."""
    if sig != signal.SIGKILL:
        os.kill(proc.pid, sig)
        return
    sigkill_driver(proc)


def _running_trial_at_epoch(tmp_path, epoch):
    def check():
        for run in _children(tmp_path):
            if run.info.status == "RUNNING" and len(_steps(tmp_path, run)) >= epoch:
                return run
        return None

    return check


@pytest.mark.ray
@pytest.mark.long
@pytest.mark.timeout(600)
def test_driver_ctrl_c_and_sigkill_then_resume_finish_every_trial(ray_cluster, tmp_path):
    spec = tiny_spec(
        tmp_path,
        data={"width": 64, "height": 24, "synthetic": {"train_size": 384, "val_size": 64}},
        train={"epochs": 4, "reference_batch_size": 64},
        # four identical trials: the interrupted ones must end exactly as the ones that never were (their twins)
        search={"per_gpu_batch_size": 16, "base_lr": 2.0e-3, "warmup_epochs": 1, "weight_decay": 1.0e-4},
        # no pruning (grace = max_t): every trial runs 4 epochs, so the kills below find one mid-run
        # (ASHA's memory across a resume is the unit test above)
        tune={"num_samples": 4, "seed": 0, "asha": {"grace_period": 4, "reduction_factor": 2}},
    )
    path = write_spec(tmp_path, spec)

    # 1. Ctrl-C while a trial is at epoch 2: exit 130, the resume hint, nothing left RUNNING in MLflow
    driver = _start_driver(path, tmp_path / "run1.log")
    try:
        # the driver creates and migrates the store before a trial starts: a client opened earlier migrates it too,
        # and two processes migrating one SQLite file failed the driver (alembic's CommandError) on a busy machine
        _wait_for(lambda: "] start " in (tmp_path / "run1.log").read_text(), 240, "the driver's first trial")
        _wait_for(_running_trial_at_epoch(tmp_path, 2), 240, "a trial at epoch 2")
        _kill_tree(driver, signal.SIGINT)
        assert driver.wait(timeout=120) == 130
    finally:
        if driver.poll() is None:
            _kill_tree(driver, signal.SIGKILL)
    out = (tmp_path / "run1.log").read_text()
    assert f"raysweep: interrupted (resume with: python -m raysweep tune {path} --resume)" in out, out[-3000:]
    assert all(r.info.status != "RUNNING" for r in _children(tmp_path))

    # 2. resume, then SIGKILL while a trial runs past its first checkpoint
    driver = _start_driver(path, tmp_path / "run2.log", "--resume")
    try:
        def a_running_trial_after_one_ended():
            ended = [r for r in _children(tmp_path) if r.info.status in ("FINISHED", "KILLED", "FAILED")]
            return len(ended) >= 1 and _running_trial_at_epoch(tmp_path, 2)()

        victim = _wait_for(a_running_trial_after_one_ended, 300, "a trial ended and another at epoch 2")
        _kill_tree(driver, signal.SIGKILL)
    finally:
        if driver.poll() is None:
            _kill_tree(driver, signal.SIGKILL)
    assert "resumed: " in (tmp_path / "run2.log").read_text()
    logged_before = len(_steps(tmp_path, victim))

    # 3. resume again: every trial ends, the killed one continues from its checkpoint
    resumed_at = int(time.time())
    driver = _start_driver(path, tmp_path / "run3.log", "--resume", "--progress-every", "0.5")
    try:
        assert driver.wait(timeout=300) == 0
    finally:
        if driver.poll() is None:
            _kill_tree(driver, signal.SIGKILL)
    out = (tmp_path / "run3.log").read_text()
    match = re.search(r"resumed: (\d+) done, (\d+) running(?: from epoch [\d, ]+)?, (\d+) pending", out)
    assert match and sum(map(int, match.groups())) == 4, out[-3000:]
    assert "sweep: 4 trials" in out
    # the restored sweep prints to this driver's console: its --progress-every (the first driver's was 30 s), and
    # the start-up of the trials it ran in its summary (before, the restored callback kept them from it)
    assert out.count("] progress") >= 5, out[-3000:]
    assert "trial start → first step" in out, out[-3000:]

    children = _children(tmp_path)
    assert len(children) == 4 and len({r.info.run_name for r in children}) == 4  # the same runs, reused
    client = _client(tmp_path)
    (parent,) = [r for r in client.search_runs([children[0].info.experiment_id]) if r.info.run_id ==
                 children[0].data.tags["mlflow.parentRunId"]]
    assert parent.info.status == "FINISHED"
    for run in children:
        assert run.info.status in ("FINISHED", "KILLED"), run.info.run_name  # nothing left RUNNING
        steps = _steps(tmp_path, run)
        assert steps == list(range(1, len(steps) + 1)), (run.info.run_name, steps)  # one value per epoch
    (victim_after,) = [r for r in children if r.info.run_name == victim.info.run_name]
    assert len(_steps(tmp_path, victim_after)) >= logged_before
    # the killed trial continued from its Train checkpoint: what it reported after the resume starts past epoch 1
    (result_file,) = (tmp_path / "results" / "t").glob(f"run_trial_{victim.info.run_name}_*/result.json")
    import json

    after = [json.loads(line) for line in result_file.read_text().splitlines() if line.strip()]
    after = [r["epoch"] for r in after if r["timestamp"] >= resumed_at and "epoch" in r]
    assert after and min(after) > 1, after
    # and it is the trial it would have been: every trial (Ctrl-C'd, SIGKILLed, or never interrupted) has the same
    # per-epoch losses and the same final weights, bitwise
    losses = {r.info.run_name: _losses(tmp_path, r) for r in children}
    assert all(len(v) == 4 for v in losses.values()) and len(set(map(str, losses.values()))) == 1, losses
    train = tmp_path / "results" / "t" / "train"
    first, *others = [_final_weights(train, r.info.run_name) for r in children]
    for run, weights in zip(children[1:], others, strict=True):
        _assert_twins(weights, first, f"trial {run.info.run_name}")


def test_a_warm_groups_checkpoints_keep_the_newest_two_and_a_torn_newest_falls_back(tmp_path):
    """On a warm group a trial's checkpoints are raysweep's own files in its folder (entry.save_checkpoint):
    the newest two are kept, the newest unreadable one is skipped for the one before, none readable → None."""
    import torch

    from raysweep.layout import CHECKPOINT_FILE, KEPT_CHECKPOINTS, last_checkpoint_epoch
    from raysweep.worker.entry import load_latest, save_checkpoint

    run_dir = str(tmp_path / "trial-x")
    assert load_latest(run_dir, torch.device("cpu")) is None and last_checkpoint_epoch(run_dir) == 0
    for epoch in (1, 2, 3, 10):
        save_checkpoint(run_dir, epoch, {"epoch": epoch})
    kept = sorted(p.name for p in (tmp_path / "trial-x").iterdir())
    assert kept == ["checkpoint_000003", "checkpoint_000010"] and KEPT_CHECKPOINTS == 2
    assert last_checkpoint_epoch(run_dir) == 10
    assert load_latest(run_dir, torch.device("cpu"))["epoch"] == 10
    newest = tmp_path / "trial-x" / "checkpoint_000010" / CHECKPOINT_FILE
    newest.write_bytes(newest.read_bytes()[:20])  # torn
    assert load_latest(run_dir, torch.device("cpu"))["epoch"] == 3
    (tmp_path / "trial-x" / "checkpoint_000003" / CHECKPOINT_FILE).write_bytes(b"")
    assert load_latest(run_dir, torch.device("cpu")) is None
