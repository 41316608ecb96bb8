"""Where the users live: several raylets (Ray's own `cluster_utils.Cluster`, as Ray's Train/Tune tests do) and
shared storage as a real S3 API on loopback (moto's server), never a mocked client."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from raysweep.cli import main

from conftest import AWS_TEST_ENV, ROOT, s3_api, tiny_spec, write_spec


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def s3_bucket():
    """A real S3 API on 127.0.0.1 (conftest.s3_api); yields (storage URI root, boto3 client).

    The credentials are conftest's dummy AWS_* variables: Ray's processes inherited them at start.
    """
    with s3_api("127.0.0.1") as bucket:
        yield bucket


def _keys(client) -> list[str]:
    return [o["Key"] for o in client.list_objects_v2(Bucket="sweeps").get("Contents", [])]


AWS_CHILD = r"""
import json, os

COLLECTED = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}  # at collection: before any fixture runs

def test_what_this_process_sees():
    with open(os.environ["ENV_SEEN_FILE"], "w") as f:
        json.dump({"collected": COLLECTED, "test": {k: v for k, v in os.environ.items() if k.startswith("AWS_")}}, f)
"""


def test_a_developers_aws_settings_reach_no_test_process(tmp_path):
    """A child pytest started with real-looking AWS settings and the project's conftest.py sees conftest's dummies
    alone, already while it collects test modules: before any fixture can start a Ray process (which inherits them)."""
    real = {"AWS_ACCESS_KEY_ID": "AKIAREALKEY0000000000", "AWS_SECRET_ACCESS_KEY": "real-secret",
            "AWS_SESSION_TOKEN": "real-session", "AWS_SECURITY_TOKEN": "real-session", "AWS_PROFILE": "prod",
            "AWS_DEFAULT_PROFILE": "prod", "AWS_DEFAULT_REGION": "eu-west-1", "AWS_REGION": "eu-west-1",
            "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "credentials"), "AWS_CONFIG_FILE": str(tmp_path / "config"),
            "AWS_ENDPOINT_URL": "https://s3.real.example", "AWS_ENDPOINT_URL_S3": "https://s3.real.example",
            "AWS_ROLE_ARN": "arn:aws:iam::123456789012:role/prod", "AWS_WEB_IDENTITY_TOKEN_FILE": str(tmp_path / "t")}
    (tmp_path / "test_child.py").write_text(AWS_CHILD)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "PYTEST_"))}
    env.update(real, ENV_SEEN_FILE=str(tmp_path / "seen.json"), PYTHONPATH=str(ROOT / "tests"))
    # `-p conftest`: the project's conftest.py, imported at start-up as pytest imports it for tests/
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest",
                           "--basetemp", str(tmp_path / "child"), str(tmp_path / "test_child.py")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen == {"collected": AWS_TEST_ENV, "test": AWS_TEST_ENV}


COMPILE_CHILD = r"""
import json, sys, torch
from raysweep.worker import compile_cache
location, save = sys.argv[1], sys.argv[2] == "save"
loaded = compile_cache.load_artifacts(location)
step = torch.compile(lambda x: torch.sin(x) * 2 + 1)
step(torch.rand(8))
saved = compile_cache.save_artifacts(location) if save else None
from torch._dynamo.utils import counters
print(json.dumps({"loaded": loaded, "saved": saved, **counters["inductor"]}))
"""


def test_the_sweeps_compile_cache_is_a_folder_on_a_path_and_artifacts_on_s3(s3_bucket, tmp_path):
    """On a path every worker's Inductor cache is the sweep's folder; on s3:// a worker that compiled saves torch's
    portable artifacts there and a worker on a fresh node (an empty local cache) loads them and compiles nothing."""
    from raysweep import storage
    from raysweep.trainer import worker_env

    root, client = s3_bucket
    assert worker_env(str(tmp_path / "cc"))["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cc")
    location = storage.join(root, "sweep", "compile_cache")
    assert "TORCHINDUCTOR_CACHE_DIR" not in worker_env(location)

    def worker(cache_dir: str, mode: str) -> dict:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / cache_dir)}
        proc = subprocess.run([sys.executable, "-c", COMPILE_CHILD, location, mode], capture_output=True, text=True,
                              timeout=240, cwd=ROOT, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    first = worker("node1", "save")
    assert first["loaded"] == 0 and first.get("fxgraph_cache_miss", 0) > 0 and first["saved"]
    name = first["saved"].split("?")[0].rsplit("/", 1)[1]  # named by its content
    assert [k for k in _keys(client) if k.endswith(".bin")] == [f"runs/sweep/compile_cache/{name}"]
    second = worker("node2", "load")
    assert second["loaded"] == 1 and second.get("fxgraph_cache_hit", 0) > 0 and not second.get("fxgraph_cache_miss")


@pytest.mark.ray
def test_s3_storage_holds_checkpoints_and_the_probe_table_and_a_failure_travels_as_data(ray_cluster, tmp_path,
                                                                                       monkeypatch, s3_bucket, capsys):
    from mlflow.tracking import MlflowClient

    uri, client = s3_bucket
    spec = write_spec(tmp_path, tiny_spec(tmp_path, storage_path=uri, train={"epochs": 2, "reference_batch_size": 64}))

    # a trial that diverges at its 8th optimizer step (epoch 2): the agreed failure travels as data (through the
    # broker to Tune and MLflow), its checkpoint through S3
    monkeypatch.setenv("RAYSWEEP_TEST_NAN_AT_STEP", "8")
    assert main(["train", str(spec)]) == 1
    monkeypatch.delenv("RAYSWEEP_TEST_NAN_AT_STEP")
    store = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = [r for r in store.search_runs([store.get_experiment_by_name("t").experiment_id])
              if "mlflow.parentRunId" in r.data.tags]
    assert run.info.status == "FAILED" and run.data.tags["failure"] == "diverged"
    keys = _keys(client)
    assert not any(k.endswith("/raysweep_failure.json") for k in keys)  # no marker file: failures.py
    assert any(k.startswith("runs/t-train/train/trial-") and k.endswith("/state.pt") for k in keys)  # epoch 1
    assert any(k.startswith("runs/t-train/experiment_state") for k in keys)  # Tune's own state, same storage

    # the probe's table: written by rank 0 to S3, read back by the driver
    monkeypatch.setenv("RAYSWEEP_TEST_OOM_ABOVE", "40")
    assert main(["probe", str(spec), "--start", "16"]) == 0
    assert "largest per-GPU batch that fits: 40" in capsys.readouterr().out
    (table,) = [k for k in _keys(client) if k.startswith("runs/t/probe/") and k.endswith("/probe.json")]
    assert json.loads(client.get_object(Bucket="sweeps", Key=table)["Body"].read())["largest"] == 40
    assert not (tmp_path / "results").exists() and not (ROOT / "sweeps").exists()  # nothing fell back to disk


# ---------------------------------------------------------------------------------------------


@pytest.fixture
def three_node_cluster():
    """A head with the trial_driver resource and no CPU (as cluster.yaml starts it), and three 1-CPU nodes."""
    import ray._common.utils
    from ray.cluster_utils import Cluster

    # the dashboard is off by default here; a sweep's close asks the State API which of its slot actors live
    # (slots/lifecycle.py), as it can on the clusters `ray start` and ray.init make
    cluster = Cluster(initialize_head=True, connect=False,
                      head_node_args={"num_cpus": 0, "resources": {"trial_driver": 8}, "include_dashboard": True,
                                      "dashboard_port": _free_port()})
    workers = [cluster.add_node(num_cpus=1) for _ in range(3)]
    cluster.wait_for_nodes()
    # Cluster writes its head's address to /tmp/ray/ray_current_cluster, as `ray start` does ("for convenience in
    # unit testing": ray/cluster_utils.py), where a driver given no address finds a cluster to join
    # (cluster.recorded_address): the other lane's local sweeps (conftest.py) would join this one. This test
    # passes the address itself.
    ray._common.utils.reset_ray_address()
    try:
        yield cluster, workers
    finally:
        cluster.shutdown()


def _reports(experiment: Path) -> dict[str, list[tuple[int, list[str]]]]:
    """Every report each trial's rank 0 made, from Tune's own result log: trial id → [(epoch, node id by rank)].

    MLflow cannot tell a restart: the tracker skips an epoch it already holds and logs `nodes` once. Tune's log
    keeps every report, each carrying the node ids of the worker group that made it.
    """
    reports: dict[str, list[tuple[int, list[str]]]] = {}
    for log in experiment.glob("*/result.json"):
        for line in log.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                reports.setdefault(row["trial_id"], []).append((int(row["epoch"]), row["nodes"].split(",")))
    return reports


@pytest.mark.ray
@pytest.mark.timeout(600)
def test_sweep_on_a_multi_node_cluster_survives_a_lost_node(ray_cluster, three_node_cluster, tmp_path):
    from mlflow.tracking import MlflowClient

    cluster, workers = three_node_cluster
    spec = write_spec(tmp_path, tiny_spec(
        tmp_path,
        data={"width": 64, "height": 24, "synthetic": {"train_size": 384, "val_size": 64}},
        train={"epochs": 4, "reference_batch_size": 64, "max_failures": 2},
        search={"per_gpu_batch_size": {"choice": [16, 32], "default": 16}, "base_lr": 2.0e-3, "warmup_epochs": 1,
                "weight_decay": 1.0e-4},
        tune={"num_samples": 2, "seed": 0, "asha": {"grace_period": 4}},
    ))
    log = tmp_path / "driver.log"
    with open(log, "w") as out:  # a separate driver process, joining the cluster like `--address auto` on a head
        driver = subprocess.Popen([sys.executable, "-m", "raysweep", "tune", str(spec), "--address", cluster.address],
                                  cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1"})
    store = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    try:
        # once the first trial has reported an epoch, remove a node that runs one of its ranks
        deadline = time.monotonic() + 300
        watched = None
        while watched is None and time.monotonic() < deadline and driver.poll() is None:
            time.sleep(0.25)  # the trial has a few seconds of epochs left: remove the node within them
            experiment = store.get_experiment_by_name("t")
            runs = store.search_runs([experiment.experiment_id]) if experiment else []
            watched = next((r for r in runs if "nodes" in r.data.params), None)
        assert watched, log.read_text()[-3000:]
        victim = next(w for w in workers if w.node_id in watched.data.params["nodes"].split(","))
        cluster.remove_node(victim)
        assert driver.wait(timeout=420) == 0, log.read_text()[-3000:]
    finally:
        if driver.poll() is None:
            os.kill(driver.pid, signal.SIGKILL)
            driver.wait(timeout=30)
    out = log.read_text()
    assert "plan: 3 CPU, 2 workers/trial → 1 trial at a time" in out  # the whole cluster, not one node
    children = [r for r in store.search_runs([store.get_experiment_by_name("t").experiment_id])
                if "mlflow.parentRunId" in r.data.tags]
    assert len(children) == 2 and all(r.info.status == "FINISHED" for r in children), out[-3000:]
    for run in children:
        ranks = run.data.params["nodes"].split(",")
        assert len(ranks) == 2 and len(set(ranks)) == 2  # 1 CPU per node: each rank on its own raylet
        steps = [m.step for m in store.get_metric_history(run.info.run_id, "val_loss")]
        assert steps == [1, 2, 3, 4]  # the trial that lost a node restarted from its checkpoint, nothing twice
    # the node loss restarted that trial's worker group. Tune's log holds its reports in order: the first group's
    # (a rank on the lost node), then the new group's, off it; the new group began from the last checkpoint, so
    # an epoch came twice (entry.py replays the checkpoint's own report first, the old group's `nodes` in it)
    reports = _reports(tmp_path / "results" / "t")
    assert len(reports) == 2, reports
    restarted = reports[watched.data.tags["trial_id"]]
    epochs = [epoch for epoch, _ in restarted]
    old_group = [victim.node_id in ranks for _, ranks in restarted]
    assert old_group[0] and not old_group[-1] and old_group == sorted(old_group, reverse=True), \
        f"no restart off the lost node {victim.node_id}: (epoch, node ids) reported {restarted}"
    assert epochs[-1] == 4 and len(set(epochs)) < len(epochs), f"no epoch reported again: {restarted}"
    # checkpoints went to storage_path, on the driver's machine here (shared storage on real machines)
    assert list((tmp_path / "results" / "t" / "train").glob("trial-*/checkpoint_*/state.pt"))


@pytest.mark.ray
@pytest.mark.timeout(120)
def test_a_machine_the_cluster_file_lists_that_never_joins_is_named_after_the_stated_wait(ray_cluster, tmp_path):
    import ray
    import yaml

    from raysweep import nodes

    here = sorted({n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]})
    bootstrap = tmp_path / "ray_bootstrap_config.yaml"  # as `ray up` leaves it on the head (provider: local)
    bootstrap.write_text(yaml.safe_dump({"provider": {"type": "local", "head_ip": here[0],
                                                      "worker_ips": ["192.0.2.11"]}}))  # TEST-NET: never contacted
    said = []
    started = time.monotonic()
    assert nodes.wait_for_listed(said.append, str(bootstrap), wait_s=3, poll_s=0.5) == ["192.0.2.11"]
    assert 3 <= time.monotonic() - started < 30
    assert "192.0.2.11" in said[0] and said[0].startswith("waiting up to")
    assert said[-1].startswith(f"1 of the 2 machines listed in {bootstrap} are up: 192.0.2.11 never joined (in 3 s). "
                               f"The sweep goes on with those up"), said
    # every listed machine up: no wait; a cloud provider's file (it scales on demand) or none: nothing to wait for
    said.clear()
    bootstrap.write_text(yaml.safe_dump({"provider": {"type": "local", "head_ip": here[0], "worker_ips": []}}))
    assert nodes.wait_for_listed(said.append, str(bootstrap), wait_s=0) == []
    bootstrap.write_text(yaml.safe_dump({"provider": {"type": "aws", "region": "us-west-2"}}))
    assert nodes.wait_for_listed(said.append, str(bootstrap), wait_s=0) == []
    assert nodes.wait_for_listed(said.append, str(tmp_path / "none.yaml"), wait_s=0) == []
    assert said == []


@pytest.mark.ray
@pytest.mark.timeout(120)
def test_listed_machines_are_matched_by_address_not_by_text(ray_cluster, tmp_path):
    """A cluster file names its machines as its user wrote them: a host name, or an address Ray does not report (a
    head with several network cards: Ray reports the one its node picked). Each cost the whole wait and was named as
    never joined while it was up. And a cluster file left from an earlier cluster, whose head is not this one, is
    said once and not waited for."""
    import ray
    import yaml

    from raysweep import nodes

    here = sorted({n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]})
    assert "127.0.0.1" not in here  # Ray reports this machine by the address it picked, not loopback
    bootstrap = tmp_path / "ray_bootstrap_config.yaml"
    said = []
    # "localhost": a host name, resolving to 127.0.0.1, an address of this machine that Ray does not report
    bootstrap.write_text(yaml.safe_dump({"provider": {"type": "local", "head_ip": "localhost",
                                                      "worker_ips": ["127.0.0.1", here[0]]}}))
    started = time.monotonic()
    assert nodes.wait_for_listed(said.append, str(bootstrap), wait_s=20, poll_s=0.5) == []
    assert time.monotonic() - started < 15 and said == [], said  # no wait: every one is this machine, up
    # a file from another cluster: its head is no machine here
    bootstrap.write_text(yaml.safe_dump({"provider": {"type": "local", "head_ip": "192.0.2.77",
                                                      "worker_ips": ["192.0.2.78"]}}))  # TEST-NET: never contacted
    started = time.monotonic()
    assert nodes.wait_for_listed(said.append, str(bootstrap), wait_s=20, poll_s=0.5) == []
    assert time.monotonic() - started < 15
    assert len(said) == 1 and said[0].startswith(f"{bootstrap} lists head 192.0.2.77, which is not this cluster's "
                                                 f"head"), said


@pytest.mark.ray
@pytest.mark.timeout(120)
def test_the_log_monitor_of_a_local_cluster_raysweep_starts_runs_with_its_settings(ray_cluster):
    """ray_init_kwargs puts cluster.LOG_MONITOR_ENV where ray.init's daemons read it: the session cluster here is
    started with it, as `tune` starts a local one; its log monitor's own environment holds every setting."""
    import psutil

    from raysweep.cluster import LOG_MONITOR_ENV

    def command(p) -> list[str]:
        try:
            return p.cmdline()
        except psutil.Error:  # a worker Ray just ended (cluster.WORKER_POOL), a zombie until its raylet reaps it
            return []

    children = psutil.Process().children(recursive=True)
    monitors = [p for p in children if any("log_monitor.py" in part for part in command(p))]
    assert len(monitors) == 1, [command(p) for p in children]
    environ = monitors[0].environ()
    assert {k: environ.get(k) for k in LOG_MONITOR_ENV} == LOG_MONITOR_ENV
