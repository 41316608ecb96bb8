"""Shared fixtures: one local Ray cluster per session (2 CPUs, gloo), tiny specs and data in tmp_path."""

from __future__ import annotations

import os

# Ray reads these when first imported (before any test module imports it)
os.environ.setdefault("RAY_AUTH_MODE", "token")
os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
# S3 in the tests is moto's server on loopback (test_cluster.py), reached with dummy credentials. A developer's
# real AWS settings (keys, session token, profile, endpoint overrides, ~/.aws files) must reach no test process:
# every AWS_* variable is dropped and the dummies forced, here, before any Ray process starts, so that every one
# of them (Tune's, Train's) inherits exactly these (test_cluster.py checks it in a child pytest).
AWS_TEST_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    # botocore and pyarrow's AWS SDK read ~/.aws/credentials and ~/.aws/config (profiles, endpoint_url) otherwise
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_EC2_METADATA_DISABLED": "true",  # never ask a cloud VM's metadata service for its role
}
for _key in [k for k in os.environ if k.startswith("AWS_")]:
    del os.environ[_key]
os.environ.update(AWS_TEST_ENV)
# The two lanes (below) share the 2 cores, and each runs torch on 2 threads (a test's own loop, rank processes, a bare
# benchmark loop) much of the time. libgomp's threads spin between parallel regions by default (OMP_WAIT_POLICY unset:
# GOMP_SPINCOUNT's 300,000 spins, libgomp/env.c), burning the cores the other lane's threads wait for. Two 2-thread
# CNN loops run together took 38.9 s where one alone took 2.9 s; with PASSIVE (a waiting thread sleeps) 5.1 s, and 3.2 s
# alone (benchmarks/omp_lanes.py, RESULTS.md). `-m quick` in two lanes: 647 s, then 520 s with PASSIVE. Set before
# torch loads libgomp, and inherited by every process the tests start (the session clusters' Ray workers among them).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Ray fixes its auth mode for the process when first imported: import it now, with the environment above, so
# that no test that changes RAY_AUTH_MODE (test_auth.py) decides it for the session's cluster. The GPU suite's
# machine has no Ray (tests/test_gpu.py needs none): there, nothing to fix.
try:
    import ray  # noqa: E402, F401
except ImportError:
    pass

import shutil  # noqa: E402
import socket  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from pathlib import Path  # noqa: E402

import cpu_account  # noqa: E402
import pytest  # noqa: E402
import yaml  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_MODELS = ROOT / "examples" / "models"  # users' models as factories: resnet:build, crnn:build
# the session cluster's worker group start-up wait: Ray Train's own default (30 s). 15 s was too short under the
# whole suite's load (load average 8.5 on the 2 cores beside the `ray up` hosts): a killed slot host's new group
# timed out starting and its trial was retried twice (test_faults, a fresh-clone run)
WORKER_START_TIMEOUT_S = 30

# `pytest -m quick` (CONTRIBUTING.md): every test that needs no Ray cluster, no machines made here and no GPU, but the
# benchmarks' own scripts (each a minute or more in --quick mode): the config, data, search, report and rank logic
NOT_QUICK_MARKERS = ("ray", "hosts", "gpu", "py310")
NOT_QUICK_MODULES = ("test_benchmarks.py",)


# The whole suite runs in two lanes (`-n 2 --dist loadgroup`, pytest-xdist: the README's test command), each a
# process of its own, one test at a time in each. The side lane: the tests that make their own machines or their own
# interpreter (the `ray up` hosts, in namespaces of their own; the Python 3.10 environment) and wait on them much of
# the time, and the benchmarks' scripts, each a process with a Ray of its own. The main lane: the rest, on its own
# session Ray cluster. About 40 % of the 2 cores sat idle when one process ran them all (CONTRIBUTING.md has the
# figures). test_gpu.py's CPU cases (no Ray: the loop, compile, two gloo ranks) run in the side lane too, to even
# the lanes: in a fresh-clone run the main lane's tests took 3619 s, the side lane's 2910 s, test_gpu.py's 353 s.
# With it moved: main 3395 s, side 2797 s; test_docs.py (222 s, no session cluster: its quickstart is a process with
# a Ray of its own, its site build and browser none) went too. A later fresh-clone run: main 3864 s, side 3416 s;
# test_batches.py (165 s) and test_noise.py (87 s), rank processes and no session cluster, moved to the side lane, with
# test_report_reuse.py (30 s, no Ray), as test_confirm_fitted.py (110 s) joined the main lane; test_ray_start.py (40 s,
# a driver process with a Ray of its own) went there too. Once the long tier left CI (`-m long`), with the 3.10 sweep
# in it, the side lane had about 2500 s of a fresh-clone run's tests left (a21e053) against the main lane's 4540 s
# (3268 s there, and 1272 s of its tests that the run's timeout left unrun, run later beside the `ray up` tests): four
# modules that need no Ray (ranks, the loop, compile, the clock's paths; 320 s) moved to it, and two that sweep on the
# session's cluster (test_search.py's TPE sweep with its resume, test_user_sweeps.py's example networks; 655 s): the
# side lane then starts a session cluster of its own, a Ray start and its idle daemons for ~10 minutes.
SIDE_LANE_MARKERS = ("hosts", "py310")
SIDE_LANE_MODULES = ("test_benchmarks.py", "test_driver_scale.py",  # each a subprocess of its own, its own Ray
                     "test_gpu.py", "test_docs.py", "test_batches.py", "test_noise.py", "test_report_reuse.py",
                     "test_ray_start.py", "test_models.py", "test_paths.py", "test_compile_limits.py",
                     "test_loop_pieces.py", "test_search.py", "test_user_sweeps.py")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the groups (xdist/remote.py)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name not in NOT_QUICK_MODULES and not any(item.get_closest_marker(m) for m in NOT_QUICK_MARKERS):
            item.add_marker(pytest.mark.quick)
        side = item.path.name in SIDE_LANE_MODULES or any(item.get_closest_marker(m) for m in SIDE_LANE_MARKERS)
        item.add_marker(pytest.mark.xdist_group("side" if side else "main"))


def pytest_configure(config):
    config._cpu_account = cpu_account.start(config)  # RAYSWEEP_CPU_ACCOUNT=DIR: CPU seconds per test


def pytest_unconfigure(config):
    cpu_account.stop(getattr(config, "_cpu_account", None))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    yield from cpu_account.measured(item.config._cpu_account, item.nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test that fails with MemoryError (a C++ std::bad_alloc arrives as one) gets a section naming the machine's
    memory at that moment and the processes that held most of it: CI keeps only the output."""
    outcome = yield
    if call.excinfo is not None and call.excinfo.errisinstance(MemoryError):
        outcome.get_result().sections.append(("memory at the failure", _memory_now()))


def _memory_now(top: int = 12) -> str:
    import psutil

    vm = psutil.virtual_memory()
    rows = []
    for p in psutil.process_iter(["pid", "cmdline", "name", "memory_info"]):
        try:
            command = " ".join(p.info["cmdline"] or [p.info["name"]])[:90]
            rows.append((p.info["memory_info"].rss, p.info["pid"], command))
        except (psutil.Error, TypeError, AttributeError):
            pass
    rows.sort(reverse=True)
    return "\n".join([f"available {vm.available / 2**30:.1f} of {vm.total / 2**30:.1f} GiB, {len(rows)} processes"]
                     + [f"{rss / 2**20:8.0f} MiB  pid {pid}  {cmd}" for rss, pid, cmd in rows[:top]])


@contextmanager
def s3_api(ip: str):
    """A real S3 API (moto's server) on `ip`, a free port, with bucket `sweeps`; yields (the storage URI root that
    reaches it, a boto3 client). Its credentials are AWS_TEST_ENV's dummies."""
    import boto3
    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind((ip, 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address=ip, port=port, verbose=False)
    server.start()
    try:
        client = boto3.client("s3", endpoint_url=f"http://{ip}:{port}", region_name="us-east-1")
        client.create_bucket(Bucket="sweeps")
        yield f"s3://sweeps/runs?endpoint_override={ip}:{port}&scheme=http", client
    finally:
        server.stop()


@pytest.fixture(scope="session", autouse=True)
def _cache_dir(tmp_path_factory):
    """Synthetic sets are cached per test session, never in the user's cache."""
    os.environ["RAYSWEEP_CACHE_DIR"] = str(tmp_path_factory.mktemp("cache"))


def _start_session_ray():
    import ray

    from raysweep.cluster import ray_init_kwargs

    ray.init(num_cpus=2, **ray_init_kwargs(worker_start_timeout_s=WORKER_START_TIMEOUT_S))
    return ray


@pytest.fixture(scope="session")
def ray_cluster():
    ray = _start_session_ray()
    yield ray
    ray.shutdown()


CLEAN_WITHIN_S = 60  # what a finished sweep leaves: actors and placement groups removed asynchronously, in seconds


def _held(ray) -> str:
    """What holds the session cluster's resources beyond what it had before any test: '' when nothing."""
    from ray.util.state import list_actors, list_placement_groups

    total, free = ray.cluster_resources(), ray.available_resources()
    held = {k: v - free.get(k, 0.0) for k, v in total.items()
            if k in ("CPU", "GPU", "trial_driver") and v - free.get(k, 0.0) > 1e-6}
    if not held:
        return ""
    address = ray.get_runtime_context().gcs_address
    actors = [f"{a.class_name}(pid {a.pid})" for a in list_actors(
        address=address, filters=[("state", "=", "ALIVE")], limit=10_000, raise_on_missing_output=False)]
    groups = [f"{g.placement_group_id[:8]} {g.state}" for g in list_placement_groups(
        address=address, limit=10_000, raise_on_missing_output=False) if g.state != "REMOVED"]
    return f"held {held}; live actors {actors}; placement groups {groups}"


WATCH_BEFORE_TIMEOUT_S = 30  # what a Ray test near its timeout prints: a hang's state, before pytest-timeout ends it


def _say_what_holds_it(ray, started: float) -> None:
    """Print where every thread of this process is and what the session's cluster holds: a Ray test's captured
    output then shows why it hung (CI keeps only the output, and the Ray logs go with the machine)."""
    import faulthandler
    import sys
    import time

    state = (f"--- {time.monotonic() - started:.0f} s into the test, {WATCH_BEFORE_TIMEOUT_S} s before its timeout: "
             f"free {ray.available_resources()}; {_held(ray) or 'nothing held'}")
    print(state, flush=True)
    faulthandler.dump_traceback(file=sys.stdout, all_threads=True)
    print(state, flush=True)  # again after the stacks: a log cut short keeps one end


@pytest.fixture(autouse=True)
def _ray_test_watch(request):
    """A test on the session's cluster that nears its timeout prints what it waits on (`_say_what_holds_it`)."""
    if "ray_cluster" not in request.fixturenames:
        yield
        return
    import threading
    import time

    marker = request.node.get_closest_marker("timeout")
    timeout = float(marker.args[0]) if marker and marker.args else float(request.config.getini("timeout") or 0)
    if timeout <= WATCH_BEFORE_TIMEOUT_S:
        yield
        return
    ray = request.getfixturevalue("ray_cluster")
    watch = threading.Timer(timeout - WATCH_BEFORE_TIMEOUT_S, _say_what_holds_it, (ray, time.monotonic()))
    watch.daemon = True
    watch.start()
    yield
    watch.cancel()


@pytest.fixture(autouse=True)
def _session_ray_left_clean(request):
    """A test on the session's cluster must leave it as it found it: every CPU free again within CLEAN_WITHIN_S.
    One that does not errors here, naming what holds the resources, and the cluster is started anew: a leak (a
    sweep's group or actor outliving it, a test stopped by its timeout mid-sweep) fails that test alone, never
    every later test that needs a CPU (CI once ran every later Ray test into its timeout that way)."""
    yield
    if "ray_cluster" not in request.fixturenames:
        return
    import time

    import ray

    if not ray.is_initialized():
        return
    deadline, held = time.monotonic() + CLEAN_WITHIN_S, _held(ray)
    while held and time.monotonic() < deadline:
        time.sleep(1)
        held = _held(ray)
    if held:
        ray.shutdown()
        _start_session_ray()
        pytest.fail(f"the test left the session's Ray cluster busy after {CLEAN_WITHIN_S} s (started anew): {held}")


def tiny_spec(tmp_path: Path, **sections) -> dict:
    """A spec small enough for 2 CPU workers in seconds: 64×24 images, 192 train / 64 val."""
    spec = {
        "name": "t",
        "storage_path": str(tmp_path / "results"),
        "data": {"width": 64, "height": 24, "synthetic": {"train_size": 192, "val_size": 64, "seed": 0}},
        "scaling": {"num_workers": 2, "use_gpu": False, "cpus_per_worker": 1},
        "train": {"epochs": 3, "reference_batch_size": 64},
        "search": {"per_gpu_batch_size": 16, "base_lr": 2.0e-3, "warmup_epochs": 1, "weight_decay": 1.0e-4},
        "tune": {"num_samples": 1, "asha": {"grace_period": 1}},
        "mlflow": {"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}"},
    }
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(spec.get(key), dict):
            spec[key] = {**spec[key], **value}
        else:
            spec[key] = value
    return spec


def write_spec(tmp_path: Path, spec: dict | str, name: str = "spec.yaml") -> Path:
    path = tmp_path / name
    path.write_text(spec if isinstance(spec, str) else yaml.safe_dump(spec, sort_keys=False))
    return path


REQUIRE_BROWSER = os.environ.get("RAYSWEEP_REQUIRE_BROWSER") == "1"


@pytest.fixture
def browser():
    """Headless Chromium through Debian's chromedriver; skipped where a piece is missing, failed under .ci/run."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        webdriver = None
    binary, driver = shutil.which("chromium"), shutil.which("chromedriver")
    missing = [what for what, found in (("the selenium package (pip install -e '.[test]')", webdriver),
                                        ("chromium (apt-get install chromium)", binary),
                                        ("chromedriver (apt-get install chromium-driver)", driver)) if not found]
    if missing:
        message = f"no real browser: {', '.join(missing)} not found"
        if REQUIRE_BROWSER:
            pytest.fail(f"{message}; RAYSWEEP_REQUIRE_BROWSER=1 (set by .ci/run, which installs them) makes this a "
                        f"failure, not a skip", pytrace=False)
        pytest.skip(message)
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1600,1000"):
        options.add_argument(arg)
    chrome = webdriver.Chrome(service=Service(driver), options=options)
    try:
        yield chrome
    finally:
        chrome.quit()
