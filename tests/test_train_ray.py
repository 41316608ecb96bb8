"""One trial on the real local Ray cluster: 2 CPU workers, gloo, real MLflow on SQLite."""

import signal
import time

import pytest

from raysweep.cli import main
from raysweep.config import load_config
from raysweep.metrics import METRIC_NAMES, TARGET_NAMES

from conftest import tiny_spec, write_spec

pytestmark = pytest.mark.ray


def _child_runs(tmp_path):
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=["t"], output_format="list")
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    return parents, children


def test_train_command_three_epochs_two_workers(ray_cluster, tmp_path, capsys):
    from mlflow.tracking import MlflowClient

    path = write_spec(tmp_path, tiny_spec(tmp_path))
    assert main(["train", str(path)]) == 0
    out = capsys.readouterr().out
    epoch_lines = [ln for ln in out.splitlines() if ln.startswith("epoch ")]
    assert [ln.split()[1] for ln in epoch_lines] == ["1/3", "2/3", "3/3"]
    assert "samples/s" in epoch_lines[0] and "val_exact_acc" in epoch_lines[0]
    assert "summary: 3 epochs" in out and "mlflow ui --backend-store-uri sqlite:///" in out

    parents, children = _child_runs(tmp_path)
    assert len(parents) == 1 and len(children) == 1
    child = children[0]
    assert child.info.status == "FINISHED"
    assert child.data.params["global_batch_size"] == "32" and child.data.params["world_size"] == "2"
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    values = {}
    for name in METRIC_NAMES:  # every metric of DESIGN.md, every epoch
        values[name] = {m.step: m.value for m in client.get_metric_history(child.info.run_id, name)}
        if name in TARGET_NAMES:  # only with a tune.target
            assert not values[name], name
        elif name != "grad_noise_scale":
            assert sorted(values[name]) == [1, 2, 3], name
    # B_noise = tr(Σ) / |G|² wherever both smoothed parts came out positive (2 workers: a pair every step)
    positive = [e for e in (1, 2, 3) if values["grad_sq_norm"][e] > 0 and values["grad_trace_cov"][e] > 0]
    assert sorted(values["grad_noise_scale"]) == positive and positive, values
    for e in positive:
        assert values["grad_noise_scale"][e] == pytest.approx(values["grad_trace_cov"][e] / values["grad_sq_norm"][e])
    assert any(f"B_noise {values['grad_noise_scale'][e]:,.0f}" in epoch_lines[e - 1] for e in positive)
    assert set(values["compile_s"].values()) == {0.0}  # train.compile auto: not on CPU workers
    assert not any("compiled in" in line for line in epoch_lines)
    loss = {m.step: m.value for m in client.get_metric_history(child.info.run_id, "train_loss")}
    assert loss[3] < loss[1]
    samples = {m.step: m.value for m in client.get_metric_history(child.info.run_id, "samples_seen")}
    assert samples == {1: 192, 2: 384, 3: 576}
    # where the trial's start-up went, once, with epoch 1; the phases add up to trial start → first step
    from raysweep.metrics import STARTUP_NAMES

    startup = {}
    for name in STARTUP_NAMES:
        (m,) = client.get_metric_history(child.info.run_id, name)
        assert m.step == 1
        startup[name] = m.value
    assert startup["startup_s"] == pytest.approx(sum(v for k, v in startup.items() if k != "startup_s"), abs=1e-6)
    assert 0 < startup["startup_s"] < 300 and startup["startup_model_s"] > 0 and startup["startup_probe_s"] > 0
    started = next(ln for ln in out.splitlines() if ln.startswith("started in "))
    assert f"started in {startup['startup_s']:.1f}s (driver " in started and " · probe " in started
    parent = parents[0]
    assert 0 < parent.data.metrics["busy_share"] < 1
    assert f"busy {parent.data.metrics['busy_share']:.0%}: 1 slot × " in out


def _fit(tmp_path, name, overrides, data_ref):
    """Fit one TorchTrainer of one trial (tests/one_trial.py); returns the trial and every report rank 0 made, in
    order."""
    import json

    import ray.train

    from raysweep.trainer import make_trainer

    from one_trial import one_trial_worker

    log = tmp_path / f"{name}.reports.jsonl"

    class RecordReports(ray.train.UserCallback):  # runs in the controller, on this machine
        def after_report(self, run_context, metrics, checkpoint):
            with open(log, "a") as f:
                f.write(json.dumps(metrics[0]) + "\n")

    log.unlink(missing_ok=True)
    config = load_config(write_spec(tmp_path, tiny_spec(tmp_path)), overrides)
    trial = config.trials.trial(config.trials.default_knobs(), train_size=192)
    make_trainer(trial, data_ref, str(tmp_path / "runs"), name, [RecordReports()], worker_fn=one_trial_worker).fit()
    return trial, [json.loads(line) for line in log.read_text().splitlines()]


@pytest.fixture
def data_ref(ray_cluster, tmp_path):
    from raysweep.data import load_data

    config = load_config(write_spec(tmp_path, tiny_spec(tmp_path)))
    return ray_cluster.put(load_data(config.data))


def test_accumulation_gives_same_global_batch_and_steps(tmp_path, data_ref):
    from raysweep.optim import lr_at

    common = ["train.epochs=2", "search.warmup_epochs=0"]
    one, r_one = _fit(tmp_path, "accum-1", [*common, "search.per_gpu_batch_size=32"], data_ref)
    two, r_two = _fit(tmp_path, "accum-2", [*common, "search.per_gpu_batch_size=16", "search.grad_accum_steps=2"],
                      data_ref)
    assert one.global_batch_size == two.global_batch_size == 64
    assert one.steps_per_epoch == two.steps_per_epoch == 3 and one.total_steps == 6
    # after epoch 1 the scheduler has stepped exactly 3 times: halfway down the cosine, an LR that 0, 2,
    # 4 or 6 steps (once per micro-batch, or never) would not give
    schedule = (one.peak_lr, one.train.min_lr, one.warmup_steps, one.total_steps)
    for reports in (r_one, r_two):
        assert reports[0]["lr"] == pytest.approx(lr_at(3, *schedule), rel=1e-9)
        assert all(reports[0]["lr"] != pytest.approx(lr_at(k, *schedule), rel=1e-3) for k in (0, 2, 4, 6))
        assert reports[-1]["samples_seen"] == 2 * 192


def test_a_trial_starts_no_dataset_manager_preemption_watcher_placement_group_cleaner_or_autoscaling_coordinator(
        tmp_path, data_ref):
    """Each of those is one more Python process to start before the first report (benchmarks/ray_overhead.py); the
    cleaner also asks the State API every second for as long as its trainer lives, and the coordinator, detached,
    wakes as every Ray process does for as long as the cluster lives (benchmarks/ray_idle.py).

    The coordinator is the cluster's, not the run's: the first trainer that asks creates it. So this test looks at the
    whole cluster, and the session's tests fit raysweep's trainer class only (a bare `TorchTrainer` would create it)."""
    import ray
    from ray.util.state import list_actors

    gcs = ray.get_runtime_context().gcs_address

    def actors():  # alive or dead: the GCS keeps the records of finished actors
        return {a.actor_id: a.class_name for a in list_actors(address=gcs, limit=10_000,
                                                              raise_on_missing_output=False)}

    before, handler = actors(), signal.getsignal(signal.SIGINT)
    _, reports = _fit(tmp_path, "helpers", ["train.epochs=1", "search.warmup_epochs=0"], data_ref)
    assert [r["epoch"] for r in reports] == [1]
    started = [name for actor_id, name in actors().items() if actor_id not in before]  # this run's only
    assert started.count("RayTrainWorker") == 2  # the query sees this run's actors
    assert "TrainController" in started
    assert not {"DatasetManager", "PreemptionWatcher", "PlacementGroupCleaner"} & set(started), started
    assert "_AutoscalingCoordinatorActor" not in actors().values()
    # and none outlives its fit() (called here on the main thread, where Train V2 leaves a SIGINT handler
    # holding its controller: trainer._trainer_class puts the old one back); Ray ends actors asynchronously
    mine = {actor_id for actor_id, name in actors().items()
            if actor_id not in before and name in ("TrainController", "RayTrainWorker")}
    deadline = time.monotonic() + 30
    while alive := [a.class_name for a in list_actors(address=gcs, filters=[("state", "=", "ALIVE")], limit=10_000,
                                                      raise_on_missing_output=False) if a.actor_id in mine]:
        assert time.monotonic() < deadline, f"alive after fit() returned: {alive}"
        time.sleep(0.5)
    assert signal.getsignal(signal.SIGINT) is handler


def _where_the_loop_thread_allocates(config: dict) -> None:
    """A Ray Train worker, set up for the CPU as raysweep's are (worker.device.keep_host_memory): whether its loop runs
    on the process's main thread, and the bytes glibc mapped for one 160 MB tensor (mallinfo2's mmapped bytes)."""
    import ctypes
    import json
    import os
    import threading

    import ray.train
    import torch

    from raysweep.worker.device import keep_host_memory

    class Mallinfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                         "fsmblks", "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = Mallinfo2
    assert keep_host_memory(torch.device("cpu"))
    before = libc.mallinfo2().hblkhd
    block = torch.ones(160 * 2**20, dtype=torch.uint8)
    mapped = libc.mallinfo2().hblkhd - before
    del block
    rank = ray.train.get_context().get_world_rank()
    with open(os.path.join(config["out"], f"rank{rank}.json"), "w") as f:
        json.dump({"main_thread": threading.current_thread() is threading.main_thread(), "mapped": mapped}, f)


def test_a_cpu_workers_loop_thread_keeps_large_blocks_in_glibcs_heap(tmp_path, ray_cluster):
    """Ray Train runs the loop on a thread of the worker, not its main one, and glibc gives each new thread an arena
    of its own whose heaps hold at most 64 MB (HEAP_MAX_SIZE, glibc's malloc/arena.c): a larger tensor was mapped
    fresh and unmapped when freed, every step, whatever keep_host_memory had set (its settings reach the main arena
    only). On the quickstart's images at per-GPU 192 an epoch took 7.42 s that way and 5.59 s with every thread on
    the main arena (benchmarks/worker_arena.py). worker_env gives the workers one arena."""
    import json
    import sys

    import ray

    from raysweep.trainer import make_trainer

    config = load_config(write_spec(tmp_path, tiny_spec(tmp_path)))
    trial = config.trials.trial(config.trials.default_knobs(), train_size=192)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import a test module
    make_trainer(trial, None, str(tmp_path / "runs"), "arena", worker_fn=_where_the_loop_thread_allocates,
                 extra_config={"out": str(tmp_path)}).fit()
    seen = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(trial.scaling.num_workers)]
    assert not any(s["main_thread"] for s in seen), seen  # what makes the arena matter: the loop is on a thread
    assert all(s["mapped"] == 0 for s in seen), seen  # before: 167772160 (and more) on each rank


SHARED_GPU_DRIVER = r"""
import json, os, sys
import ray
from raysweep.cluster import ray_init_kwargs
from raysweep.trainer import make_trainer
from raysweep.config import load_config

out = sys.argv[2]

def worker(config):  # what each rank got: Ray's GPU share, the device Ray Train names, the process group
    import ray.train, ray.train.torch, torch, torch.distributed as dist
    rank = ray.train.get_context().get_world_rank()
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    seen = {"gpu_ids": [str(i) for i in ray.get_gpu_ids()], "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "device": str(ray.train.torch.get_device()), "backend": dist.get_backend(), "world": dist.get_world_size(),
            "sum": total.item(), "node": ray.get_runtime_context().get_node_id()}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(seen, f)

# one node with three CPUs and one GPU, as Ray counts it (a resource: this machine has no CUDA)
ray.init(num_cpus=3, num_gpus=1, **ray_init_kwargs(worker_start_timeout_s=60))
config = load_config(sys.argv[1])
trial = config.trials.trial(config.trials.default_knobs(), train_size=192)
make_trainer(trial, None, os.path.join(out, "runs"), "shared", worker_fn=worker).fit()
print("DONE")
"""


@pytest.mark.timeout(300)
def test_three_workers_share_one_gpu_a_third_each_over_gloo(tmp_path):
    """scaling.workers_per_gpu: 3 on a node Ray counts one GPU on (a resource here; the lent GPU machine runs the
    same trainer on CUDA): one group of three, each worker holding a third of GPU 0 and naming the same device,
    the process group gloo (NCCL refuses two ranks on one device) and its all-reduce across the three."""
    import json
    import os
    import subprocess
    import sys

    from conftest import ROOT

    spec = write_spec(tmp_path, tiny_spec(tmp_path, scaling={"num_workers": 3, "use_gpu": True, "workers_per_gpu": 3}))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a Ray of its own, not the session's
    env["PYTHONPATH"] = str(ROOT)
    driver, log = tmp_path / "driver.py", tmp_path / "driver.log"
    driver.write_text(SHARED_GPU_DRIVER)
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, str(driver), str(spec), str(tmp_path)], cwd=ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=240)
        except subprocess.TimeoutExpired:
            code = "still running after 240 s (killed)"
        finally:  # the driver, and whatever of its local Ray outlived it, in its own session
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=30)
    said = log.read_text()
    assert code == 0 and "DONE" in said, (code, said[-4000:])
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    assert {r["backend"] for r in ranks} == {"gloo"} and {r["world"] for r in ranks} == {3}
    assert {r["sum"] for r in ranks} == {6.0}  # 1 + 2 + 3: the all-reduce crossed all three
    assert [r["gpu_ids"] for r in ranks] == [["0"]] * 3 and {r["visible"] for r in ranks} == {"0"}
    assert {r["device"] for r in ranks} == {"cuda:0"} and len({r["node"] for r in ranks}) == 1
