"""Token authentication, cluster.yaml's way: a `ray start --head` with RAY_AUTH_MODE=token and the token in
~/.ray/auth_token refuses every driver without that token, and raysweep says how to fix it in one line.

The head runs in a session of its own (private ports, --temp-dir, HOME); every driver is a subprocess with each
RAY_* variable removed (conftest sets RAY_AUTH_MODE=token, and Ray reads it when first imported) and its own
HOME, so nothing here touches the session's cluster (conftest's `ray_cluster`) or this machine's
~/.ray/auth_token. Teardown signals only the head's session, never `ray stop` (it stops every Ray here).
"""

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from raysweep.cluster import TOKEN_FIX

from conftest import tiny_spec, write_spec

# What raysweep does with --address: connect() (a refusal is its one-line UserError), then one task.
DRIVER = r"""
import json, sys
from raysweep.cluster import connect
from raysweep.config import load_config
from raysweep.errors import UserError

try:
    connect(sys.argv[1], load_config(sys.argv[2]).scaling.worker_start_timeout_s, verbose=False)
except UserError as e:
    print(json.dumps({"error": str(e)}))
else:
    import ray
    print(json.dumps({"answer": ray.get(ray.remote(lambda: 41 + 1).remote(), timeout=60)}))
"""

NO_TOKEN_SENT = "the cluster uses token authentication and this driver sent no token (RAY_AUTH_MODE is not 'token')"
WRONG_TOKEN_SENT = "the cluster uses token authentication and this driver sent the wrong token"
NO_TOKEN_HERE = "RAY_AUTH_MODE=token but this machine has no token"


@pytest.mark.parametrize("mode, says", [(None, NO_TOKEN_SENT), ("token", WRONG_TOKEN_SENT)],
                         ids=["mode off", "token mode"])
def test_a_refusal_by_the_gcs_names_the_token_fix(monkeypatch, mode, says):
    """Ray 2.60 gives up on a token-auth GCS with a ConnectionError whose cause carries InvalidAuthToken (as here,
    abridged; the live test below checks the real one)."""
    from raysweep.cluster import _join_error

    if mode:
        monkeypatch.setenv("RAY_AUTH_MODE", mode)
    else:
        monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    refused = ConnectionError("Failed to connect to Ray cluster at 10.0.0.1:6379")
    refused.__cause__ = RuntimeError("Failed to connect to GCS. Last connection error: Traceback (most recent call "
                                     "last): ...\nray.exceptions.AuthenticationError: RPC error: InvalidAuthToken: "
                                     "Authentication token is missing or incorrect. ...")
    assert str(_join_error("10.0.0.1:6379", refused)) == f"--address 10.0.0.1:6379: {says}; {TOKEN_FIX}"


def test_token_mode_without_a_token_and_a_plain_connection_failure_have_their_own_lines():
    from ray.exceptions import AuthenticationError

    from raysweep.cluster import _join_error

    missing = AuthenticationError("Token authentication is enabled but no authentication token was found")
    assert str(_join_error("auto", missing)) == f"--address auto: {NO_TOKEN_HERE}; {TOKEN_FIX}"
    nobody = str(_join_error("10.0.0.1:6379", ConnectionError("Failed to connect to Ray cluster at 10.0.0.1:6379")))
    assert nobody.startswith("--address 10.0.0.1:6379: cannot join a Ray cluster there (Failed to connect")
    assert "token" not in nobody


@dataclass(frozen=True)
class Head:
    address: str
    dashboard: str
    token: str
    home: Path  # holds .ray/auth_token, as a node of cluster.yaml does
    root: Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrubbed_env(home: Path, **ray_vars: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    return {**env, "HOME": str(home), **ray_vars}


def _session_members(sid: int) -> list[int]:
    """Pids in session `sid` (the field after the process group in /proc/<pid>/stat)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[3]) == sid:
                pids.append(int(entry.name))
        except (OSError, IndexError):
            continue
    return pids


def _stop(head: subprocess.Popen) -> None:
    """SIGTERM `ray start --block` (it stops its node), then SIGKILL whatever is left of its session.

    The session id is the head's pid (start_new_session), and the head is reaped only at the end, so no other
    process can hold that id meanwhile: only processes this module started are signalled.
    """
    head.terminate()
    deadline = time.monotonic() + 30
    while head.returncode is None and time.monotonic() < deadline:  # exited but not reaped: WNOWAIT
        if os.waitid(os.P_PID, head.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            break
        time.sleep(0.2)
    for pid in _session_members(head.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    head.wait(10)


@pytest.fixture(scope="module")
def token_head():
    root = Path(tempfile.mkdtemp(prefix="rsauth-", dir="/tmp"))  # short: Ray's socket paths live under it
    home = root / "home"
    (home / ".ray").mkdir(parents=True)
    # what `ray get-auth-token --generate && chmod 600 ~/.ray/auth_token` leaves (a 64-hex-digit token), without
    # the 3 s of importing Ray's CLI
    token = secrets.token_hex(32)
    token_file = home / ".ray" / "auth_token"
    token_file.write_text(token)
    token_file.chmod(0o600)

    gcs, dashboard = _free_port(), _free_port()
    cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", "--disable-usage-stats",
           "--node-ip-address=127.0.0.1", f"--port={gcs}", "--dashboard-host=127.0.0.1",
           f"--dashboard-port={dashboard}", f"--ray-client-server-port={_free_port()}",
           f"--dashboard-agent-listen-port={_free_port()}",
           f"--temp-dir={root / 'ray'}", "--num-cpus=1", "--object-store-memory=100000000",
           '--resources={"trial_driver": 4}']  # cluster.yaml's head holds the trial drivers
    # cluster.yaml's head: `export RAY_AUTH_MODE=token; ray start --head ...`, the token in ~/.ray/auth_token;
    # no drain on SIGTERM (up to 30 s otherwise)
    env = _scrubbed_env(home, RAY_AUTH_MODE="token", RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0")
    log = root / "head.log"
    with open(log, "w") as out:
        head = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=root, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while "Ray runtime started" not in log.read_text():
            assert head.poll() is None, f"ray start --head exited {head.returncode}:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"head not up in 120 s:\n{log.read_text()[-3000:]}"
            time.sleep(0.3)
        yield Head(f"127.0.0.1:{gcs}", f"http://127.0.0.1:{dashboard}", token, home, root)
    finally:
        _stop(head)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def drivers(token_head):
    """Each driver's printed result, by case; they run at once (each is mostly Python and Ray imports)."""
    spec = write_spec(token_head.root, tiny_spec(token_head.root))
    nobody = token_head.root / "empty-home"
    nobody.mkdir()
    one_try = {"RAY_gcs_server_port_wait_time_s": "1"}  # one GCS attempt (~1 s), not Ray's 20 retries 1 s apart
    cases = {
        "no token": _scrubbed_env(nobody, **one_try),
        "wrong token": _scrubbed_env(nobody, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32), **one_try),
        "token mode, no token": _scrubbed_env(nobody, RAY_AUTH_MODE="token", **one_try),
        "the token": _scrubbed_env(token_head.home, RAY_AUTH_MODE="token"),  # ~/.ray/auth_token, as on a node
    }
    procs = {case: subprocess.Popen([sys.executable, "-c", DRIVER, token_head.address, str(spec)], env=env,
                                    cwd=token_head.root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for case, env in cases.items()}
    outputs = {}
    for case, proc in procs.items():  # every driver is waited for (or killed) before any assertion
        try:
            outputs[case] = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            outputs[case] = proc.communicate()
    results = {}
    for case, (out, err) in outputs.items():
        code, lines = procs[case].returncode, out.strip().splitlines()
        assert code == 0 and lines, f"{case}: driver exited {code}:\n{out[-2000:]}\n{err[-3000:]}"
        results[case] = json.loads(lines[-1])
    return results


@pytest.mark.ray
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ["no token", "wrong token", "token mode, no token"])
def test_a_driver_without_the_clusters_token_is_refused_with_the_fix(token_head, drivers, case):
    """Ray itself refuses (the GCS answers InvalidAuthToken, or there is no token to send), and `connect`
    turns each refusal into the one line that names the fix."""
    says = {"no token": NO_TOKEN_SENT, "wrong token": WRONG_TOKEN_SENT, "token mode, no token": NO_TOKEN_HERE}[case]
    assert drivers[case] == {"error": f"--address {token_head.address}: {says}; {TOKEN_FIX}"}


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_a_driver_with_the_token_joins_and_runs_a_task(drivers):
    """RAY_AUTH_MODE=token and ~/.ray/auth_token, what cluster.yaml gives every node, are all a driver needs."""
    assert drivers["the token"] == {"answer": 42}


def _status(url: str, token: str | None) -> int:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_the_dashboard_and_its_job_api_refuse_requests_without_the_token(token_head):
    """`ray job submit` runs any command on the head, so the dashboard answers 401 without the token and 403 with
    a wrong one."""
    for path in ("/api/version", "/api/jobs/"):
        url = token_head.dashboard + path
        assert (_status(url, None), _status(url, "0" * 64), _status(url, token_head.token)) == (401, 403, 200), path


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_a_sweep_submitted_with_ray_job_submit_runs_end_to_end_with_the_cluster_checks(token_head):
    """`ray job submit` is how Ray's docs run work on a cluster: its entry point runs on the head with RAY_ADDRESS
    set and no --address. raysweep joins that cluster (it passed `resources=` to ray.init there, which Ray refuses
    with a ValueError), runs the node and storage checks, and the sweep ends as it would from a shell."""
    from mlflow.tracking import MlflowClient

    root = token_head.root / "job"
    root.mkdir()
    spec = write_spec(root, tiny_spec(root, scaling={"num_workers": 1, "use_gpu": False, "cpus_per_worker": 1},
                                      train={"epochs": 2, "reference_batch_size": 64},
                                      tune={"num_samples": 1, "asha": {"grace_period": 1}}))
    env = _scrubbed_env(token_head.home, RAY_AUTH_MODE="token")  # a node of cluster.yaml: token mode, its token
    job = subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "job", "submit", "--address",
                          token_head.dashboard, "--", sys.executable, "-m", "raysweep", "tune", str(spec)],
                         env=env, cwd=root, capture_output=True, text=True, timeout=240)
    out = job.stdout + job.stderr
    assert job.returncode == 0 and "succeeded" in out, out[-4000:]
    assert "cluster: 1 node up" in out and f"storage_path {root / 'results'} is seen by every node" in out, out[-4000:]
    assert "answer (ran): global batch 16 = per-GPU 16 × 1 workers" in out
    client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    (parent,) = [r for r in client.search_runs([client.get_experiment_by_name("t").experiment_id])
                 if r.data.tags.get("raysweep.kind") == "tune"]
    assert parent.info.status == "FINISHED"


NCCL_DRIVER = r"""
import json, os, sys
from raysweep.cluster import connect
from raysweep.config import load_config

connect(sys.argv[1], load_config(sys.argv[2]).scaling.worker_start_timeout_s, verbose=False)
import ray
names = ("NCCL_DEBUG", "NCCL_SOCKET_IFNAME", "TORCH_NCCL_BLOCKING_WAIT", "NCCL_UNSET")
print(json.dumps(ray.get(ray.remote(lambda: {k: os.environ.get(k) for k in names}).remote(), timeout=60)))
"""


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_the_drivers_nccl_settings_reach_the_workers_of_a_running_cluster(token_head):
    """A worker inherits its raylet's environment, which `ray start` (cluster.yaml) set: `NCCL_DEBUG=INFO python -m
    raysweep train … --address auto` changed nothing on the ranks that run NCCL. The driver's NCCL_* and TORCH_NCCL_*
    now go with the job's runtime environment (cluster.ray_env)."""
    spec = write_spec(token_head.root, tiny_spec(token_head.root), name="nccl.yaml")
    env = _scrubbed_env(token_head.home, RAY_AUTH_MODE="token", NCCL_DEBUG="INFO", NCCL_SOCKET_IFNAME="eth1",
                        TORCH_NCCL_BLOCKING_WAIT="1")
    proc = subprocess.run([sys.executable, "-c", NCCL_DRIVER, token_head.address, str(spec)], env=env,
                          cwd=token_head.root, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {
        "NCCL_DEBUG": "INFO", "NCCL_SOCKET_IFNAME": "eth1", "TORCH_NCCL_BLOCKING_WAIT": "1", "NCCL_UNSET": None}



def test_a_recorded_cluster_that_cannot_be_joined_names_the_file_and_the_way_out(tmp_path, monkeypatch):
    """The address file outlives a head that was killed, not stopped. A driver given no address tries that cluster
    (as ray.init() would); when it cannot join, the line names where the address came from and the two ways out.
    (Joining a dead address waits out Ray's own connect timeout: the line is checked here, the join in the test
    below against a live head.)"""
    from raysweep.cluster import _join_error, recorded_address

    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text("10.9.9.9:6379\n")
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    assert recorded_address() == ("10.9.9.9:6379", str(tmp_path / "ray" / "ray_current_cluster"))
    line = str(_join_error("10.9.9.9:6379", ConnectionError("Timed out connecting to the GCS")))
    assert line.startswith(f"10.9.9.9:6379 (no --address: the last `ray start` on this machine left it in "
                           f"{tmp_path / 'ray' / 'ray_current_cluster'}): cannot join a Ray cluster there"), line
    assert "--address local" in line and "`ray stop` removes the file" in line and "leave --address out" not in line
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path / "elsewhere"))
    assert recorded_address() is None

@pytest.mark.ray
@pytest.mark.timeout(300)
def test_without_an_address_a_driver_joins_the_cluster_ray_start_recorded_and_local_starts_its_own(token_head):
    """`ray start` records its head's address in Ray's address file (<RAY_TMPDIR>/ray/ray_current_cluster, as on a
    cluster.yaml head), and a bare ray.init() joins that cluster: raysweep's local start passed `resources=` there,
    which Ray refuses with a ValueError traceback. Without --address, raysweep joins the recorded cluster as
    ray.init() would, with a cluster's checks and a line saying so; `--address local` starts a cluster of its own."""
    tmp = Path(tempfile.mkdtemp(prefix="rsrec-", dir="/tmp"))  # short: a local cluster's socket paths live under it
    try:
        (tmp / "ray").mkdir()
        (tmp / "ray" / "ray_current_cluster").write_text(token_head.address)
        root = token_head.root / "recorded"
        root.mkdir()
        spec = write_spec(root, tiny_spec(root, scaling={"num_workers": 1, "use_gpu": False, "cpus_per_worker": 1},
                                          train={"epochs": 2, "reference_batch_size": 64}))
        env = _scrubbed_env(token_head.home, RAY_AUTH_MODE="token", RAY_TMPDIR=str(tmp))
        joined = subprocess.run([sys.executable, "-m", "raysweep", "train", str(spec)], env=env, cwd=root,
                                capture_output=True, text=True, timeout=240)
        out = joined.stdout + joined.stderr
        assert joined.returncode == 0, out[-4000:]
        assert (f"cluster: no --address; joining the Ray cluster at {token_head.address}, which the last `ray start` "
                f"on this machine recorded ({tmp / 'ray' / 'ray_current_cluster'})") in out, out[-4000:]
        assert "cluster: 1 node up" in out, out[-4000:]  # the checks a cluster gets

        env = _scrubbed_env(token_head.home, RAY_TMPDIR=str(tmp))
        own = subprocess.run([sys.executable, "-m", "raysweep", "train", str(spec), "--address", "local"], env=env,
                             cwd=root, capture_output=True, text=True, timeout=240)
        out = own.stdout + own.stderr
        assert own.returncode == 0, out[-4000:]
        assert "joining" not in out and "cluster: 1 node up" not in out, out[-4000:]
        assert list((tmp / "ray").glob("session_*")), "the local cluster's session is not under RAY_TMPDIR"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.ray
@pytest.mark.timeout(120)
def test_a_drivers_state_api_calls_name_its_cluster_beside_another_ray_instance(ray_cluster, token_head, monkeypatch):
    """Two Ray instances on one machine (the session's cluster and this module's `ray start` head; a local sweep beside
    a cluster.yaml head's): a State API call without an address looks for every one and raises "Found multiple
    active Ray instances" (get_address_for_submission_client, ray/dashboard/utils.py). The sweep's wait for its
    slots' actors swallowed that and waited for nothing."""
    from raysweep.slots.lifecycle import _slot_actor_ids

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert _slot_actor_ids() is not None
