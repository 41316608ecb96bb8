"""Soak: a long sweep under faults, then an audit of the MLflow store (outside the CI suite).

A sweep of --trials trials (room for one at a time: 2 CPU workers on this 2-core machine) runs in a
driver process this script starts, logging to an `mlflow server` on loopback (over SQLite) that this
script also runs. The faults, each real:
- every --kill-every seconds a random rank of the running trial is SIGKILLed (its worker group restarts
  from the trial's checkpoint, within train.max_failures);
- every --host-kill-every seconds the slot host is SIGKILLed (its controller and workers go with it: the
  trial's attempt ends `infra` and it continues from its checkpoint on a new group);
- the tracking server is SIGKILLed --store-restarts times and started again --store-outage seconds later
  on the same database (writes retried within mlflow.retry_s: no trial may fail for it);
- the broker is SIGKILLed --broker-kills times (the sweep ends with the cause, exit 1) and the driver
  --driver-kills times; each is followed by `tune --resume`.
At the end the MLflow store must hold every trial, each child run terminal, none FAILED for the
infrastructure, and exactly one value per (run, metric, epoch) with no gap. Then the same
sweep runs again without a fault (its twin, in a store of its own): a resumed trial must be the trial it
would have been, so every trial must have its twin's metrics at every epoch, bitwise (the same search seed
draws the same trials in the same order; CPU kernels and gloo's two-rank sums are deterministic here).

    python benchmarks/soak.py            # 24 trials + their twins, about 30 minutes here
    python benchmarks/soak.py --quick    # 6 trials, one of each kill, one store restart

Last line: RESULT soak trials=.. faults=.. restarts=.. lost=.. duplicates=.. infra_failed=.. diverged_from_twin=..
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
from process_tree import descendants, sigkill_driver  # noqa: E402

SPEC = """
name: soak
storage_path: {tmp}/results
data: {{width: 64, height: 24, synthetic: {{train_size: 384, val_size: 64, seed: 0}}}}
scaling: {{num_workers: 2, cpus_per_worker: 1}}
train: {{epochs: 4, reference_batch_size: 64, max_failures: 20}}
search:
  per_gpu_batch_size: {{choice: [16, 32], default: 16}}
  base_lr: {{loguniform: [1.0e-4, 3.0e-3], default: 1.0e-3}}
  warmup_epochs: {{randint: [0, 1], default: 1}}
  weight_decay: {{loguniform: [1.0e-5, 1.0e-2], default: 1.0e-4}}
tune: {{num_samples: {trials}, seed: 0, asha: {{grace_period: 1, reduction_factor: 2}}}}
mlflow: {{tracking_uri: "{uri}"}}
"""


def train_workers(driver_pid: int, title: str = "RayTrainWorker"):
    """The driver's Ray processes whose Ray process title names `title` (RayTrainWorker, SlotHost, BrokerActor)."""
    found = []
    for p in descendants(driver_pid):
        try:
            if title in " ".join(p.cmdline()):
                found.append(p)
        except Exception:
            pass
    return found


class Server:
    """`mlflow server` on loopback over the soak's SQLite database, in a session of its own (killed by group)."""

    def __init__(self, tmp: str):
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.tmp, self.proc = tmp, None
        self.uri = f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        import urllib.request

        mlflow = str(Path(sys.executable).with_name("mlflow"))
        log = open(Path(self.tmp) / "server.log", "ab")
        self.proc = subprocess.Popen([mlflow, "server", "--backend-store-uri", f"sqlite:///{self.tmp}/mlflow.db",
                                      "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
                                      "--artifacts-destination", f"{self.tmp}/artifacts"],
                                     stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{self.uri}/health", timeout=2)
                return
            except OSError as err:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"mlflow server did not start (see {self.tmp}/server.log)") from err
                time.sleep(0.5)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)  # the server and its workers, nothing else
            self.proc.wait(timeout=30)


TWIN_METRICS = ("train_loss", "val_loss", "val_exact_acc", "grad_norm", "lr", "samples_seen")


class Store:
    def __init__(self, uri: str):
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(uri)

    def children(self):
        experiment = self.client.get_experiment_by_name("soak")
        if experiment is None:
            return []
        return [r for r in self.client.search_runs([experiment.experiment_id], max_results=1000)
                if "mlflow.parentRunId" in r.data.tags]

    def epochs(self, run_id: str) -> list[int]:
        return [int(m.step) for m in self.client.get_metric_history(run_id, "epoch")]

    def logged_count(self) -> int:
        return sum(len(self.epochs(r.info.run_id)) for r in self.children())

    def histories(self) -> dict[str, dict[str, dict[int, float]]]:
        """{trial index (the sweep's n-th trial): {metric: {epoch: value}}}: what the twin comparison reads."""
        return {r.info.run_name.rsplit("_", 1)[-1]: {m: {int(x.step): x.value for x in
                                                         self.client.get_metric_history(r.info.run_id, m)}
                                                     for m in TWIN_METRICS}
                for r in self.children()}


def run_twin(trials: int, env: dict) -> dict:
    """The same sweep without a fault, in a folder and store of its own: the histories of its trials."""
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "soak.yaml"
        spec.write_text(SPEC.format(tmp=tmp, trials=trials, uri=f"sqlite:///{tmp}/mlflow.db"))
        with open(Path(tmp) / "twin.log", "w") as log:
            code = subprocess.run([sys.executable, "-m", "raysweep", "tune", str(spec), "--progress-every", "600"],
                                  cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
        if code != 0:
            print((Path(tmp) / "twin.log").read_text()[-3000:])
        return Store(f"sqlite:///{tmp}/mlflow.db").histories()


def compare_twins(faulted: dict, twins: dict) -> list[str]:
    """The trials whose metrics differ from their twin's at some epoch (or that ran other epochs), described."""
    diverged = []
    for index, history in sorted(faulted.items()):
        twin = twins.get(index)
        if twin is None:
            diverged.append(f"trial {index}: no twin")
            continue
        for metric, values in history.items():
            if values != twin[metric]:
                epochs = sorted(set(values) | set(twin[metric]))
                worst = max((abs(values[e] - twin[metric][e]) for e in epochs if e in values and e in twin[metric]),
                            default=float("nan"))
                diverged.append(f"trial {index}: {metric} epochs {sorted(values)} vs the twin's "
                                f"{sorted(twin[metric])}, largest difference {worst:.3g}")
                break
    return diverged


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=24)
    p.add_argument("--kill-every", type=float, default=20.0, help="seconds between worker kills")
    p.add_argument("--driver-kills", type=int, default=2)
    p.add_argument("--host-kill-every", type=float, default=45.0, help="seconds between slot host kills")
    p.add_argument("--broker-kills", type=int, default=1)
    p.add_argument("--store-restarts", type=int, default=1)
    p.add_argument("--store-outage", type=float, default=65.0, help="seconds the tracking server stays down")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    if a.quick:
        a.trials, a.driver_kills, a.host_kill_every = 6, 1, 30.0
    rng = random.Random(a.seed)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "RAY_AUTH_MODE": "token"}

    with tempfile.TemporaryDirectory() as tmp:
        server = Server(tmp)
        server.start()
        spec = Path(tmp) / "soak.yaml"
        spec.write_text(SPEC.format(tmp=tmp, trials=a.trials, uri=server.uri))
        store = Store(f"sqlite:///{tmp}/mlflow.db")  # the audit reads the database itself
        worker_kills, host_kills, restart_s, resume_s, drivers = 0, 0, [], [], 0
        # the driver and the broker are killed at even steps through the sweep (by trials ended), in turn
        stops = a.driver_kills + a.broker_kills
        kinds = ["broker"] * a.broker_kills + ["driver"] * a.driver_kills
        kill_after = [(round(a.trials * (i + 1) / (stops + 1)), kind) for i, kind in enumerate(kinds)]
        store_down_after = [round(a.trials * (i + 0.5) / (a.store_restarts + 1)) for i in range(a.store_restarts)]
        t_start = time.monotonic()
        exits = []  # the drivers that ended on a broker kill: 1 each
        next_host_kill = time.monotonic() + a.host_kill_every  # across drivers: each segment may be shorter
        while True:
            resume = drivers > 0
            log = open(Path(tmp) / f"driver-{drivers}.log", "w")
            cmd = [sys.executable, "-m", "raysweep", "tune", str(spec), "--progress-every", "600"]
            driver = subprocess.Popen(cmd + (["--resume"] if resume else []), cwd=ROOT, env=env, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True)
            drivers += 1
            t_driver, logged_at_start = time.monotonic(), store.logged_count()
            next_kill = time.monotonic() + a.kill_every
            pending_restart = None  # (run id, epochs logged, kill time)
            killed_driver = False
            while driver.poll() is None:
                time.sleep(1.0)
                now = time.monotonic()
                if resume and len(resume_s) < drivers - 1 and store.logged_count() > logged_at_start:
                    resume_s.append(now - t_driver)  # resume → the first new epoch in MLflow
                running = [r for r in store.children() if r.info.status == "RUNNING"]
                if pending_restart:
                    if len(store.epochs(pending_restart[0])) > pending_restart[1]:
                        restart_s.append(now - pending_restart[2])  # kill → the trial's next epoch
                        pending_restart = None
                if now >= next_kill and running:
                    workers = train_workers(driver.pid)
                    if workers:
                        victim = rng.choice(workers)
                        victim.kill()
                        worker_kills += 1
                        run = running[0]
                        pending_restart = (run.info.run_id, len(store.epochs(run.info.run_id)), now)
                    next_kill = now + a.kill_every
                if now >= next_host_kill and running:
                    hosts = train_workers(driver.pid, "SlotHost")
                    if hosts:
                        hosts[0].kill()
                        host_kills += 1
                    next_host_kill = now + a.host_kill_every
                ended = sum(r.info.status in ("FINISHED", "KILLED", "FAILED") for r in store.children())
                if store_down_after and ended >= store_down_after[0] and running:
                    store_down_after.pop(0)
                    server.kill()
                    print(f"[{time.monotonic() - t_start:6.0f}s] tracking server SIGKILLed with {ended} trials "
                          f"ended; back in {a.store_outage:.0f} s", flush=True)
                    time.sleep(a.store_outage)  # the sweep goes on against a store that is gone
                    server.start()
                if kill_after and ended >= kill_after[0][0] and running:
                    _, kind = kill_after.pop(0)
                    brokers = train_workers(driver.pid, "BrokerActor") if kind == "broker" else []
                    if brokers:  # the sweep ends with the cause (exit 1): resumed below
                        brokers[0].kill()
                        driver.wait(timeout=300)
                        exits.append(driver.returncode)
                    else:
                        sigkill_driver(driver)
                        kind = "driver"
                    killed_driver = True
                    print(f"[{time.monotonic() - t_start:6.0f}s] {kind} SIGKILLed with {ended} trials ended",
                          flush=True)
                    break
            log.close()
            if not killed_driver:
                break
        code = driver.returncode
        server.kill()
        wall = time.monotonic() - t_start
        tail = (Path(tmp) / f"driver-{drivers - 1}.log").read_text().splitlines()[-12:]
        print("\n".join(tail))

        # the audit: every trial present and terminal, one value per (metric, epoch), no gap
        from raysweep.metrics import METRIC_NAMES

        children = store.children()
        names = {r.info.run_name for r in children}
        lost = max(0, a.trials - len(names))
        duplicates = len(children) - len(names)  # a trial with two runs
        not_terminal = [r.info.run_name for r in children if r.info.status not in ("FINISHED", "KILLED", "FAILED")]
        for run in children:
            for name in METRIC_NAMES:
                steps = [int(m.step) for m in store.client.get_metric_history(run.info.run_id, name)]
                duplicates += len(steps) - len(set(steps))
                lost += len(set(range(1, max(steps, default=0) + 1)) - set(steps))
        statuses = {s: sum(r.info.status == s for r in children) for s in ("FINISHED", "KILLED", "FAILED")}
        infra_failed = sum(r.info.status == "FAILED" and r.data.tags.get("failure") == "infra" for r in children)
        for r in children:
            if r.info.status == "FAILED":
                print(f"failed: {r.info.run_name}: {r.data.tags.get('error', '(no error tag)')[:600]}")
        print(f"soak: exit {code}, {wall:.0f} s, {len(names)} trials ({statuses}), {worker_kills} worker kills, "
              f"{host_kills} slot host kills, {a.store_restarts} tracking server restarts, {drivers - 1} driver or "
              f"broker kills + resumes (broker kills' exits {exits}), not terminal: {not_terminal or 'none'}")
        if restart_s:
            print(f"worker restart (kill → the trial's next epoch in MLflow): "
                  f"median {statistics.median(restart_s):.1f} s, n={len(restart_s)}, "
                  f"all {[round(s, 1) for s in restart_s]}")
        if resume_s:
            print(f"resume (tune --resume → the first new epoch in MLflow): "
                  f"median {statistics.median(resume_s):.1f} s, all {[round(s, 1) for s in resume_s]}")
        faulted = store.histories()
    t_twin = time.monotonic()
    diverged = compare_twins(faulted, run_twin(a.trials, env))
    print(f"twin: the same sweep without a fault, {time.monotonic() - t_twin:.0f} s; "
          f"{len(faulted) - len(diverged)} of {len(faulted)} trials match it at every epoch, bitwise")
    for line in diverged:
        print(f"  {line}")
    ok = (code == 0 and not not_terminal and lost == 0 and duplicates == 0 and infra_failed == 0 and not diverged
          and all(e == 1 for e in exits))
    faults = worker_kills + host_kills + a.store_restarts + drivers - 1
    print(f"RESULT soak trials={len(names)} faults={faults} restarts={drivers - 1} lost={lost} "
          f"duplicates={duplicates} infra_failed={infra_failed} diverged_from_twin={len(diverged)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
