"""`ray up cluster.yaml` on machines of our own (tests/hosts.py: a head and two workers, each its own network, PIDs,
/tmp, /dev/shm and home, reached over SSH), driven as a user drives it from a launcher with its own home, token and
key. The repository's cluster.yaml is used with only its placeholders and its CUDA wheel index replaced: the hosts
are stock (their `python3` is Debian's own, externally managed, with nothing installed; one of them lacks ensurepip,
as a stock Ubuntu without python3-venv does), and the file's own setup commands make ~/raysweep-env and install
everything into it. The hosts reach no index but the launcher's (tests/wheel_index.py: the wheels this machine's pip
resolves for the same requirements, torch's CPU build standing in for the CUDA one), named in each host's pip
configuration as a mirror would be; that configuration also skips byte-compiling (time on 2 shared cores).

In order: every listed machine joins (autoscaler v1, cluster.yaml); a client without the token is refused; a sweep
with the spec's local storage_path is refused; the README's `tune` through `ray exec` on a folder every host sees,
with a network only the head has, runs its trials across the machines; `ray attach -p 5000` forwards the MLflow
UI; on an S3 bucket (a real S3 API on the launcher's side of the hosts' network), one sweep meets two faults: a
worker machine lost mid-sweep costs its trial a restart from its checkpoint elsewhere, not the trial, then the
driver is killed and `tune --resume` on the head continues every trial from its checkpoint, naming the lost machine
without waiting for it; `ray down` leaves no Ray process anywhere.
Every step has a deadline, and the hosts are removed whatever happens (the module's fixture).

`-m "not hosts"` skips it (10 minutes here, most of it Ray starting on 2 shared cores and `ray down`'s wait for
the workers' raylets). Without a cluster (the first test failed) the others fail at once.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from importlib.metadata import version
from pathlib import Path

import pytest
import yaml
from hosts import SHARED_MOUNT, Hosts, missing_tools
from wheel_index import Index, wheelhouse

from conftest import AWS_TEST_ENV, ROOT, s3_api

pytestmark = [pytest.mark.hosts, pytest.mark.long]

BIN = Path(sys.executable).parent
PLACEHOLDERS = {"provider": ("head_ip", "worker_ips"), "auth": ("ssh_user", "ssh_private_key"), "setup_commands": ()}
TORCH_INDEX = re.compile(r"--index-url (https://download\.pytorch\.org/\S+)")
STOCK_PYTHON = "/usr/bin/python3"  # Debian's own: the distribution's interpreter, marked externally managed
ENV = "~/raysweep-env"  # where cluster.yaml's setup commands install
# what a stock machine lacks: pip's machine-wide configuration of this one (on every host), and on the last host
# ensurepip (Debian and Ubuntu ship it in python3-venv, which a stock Ubuntu image does not have)
NO_PIP_CONFIG, NO_ENSUREPIP = "/etc/xdg/pip", f"/usr/lib/python{sys.version_info[0]}.{sys.version_info[1]}/ensurepip"
# Ray's daemons, agents, workers and `ray start --block` (not `mlflow ui`)
RAY_PROCESS = re.compile(r"/ray/|ray::|raylet|gcs_server|bin/ray ")
# the quickstart made small: 3 trials of 2 epochs on 256 images, 3 hosts × 2 CPUs → 3 at once, one per machine
SMALL = ("--set tune.num_samples=3 --set train.epochs=2 --set tune.asha.grace_period=1 "
         "--set search.warmup_epochs.randint=[0,1] --set data.synthetic.train_size=256 "
         "--set data.synthetic.val_size=64 --progress-every 5")
SHARED_RESULTS = f"{SHARED_MOUNT}/results"


class Launcher:
    """The machine `ray up` runs on: its own home (~/.ray/auth_token, the key), its own TMPDIR (the local
    provider's state), the repository as its working directory (cluster.yaml's `file_mounts: {~/raysweep: .}`)."""

    def __init__(self, home: Path, cluster_file: Path):
        self.home, self.cluster_file = home, cluster_file
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "AWS_", "PYTHON"))}
        self.env.update(HOME=str(home), TMPDIR=str(home / "tmp"), RAY_USAGE_STATS_ENABLED="0",
                        PATH=f"{BIN}:{os.environ['PATH']}")

    def ray(self, *args: str, timeout: float) -> subprocess.CompletedProcess:
        done = subprocess.run([str(BIN / "ray"), *args], cwd=ROOT, env=self.env, capture_output=True, text=True,
                              timeout=timeout)
        print(f"$ ray {' '.join(args)[:200]}  → {done.returncode}\n{done.stdout[-4000:]}{done.stderr[-2000:]}")
        return done

    def exec(self, command: str, timeout: float) -> subprocess.CompletedProcess:
        return self.ray("exec", str(self.cluster_file), command, timeout=timeout)

    def popen_exec(self, command: str, log: Path) -> subprocess.Popen:
        with open(log, "w") as out:
            return subprocess.Popen([str(BIN / "ray"), "exec", str(self.cluster_file), command], cwd=ROOT,
                                    env=self.env, stdout=out, stderr=subprocess.STDOUT, text=True)


def users_cluster_file(hosts: Hosts, key: Path, index_url: str) -> dict:
    """The repository's cluster.yaml with only its placeholders and its CUDA wheel index replaced."""
    raw = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    ours = copy.deepcopy(raw)
    ours["provider"].update(head_ip=hosts.hosts[0].ip, worker_ips=[h.ip for h in hosts.hosts[1:]])
    ours["auth"].update(ssh_user="root", ssh_private_key=str(key))
    assert sum(bool(TORCH_INDEX.search(c)) for c in raw["setup_commands"]) == 1, raw["setup_commands"]
    ours["setup_commands"] = [TORCH_INDEX.sub(f"--index-url {index_url}", c) for c in raw["setup_commands"]]
    for section, keys in PLACEHOLDERS.items():  # every other key is the file's
        if keys:
            assert {k: v for k, v in ours[section].items() if k not in keys} == \
                   {k: v for k, v in raw[section].items() if k not in keys}
    assert {k: v for k, v in ours.items() if k not in PLACEHOLDERS} == \
           {k: v for k, v in raw.items() if k not in PLACEHOLDERS}
    return ours


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if missing := missing_tools():  # .ci/run installs them and sets RAYSWEEP_REQUIRE_HOSTS=1: there, a failure
        message = f"making hosts needs {', '.join(missing)}"
        if os.environ.get("RAYSWEEP_REQUIRE_HOSTS") == "1":
            pytest.fail(f"{message}; RAYSWEEP_REQUIRE_HOSTS=1 (set by .ci/run, which installs them)")
        pytest.skip(message)
    base = tmp_path_factory.mktemp("hosts")
    shared = base / "shared"
    shared.mkdir()
    # the dummy credentials of the S3 API below (tests/conftest.py), as a user's machines hold theirs
    bashrc = (f"export RAY_USAGE_STATS_ENABLED=0 "
              f"{' '.join(f'{k}={v}' for k, v in AWS_TEST_ENV.items())}\n")
    # the wheels of what cluster.yaml installs, for Debian's python3 (this interpreter's version and platform)
    assert Path(STOCK_PYTHON).resolve().name == f"python{sys.version_info[0]}.{sys.version_info[1]}", STOCK_PYTHON
    wheels = base.parent / "wheels"
    wheelhouse(wheels, [f"torch=={version('torch')}", "ray[default,train,tune]==2.60.*", str(ROOT), "pip",
                        "setuptools>=68"])
    hide = {i: [NO_PIP_CONFIG] for i in range(3)}
    hide[2].append(NO_ENSUREPIP)
    with Hosts(base, 3, shared=shared, bashrc=bashrc, stock=True, hide=hide) as hosts:
        index = Index(wheels, hosts.gateway, exclude=("raysweep",))
        for host in hosts.hosts:  # the machines' pip configuration names their mirror (plain HTTP: trusted by name)
            (host.home / ".config" / "pip").mkdir(parents=True)
            (host.home / ".config" / "pip" / "pip.conf").write_text(
                f"[global]\nindex-url = {index.url}\ntrusted-host = {hosts.gateway}\n[install]\nno-compile = true\n")
        home = base / "launcher"
        (home / "tmp").mkdir(parents=True)
        (home / ".ssh").mkdir(mode=0o700)
        key = home / ".ssh" / "id_ed25519"
        key.write_bytes(hosts.key.read_bytes())
        key.chmod(0o600)
        cluster_file = base / "cluster.yaml"
        # an absolute path: ssh expands `~` in -i from the passwd entry (/root here), not from $HOME
        cluster_file.write_text(yaml.safe_dump(users_cluster_file(hosts, key, index.url)))
        launcher = Launcher(home, cluster_file)
        made = launcher.ray("get-auth-token", "--generate", timeout=60)  # the README's step, on the launcher
        assert (home / ".ray" / "auth_token").is_file(), made.stderr
        launcher.hosts, launcher.shared = hosts, shared
        launcher.lost = None  # the worker machine the lost-machine test powered off
        launcher.up = False  # the first test sets it: the rest fail at once without a cluster, not at their deadlines
        try:
            yield launcher
        finally:
            index.close()
            for host in hosts.hosts:  # what each host's Ray logged, for a failure's cause
                logs = host.root / "tmp" / "ray" / "session_latest" / "logs"
                for name in ("monitor.log", "monitor.out"):
                    if (logs / name).is_file():
                        print(f"--- {host.name} {name}\n{(logs / name).read_text()[-3000:]}")


def alive_nodes(launcher: Launcher) -> list[dict]:
    done = launcher.exec("python3 -c 'import json, ray; ray.init(address=\"auto\", logging_level=\"ERROR\"); "
                         "print(\"NODES\", json.dumps([n for n in ray.nodes() if n[\"Alive\"]]))'", timeout=120)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("NODES ")), None)
    return json.loads(line.removeprefix("NODES ")) if line else []


@pytest.mark.timeout(960)
def test_ray_up_brings_up_every_listed_machine(cluster):
    hosts = cluster.hosts
    for host in hosts.hosts:  # stock machines: the distribution's python3, externally managed, nothing installed
        seen = hosts.ssh(host, "command -v python3; python3 -c 'import sysconfig; print(sysconfig.get_path("
                               "\"stdlib\"))'; python3 -c 'import ray' 2>&1 | tail -1; command -v ray || echo 'no ray'",
                         check=False)
        python, stdlib, no_ray, no_ray_cli = seen.stdout.split("\n")[:4]
        assert python == STOCK_PYTHON and (Path(stdlib) / "EXTERNALLY-MANAGED").is_file(), seen.stdout
        assert "No module named 'ray'" in no_ray and no_ray_cli == "no ray", seen.stdout
    assert hosts.ssh(hosts.hosts[2], "python3 -c 'import ensurepip.__main__'", check=False).returncode != 0
    started = time.monotonic()
    brought = cluster.ray("up", "-y", "--no-config-cache", str(cluster.cluster_file), timeout=480)
    assert brought.returncode == 0, brought.stderr[-3000:]
    listed = {h.ip for h in cluster.hosts.hosts}
    # the monitor adds a listed worker each 5 s; each needs SSH, rsync, the install (both at once), ray start.
    # `ray up` and the workers' joining share one deadline: a slow head install leaves less, a quick one more (the
    # workers took 370 s after a 200 s `ray up` beside the long tier's fault tests; 360 s of their own was too short)
    deadline = started + 840
    while True:
        nodes = alive_nodes(cluster)
        joined = {n["NodeManagerAddress"] for n in nodes}
        if joined == listed:
            break
        assert time.monotonic() < deadline, f"joined: {sorted(joined)} of {sorted(listed)}"
        time.sleep(5)
    print(f"all {len(listed)} machines up {time.monotonic() - started:.0f} s after `ray up` began")
    env_bin = "/root/raysweep-env/bin"
    for host in hosts.hosts:  # every shell Ray opens (as Ray opens it: ray/autoscaler/_private/command_runner.py)
        # finds raysweep's environment first, and the synced project in it
        # (from /tmp: in the home folder, ~/raysweep itself would be imported as a namespace package)
        seen = hosts.ssh(host, "bash --login -c -i 'source ~/.bashrc; command -v python ray mlflow; cd /tmp; python -c "
                               "\"import ray, torch, raysweep; print(ray.__version__, raysweep.__file__)\"' "
                               "2>/dev/null", check=False)
        assert seen.stdout.split("\n")[:3] == [f"{env_bin}/python", f"{env_bin}/ray", f"{env_bin}/mlflow"], seen
        ray_version, package = seen.stdout.split("\n")[3].split()
        assert ray_version.startswith("2.60.") and package == "/root/raysweep/raysweep/__init__.py", seen.stdout
    head = next(n for n in nodes if n["NodeManagerAddress"] == cluster.hosts.hosts[0].ip)
    assert head["Resources"].get("trial_driver") == 8
    assert all("trial_driver" not in n["Resources"] for n in nodes if n is not head)
    cluster.up = True


@pytest.fixture
def up(cluster):
    if not cluster.up:
        pytest.fail("the cluster is not up: see test_ray_up_brings_up_every_listed_machine")
    return cluster


@pytest.mark.timeout(180)
def test_a_client_without_the_token_is_refused(up, tmp_path):
    env = {**up.env, "HOME": str(tmp_path)}  # no ~/.ray/auth_token, no RAY_AUTH_MODE
    done = subprocess.run([sys.executable, "-m", "raysweep", "train", "search_spaces/quickstart.yaml", "--address",
                           f"{up.hosts.hosts[0].ip}:6379"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=150)
    assert done.returncode == 2 and "token authentication" in done.stderr, done.stderr[-2000:]


@pytest.mark.timeout(300)
def test_a_storage_path_only_the_head_sees_is_refused(up):
    command = f"cd ~/raysweep && python -m raysweep tune search_spaces/quickstart.yaml --address auto {SMALL}"
    done = up.exec(command, timeout=240)
    out = done.stdout + done.stderr
    assert done.returncode != 0
    assert "2 of the 3 nodes do not see the file" in out and "s3://" in out, out[-3000:]


@pytest.mark.timeout(600)
def test_a_sweep_on_a_shared_folder_trains_a_model_only_the_head_has_across_the_machines(up):
    """A user's network in a folder of the head's home, not installed anywhere: the driver ships it with the sweep
    (raysweep/usercode.py), the other machines import it, every trial's checkpoints land in the one folder every
    machine sees, and the answer names the model. (The driver killed and resumed: the S3 test below.)"""
    head, *workers = up.hosts.hosts
    project = head.home / "mymodel"
    project.mkdir()
    shutil.copy(ROOT / "examples" / "models" / "resnet.py", project / "head_only_net.py")
    assert not any((w.home / "mymodel").exists() for w in workers)
    # 3 trials of 2 epochs, never pruned (grace = max_t): one on each machine at once (2 CPUs a machine)
    command = (f"cd ~/mymodel && python -m raysweep tune ~/raysweep/search_spaces/quickstart.yaml --address auto "
               f"{SMALL} --set tune.asha.grace_period=2 --set name=own-model --set storage_path={SHARED_RESULTS} "
               f"--set model.factory=head_only_net:build --set model.kwargs.width=8")
    done = up.exec(command, timeout=540)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert re.search(r"^plan: .*; model head_only_net:build\(width=8\): [\d,]+ trainable parameters$", out, re.M), out
    assert re.search(r"sweep: 3 trials in \d+s: 3 finished, 0 pruned by ASHA, 0 failed", out), out[-3000:]
    placed = re.findall(r"\] up +(\S+): started in .* on (\S+?)(?:×\d)?$", out, re.M)
    print("where each trial's ranks ran:\n" + "\n".join(f"  {trial} on {ip}" for trial, ip in placed))
    assert len(placed) == 3 and len({ip for _, ip in placed}) >= 2, placed  # the machines without the folder too
    # every trial's checkpoints are in the one folder every machine sees, wherever its ranks ran
    results = up.shared / "results" / "own-model"
    assert {p.parent.parent.name for p in results.glob("train/trial-*/checkpoint_*/state.pt")} == \
           {f"trial-{trial}" for trial, _ in placed}, sorted(str(p) for p in up.shared.rglob("*"))[:50]
    assert re.search(r"^  model:    head_only_net:build\(width=8\), [\d,]+ trainable parameters", out, re.M), out
    answer = json.loads((results / "report" / "answer.json").read_text())
    assert answer["model"]["factory"] == "head_only_net:build" and answer["model"]["parameters"] > 0


@pytest.mark.timeout(300)
def test_ray_attach_forwards_the_mlflow_ui(up):
    started = up.exec("cd ~/raysweep && (nohup mlflow ui --backend-store-uri sqlite:///mlflow.db --port 5000 "
                           "> /tmp/mlflow-ui.log 2>&1 &) && sleep 1", timeout=60)
    assert started.returncode == 0
    attach = subprocess.Popen([str(BIN / "ray"), "attach", str(up.cluster_file), "-p", "5000"], cwd=ROOT,
                              env=up.env, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        deadline, body = time.monotonic() + 120, None
        while body is None:
            assert attach.poll() is None, f"ray attach exited {attach.returncode}"
            try:
                with urllib.request.urlopen("http://127.0.0.1:5000/health", timeout=5) as answer:
                    body = answer.read().decode()
            except OSError:
                assert time.monotonic() < deadline, "no answer on 127.0.0.1:5000 through `ray attach -p 5000`"
                time.sleep(1)
        assert body.strip() == "OK"
    finally:
        attach.terminate()
        attach.wait(timeout=30)
        up.exec("pkill -f '[m]lflow ui' || true", timeout=60)  # on the head only: its own PID namespace


@pytest.fixture(scope="module")
def s3(cluster):
    """A real S3 API (conftest.s3_api) on the launcher's side of the hosts' network, the bridge's own address; yields
    (storage URI root, boto3 client). The hosts hold its credentials (the fixture's bashrc)."""
    with s3_api(cluster.hosts.gateway) as bucket:
        yield bucket


def _keys(client, prefix: str) -> list[str]:
    keys, token = [], {}
    while True:
        page = client.list_objects_v2(Bucket="sweeps", Prefix=prefix, **token)
        keys += [o["Key"] for o in page.get("Contents", [])]
        if not page.get("IsTruncated"):
            return keys
        token = {"ContinuationToken": page["NextContinuationToken"]}


PLACED = re.compile(r"\] up +(\S+): started in .* on (\S+?)(?:×\d)?$", re.M)  # a trial's group: on which machine


@pytest.mark.timeout(1560)
def test_on_s3_a_machine_lost_then_the_driver_killed_cost_restarts_from_checkpoints_never_a_trial(up, s3, tmp_path):
    """One sweep on an S3 bucket, two faults. A worker machine powered off while a trial trains there, past its first
    checkpoint: a new worker group takes the trial over elsewhere from that checkpoint (once a machine is free: 3
    trials, 2 machines left). Then, once that trial trained on, the driver SIGKILLed on the head, and the same command
    with `--resume` there: it names the lost machine at once (never waits for it), and every unfinished trial reports
    from its checkpoint on, never from epoch 1, to the end."""
    uri, client = s3
    epochs = 6  # 3 trials never pruned (grace = max_t): one on each machine at once (2 CPUs a machine)
    command = (f"cd ~/raysweep && python -m raysweep tune search_spaces/quickstart.yaml --address auto {SMALL} "
               f"--set train.epochs={epochs} --set tune.asha.grace_period={epochs} --set name=s3-resume "
               f"--set 'storage_path={uri}'")

    def checkpoints() -> dict[str, int]:
        at = {}
        for key in _keys(client, "runs/s3-resume/train/"):
            if found := re.search(r"train/trial-(\w+)/checkpoint_(\d+)/state\.pt$", key):
                at[found[1]] = max(at.get(found[1], 0), int(found[2]))
        return at

    def reports(trial: str) -> list[dict]:  # Tune's result log of the trial, in the bucket
        (key,) = [k for k in _keys(client, "runs/s3-resume/") if re.search(rf"_{trial}_[^/]*/result\.json$", k)]
        text = client.get_object(Bucket="sweeps", Key=key)["Body"].read().decode()
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    log = tmp_path / "killed.log"
    sweep = up.popen_exec(command, log)
    workers = {h.ip: h for h in up.hosts.hosts[1:]}
    try:
        deadline, lost = time.monotonic() + 480, None
        while lost is None:  # a trial training on a worker machine, past its first epoch (a checkpoint to go back to)
            text = log.read_text()
            assert sweep.poll() is None and time.monotonic() < deadline, text[-4000:]
            at = checkpoints()
            lost = next(((trial, workers[ip], at[trial]) for trial, ip in PLACED.findall(text)
                         if ip in workers and trial in at), None)
            time.sleep(0.5)
        trial, host, lost_at = lost
        print(f"powering off {host.name} ({host.ip}) while {trial} trains there (checkpoint at epoch {lost_at})")
        host.power_off()
        up.lost = host.ip
        # the driver killed once every trial has a checkpoint at epoch 2 or later and the lost trial trained on
        while len(at) < 3 or min(at.values()) < 2 or at[trial] <= lost_at:
            assert sweep.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline + 360, (at, log.read_text()[-4000:])
            time.sleep(0.5)
            at = checkpoints()
        print(f"checkpoints when the driver is killed (trial: epoch): {at}")
        # the driver's `bash -c` and its python, killed in the head's own PID namespace: nothing elsewhere is touched
        up.hosts.ssh(up.hosts.hosts[0], "pkill -KILL -f '[r]aysweep tune'", timeout=30)
        sweep.wait(timeout=60)
    finally:
        if sweep.poll() is None:
            sweep.kill()
            sweep.wait(timeout=30)
    first = log.read_text()
    assert "sweep: 3 trials" not in first, first[-4000:]  # it was killed mid-sweep
    placed = dict(PLACED.findall(first))
    # a new worker group took the lost trial over before the kill: its checkpoint moved past the one it had when its
    # machine went off (written by rank 0 straight to the bucket; Tune's result.json there lags, synced periodically)
    assert at[trial] > lost_at, (trial, lost_at, at)
    resumed_at = int(time.time())
    done = up.exec(f"{command} --resume", timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-5000:]
    print("the resumed driver's first lines:\n" + "\n".join(
        line for line in out.splitlines() if line.startswith(("cluster:", "resumed:", "plan:"))))
    assert f"{up.lost} joined and was lost" in out and "waiting up to" not in out, out[-4000:]  # named, not waited for
    match = re.search(r"resumed: (\d+) done, (\d+) running(?: from epoch ([\d, ]+))?, (\d+) pending", out)
    assert match and int(match[2]) >= 1 and int(match[1]) + int(match[2]) == 3, out[-4000:]
    assert re.search(r"sweep: 3 trials in \d+s: 3 finished, 0 pruned by ASHA, 0 failed", out), out[-3000:]
    for name, epoch in at.items():
        after = [int(r["epoch"]) for r in reports(name) if r["timestamp"] >= resumed_at and "epoch" in r]
        print(f"{name} (on {placed.get(name, '?')} before the kill, checkpoint at epoch {epoch}): epochs reported "
              f"after the resume {after}")
        if epoch < epochs:
            assert after and min(after) >= 2 and after[-1] == epochs, (name, epoch, after)
    # the lost trial ended on a group off the lost machine: its last report's nodes are not its first's
    groups = [r["nodes"] for r in reports(trial)]
    assert groups[-1] != groups[0] and len(groups[-1].split(",")) == 2, groups


@pytest.mark.timeout(420)
def test_ray_down_leaves_no_ray_process_on_any_machine(up):
    down = up.ray("down", "-y", str(up.cluster_file), timeout=180)
    assert down.returncode == 0
    # `ray down` stops Ray on the head only (the local provider contacts no worker: ray #17022); a worker's raylet
    # exits once it has lost the head's GCS for gcs_rpc_server_reconnect_timeout_s (60 s by default)
    deadline = time.monotonic() + 180
    while left := {h.name: [p for p in h.pids() if RAY_PROCESS.search(_cmdline(p))] for h in up.hosts.hosts}:
        left = {name: pids for name, pids in left.items() if pids}
        if not left:
            break
        assert time.monotonic() < deadline, {n: [_cmdline(p)[:120] for p in pids] for n, pids in left.items()}
        time.sleep(2)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
