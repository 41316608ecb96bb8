"""The driver lost the hard way: SIGKILL the Ray GCS under a running `tune` (the driver's own local cluster). Ray
ends the driver about 60 s later with no Python cleanup; the script prints what MLflow holds right after, and
after the next raysweep command on the store (`report`), which ends a dead driver's runs FAILED (driver lost).

    python benchmarks/driver_lost.py      # about 3 minutes here
"""
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from conftest import tiny_spec, write_spec  # noqa: E402

tmp = Path(tempfile.mkdtemp(prefix="gcskill-"))
spec = write_spec(tmp, tiny_spec(tmp, train={"epochs": 30, "reference_batch_size": 64}))
log = open(tmp / "driver.log", "w")
t0 = time.monotonic()
driver = subprocess.Popen([sys.executable, "-m", "raysweep", "tune", str(spec)], cwd=ROOT, stdout=log,
                          stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
from mlflow.tracking import MlflowClient  # noqa: E402  (imported while the driver starts)

uri = f"sqlite:///{tmp / 'mlflow.db'}"


def statuses():
    if "] start " not in (tmp / "driver.log").read_text():  # the driver creates and migrates the store first
        return []
    c = MlflowClient(uri)
    e = c.get_experiment_by_name("t")
    return [] if e is None else [(r.info.run_name, r.info.status, r.data.tags.get("error"))
                                 for r in c.search_runs([e.experiment_id])]


while time.monotonic() - t0 < 300:
    time.sleep(2)
    s = statuses()
    if len(s) >= 2:  # the parent and a trial: wait for the trial's first epoch
        c = MlflowClient(uri)
        e = c.get_experiment_by_name("t")
        kids = [r for r in c.search_runs([e.experiment_id]) if "mlflow.parentRunId" in r.data.tags]
        if kids and c.get_metric_history(kids[0].info.run_id, "epoch"):
            break
gcs = [p for p in psutil.Process(driver.pid).children(recursive=True) if "gcs_server" in " ".join(p.cmdline())]
print(f"{time.monotonic() - t0:.0f}s: killing gcs_server {[p.pid for p in gcs]}; MLflow: {statuses()}", flush=True)
tree = psutil.Process(driver.pid).children(recursive=True)
for p in gcs:
    p.kill()
t_kill = time.monotonic()
try:
    code = driver.wait(timeout=240)
except subprocess.TimeoutExpired:
    code = None
print(f"driver exit {code} after {time.monotonic() - t_kill:.0f}s; MLflow: {statuses()}", flush=True)
print("driver log tail:", (tmp / "driver.log").read_text()[-1500:], flush=True)
if driver.poll() is None:
    driver.kill()
for p in tree:
    try:
        p.kill()
    except psutil.NoSuchProcess:
        pass
r = subprocess.run([sys.executable, "-m", "raysweep", "report", str(spec)], cwd=ROOT, capture_output=True, text=True)
print(f"report exit {r.returncode}; stderr: {r.stderr[-600:]}")
print(f"after report: MLflow: {statuses()}")
