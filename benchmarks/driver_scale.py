"""How far one sweep driver goes: the driver's own code (`sweep.Sweep`'s open_runs and fit: Tune's loop with the
real `relay.run_trial` in each trial actor, ASHA at its decision points, the driver's callbacks, the MLflow writer on
SQLite, the console) and the real broker (`slots.Broker`, in its actor), with the slots simulated, at 8, 32 and 128
concurrent trials.

    python benchmarks/driver_scale.py                                  # epochs that take no time: the ceiling
    python benchmarks/driver_scale.py --epoch-s 1 --concurrency 8 16 32 128
    python benchmarks/driver_scale.py --quick                          # 2 trials at once: the smoke test

The broker's `launch` (the injectable part: a slot's long-lived trainer) is a call to one actor that plays every
slot's rank 0 as `worker/entry.slot_worker` does: ask for a trial, report each epoch, wait for the store before a
checkpoint epoch (`Broker.recorded_through`) and for ASHA's decision at a rung (`Broker.report`), take the next
trial. An epoch takes `--epoch-s` (± `--jitter`, per trial, so the slots drift apart as real ones do) and trains
nothing: no Ray Train, no torch, no data. The slots begin once every trial actor is up (Ray starting a Python
process per concurrent trial is a ramp, not the driver's work), and the figures are taken from then to the last
trial's start (after it the sweep winds down): see DriverFigures.

Measured per concurrency: reports Tune handled a second; the lag from a slot posting a report to Tune taking it
(the relay's ack, or Tune's stop, at the broker), and from a slot posting a rung's report to ASHA's decision
reaching it (p50, p99); how long a checkpoint epoch waited for the store; the MLflow writer's queue
(`Writer.queue.qsize()` every 0.1 s: largest, at the window's end, its slope), the writes it finished a second and
the MlflowClient calls they made; the cores each part used (the driver's Tune loop and writer threads, the trial
actors, the broker, other jobs on the machine) and the driver's CPU milliseconds per report; the trial actors'
memory (unique set size). `busy` is the share of the slots' time spent in epochs (1.0: none ever waited).

One line per concurrency, then `RESULT driver_scale ...` per concurrency and, with `--epoch-s`, `RESULT
driver_scale_sustained value=<the highest concurrency sustained>`: the decision lag and a checkpoint's wait for the
store within SMALL_LAG of an epoch at p99, and a writer whose backlog does not grow (at the window's end no more
writes queued than trials running). A concurrency whose trial actors would not fit in the memory available is not
run, and one that brings the machine below MEM_FLOOR_GIB is stopped early (its line says so).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SLOTS_ACTOR = "driver-scale-slots"  # the named actor that plays every slot's rank 0 (SimulatedBroker finds it)
TRAIN_SIZE = 512  # what the trials' configs are derived from (no data is loaded)
SMALL_LAG = 0.5  # a lag is small while at most this share of an epoch (a slot idles at most that long at a rung)
SAMPLE_EVERY_S = 0.1  # the writer's queue and the memory in use
TREE_EVERY_S, USS_EVERY_S = 0.5, 5.0  # CPU seconds of every process of the run; the trial actors' unique memory
ACTOR_MIB_GUESS = 140.0  # a trial actor's own memory until one is measured here (Ray 2.60 and raysweep's imports)
MEM_MARGIN_GIB = 4.0  # memory left free for everything else on the machine, before a concurrency starts
MEM_FLOOR_GIB = 3.0  # below this much available while it runs, the run is cut short (Ctrl-C to Tune): other jobs
STORE_METHODS = ("create_run", "log_batch", "set_tag", "set_terminated", "get_run", "search_runs",
                 "get_metric_history", "update_run", "delete_tag")  # the MlflowClient calls the writer makes
RAMP_WAIT_S = 900.0  # the longest the slots wait for every trial actor to start before they begin anyway


@dataclass(frozen=True)
class DriverFigures:
    """One concurrency's run, as the driver saw it. The window: from the moment every slot had its first trial (the
    slots wait for all: Ray starting a process per trial actor is the ramp, not the driver) to the last trial's
    start (after it the sweep winds down)."""

    concurrency: int  # trials Tune may run at once (the broker's slots)
    trials: int  # trials in the sweep (tune.num_samples)
    epoch_s: float  # a simulated epoch's seconds (before jitter)
    actors_up_s: float  # fit() → every slot with its first trial: every trial actor started
    max_running: int  # the most trials Tune had running at once
    results: int  # reports Tune handled in the window
    window_s: float
    reports_per_s: float  # results ÷ window_s
    handled_lag_p50_s: float  # a report posted by its slot → Tune took it (its ack or its stop at the broker)
    handled_lag_p99_s: float
    decision_lag_p50_s: float  # a rung's report posted → ASHA's decision back at the slot (continue or stop)
    decision_lag_p99_s: float
    store_wait_p50_s: float  # a checkpoint epoch's wait for the store to hold the epochs before it
    store_wait_p99_s: float
    slot_busy: float  # share of the slots' time in epochs in the window (epoch_s > 0; 1.0: none ever waited)
    backlog_max: int  # the MLflow writer's queued writes, largest sample
    backlog_end: int  # queued at the window's end
    backlog_growth_per_s: float  # least-squares slope of the queue over the window (writes per second)
    drain_s: float  # the last report Tune handled → the writer's last write done: how far behind it ended
    tune_loop_cpu: float  # the driver's main thread (Tune's loop and its callbacks), share of one core
    writer_cpu: float  # the MLflow writer's thread, share of one core
    driver_cores: float  # the driver process (its threads together), cores
    trial_actor_cores: float  # the trial actors (the relays), cores
    broker_cores: float  # the broker actor, cores
    slots_cores: float  # the simulated slots' actor, cores
    ray_cores: float  # Ray's own processes (GCS, raylet, dashboard, idle workers), cores
    other_cores: float  # processes outside this run (other jobs on the machine), cores
    machine_cpu: float  # every process, share of all cores
    writes_per_s: float  # writes the MLflow writer finished a second (a report's is one log_batch)
    driver_ms_per_report: float  # the driver process's CPU per report handled (its threads share one GIL)
    writer_ms_per_report: float  # of which the MLflow writer's thread
    tune_loop_ms_per_report: float  # of which Tune's loop
    actors_mem_gb: float  # the trial actors' unique memory together, when most were alive
    actor_uss_mb: float  # one trial actor's unique memory (their mean then)
    min_available_gb: float  # the machine's available memory at its lowest during the run (other jobs' too)
    store_calls_per_report: float  # MlflowClient calls the writer made per report handled (each its own transaction)
    result_calls_share: float  # of which one per report (its log_batch): the rest is each trial's start and end
    finished: int
    pruned: int
    failed: int
    cut_short: bool = False  # the machine ran short of memory (MEM_FLOOR_GIB): Tune was stopped early
    store_calls: str = ""  # the writer's MlflowClient calls in the window, by method

    @property
    def driver_ceiling_per_s(self) -> float:
        """Reports a second the driver process could handle with a core to itself: 1000 ÷ its CPU ms a report
        (an estimate: its threads share one GIL, and SQLite's own time in C does not hold it)."""
        return 1000.0 / self.driver_ms_per_report if self.driver_ms_per_report > 0 else float("inf")

    @property
    def sustained(self) -> bool:
        """What "sustained" means: the lag stays small (ASHA's decision back at a slot, and a checkpoint's wait for the
        store, within SMALL_LAG of an epoch at p99) and the writer's backlog does not grow (at the window's end no
        more than one write queued per running trial)."""
        small = SMALL_LAG * self.epoch_s
        return (self.decision_lag_p99_s <= small and self.store_wait_p99_s <= small
                and self.backlog_end <= self.max_running)

    def gives_first(self) -> str:
        """What limited this run: a driver thread or the broker (each one core at most) near a full core, else the
        writer's growing queue, else the machine's CPUs (everything above shares them), else nothing."""
        if self.tune_loop_cpu >= 0.85:
            return "tune-loop"
        if self.writer_cpu >= 0.85 or self.backlog_end > self.max_running:
            return "mlflow-writer"
        if self.broker_cores >= 0.85:
            return "broker"
        if self.machine_cpu >= 0.9:
            return "machine-cpu"
        return "nothing"


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank q-th percentile (0 < q <= 100); NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, int(round(q / 100 * len(ordered) + 0.5)) - 1))]


def slope(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope of (t, y) samples: y per second (0 for fewer than two)."""
    if len(samples) < 2:
        return 0.0
    mean_t = statistics.fmean(t for t, _ in samples)
    mean_y = statistics.fmean(y for _, y in samples)
    var = sum((t - mean_t) ** 2 for t, _ in samples)
    return sum((t - mean_t) * (y - mean_y) for t, y in samples) / var if var else 0.0


def bench_config(folder: Path, concurrency: int, trials: int, epochs: int, checkpoint_every: int):
    """The sweep's spec: `trials` trials of `epochs` epochs, ASHA cutting at 1, 2, 4, ... epochs, MLflow on
    SQLite in `folder`."""
    from raysweep.config import SweepConfig

    return SweepConfig.model_validate({
        "name": f"driver-scale-{concurrency}",
        "storage_path": str(folder / "results"),
        "scaling": {"num_workers": 2, "use_gpu": False, "cpus_per_worker": 1},
        "train": {"epochs": epochs, "reference_batch_size": 64, "checkpoint_every": checkpoint_every},
        "search": {"per_gpu_batch_size": {"choice": [16, 32], "default": 32},
                   "base_lr": {"loguniform": [1.0e-4, 3.0e-3], "default": 1.0e-3},
                   "warmup_epochs": 0, "weight_decay": 1.0e-4},
        "tune": {"num_samples": trials, "max_concurrent_trials": concurrency, "seed": 0,
                 "asha": {"grace_period": 1, "reduction_factor": 2}},
        "mlflow": {"tracking_uri": f"sqlite:///{folder / 'mlflow.db'}"},
    })


# ---------------------------------------------------------------------------------------------
# The simulated slots (Ray actors)


def epoch_report(trial_id: str, epoch: int, epochs: int, epoch_s: float) -> dict:
    """A slot's report for one epoch of `epochs`, as `metrics.report_dict` builds it on a real one: the trial's
    val_loss falls with its epochs from a level set by its id (so ASHA has trials to cut)."""
    from raysweep.metrics import EpochMetrics, WorkerParams, report_dict

    level = zlib.crc32(trial_id.encode()) / 2**32
    loss = 0.5 + level + 1.0 / epoch
    metrics = EpochMetrics(epoch=epoch, samples_seen=epoch * TRAIN_SIZE, train_loss=loss, val_loss=loss,
                           val_exact_acc=0.0, val_char_acc=0.1, lr=1e-3, grad_norm=1.0, grad_norm_max=2.0,
                           clip_fraction=0.0, epoch_time_s=epoch_s, samples_per_s=TRAIN_SIZE / max(epoch_s, 1e-3),
                           peak_mem_allocated_gb=0.0, peak_mem_reserved_gb=0.0, rss_gb=0.5,
                           train_seconds=epoch * epoch_s)
    params = WorkerParams(device_name="simulated", precision_used="fp32", micro_batch_size=32,
                          accumulation_steps=1, oom_downshifts=0, nodes="simulated", resolved_epochs=epochs,
                          model_parameters=1)
    return report_dict(metrics, params)


class SimulatedSlots:
    """Every slot's rank 0 at once (`worker/entry.slot_worker`, its calls to the broker in the same order), with
    epochs of `epoch_s` that train nothing; keeps how long each wait on the driver took."""

    def __init__(self, epoch_s: float, jitter: float, decision_points: tuple[float, ...], store_wait_s: float,
                 slots: int, ramp_wait_s: float):
        self.epoch_s, self.jitter, self.store_wait_s = epoch_s, jitter, store_wait_s
        self.decision_points = decision_points
        self.slots, self.ramp_wait_s = slots, ramp_wait_s
        self.launched, self.all_launched, self.released_at = 0, None, None
        self.decision_lags: list[float] = []  # a rung's report → its answer
        self.store_waits: list[float] = []  # recorded_through before a checkpoint
        self.epochs: list[tuple[float, float]] = []  # (ended at, its seconds) of every epoch, all slots

    async def run(self, slot_id: int, trial: dict, broker) -> None:
        """One slot's fit(): take trials until the broker retires the slot; the first trial once every slot has
        one (or ramp_wait_s passed)."""
        import asyncio

        from raysweep.protocol import RETIRE

        self.launched += 1
        if self.all_launched is None:
            self.all_launched = asyncio.Event()
        if self.launched >= self.slots:
            self.all_launched.set()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.all_launched.wait(), self.ramp_wait_s)
        self.released_at = self.released_at or time.time()
        after = None
        while True:
            assignment = await broker.next_assignment.remote(slot_id, after)
            if assignment is None:
                continue  # nothing to run yet: ask again
            if assignment == RETIRE:
                return
            after = assignment.seq
            await self._trial(broker, assignment)
            await broker.finish.remote(assignment.seq, None)

    async def _trial(self, broker, assignment) -> None:
        """One Task (raysweep.protocol), as worker/entry.py runs one."""
        import asyncio

        seq, trial_id, trial = assignment.seq, assignment.trial_id, assignment.trial
        epochs, checkpoint_every = trial["train"]["epochs"], trial["train"]["checkpoint_every"]
        spread = zlib.crc32(f"{trial_id}/pace".encode()) / 2**31 - 1.0  # in [-1, 1): this trial's own pace
        epoch_s = self.epoch_s * (1.0 + self.jitter * spread)
        picked = time.time()
        timeline = {"slot_asked": picked, "group_started": picked, "data_ready": picked, "model_ready": picked,
                    "probed": picked}  # a warm group's stamps: it only had to hear of the trial
        for epoch in range(1, epochs + 1):
            if epoch_s > 0:
                await asyncio.sleep(epoch_s)
            self.epochs.append((time.time(), epoch_s))
            if epoch % checkpoint_every == 0 or epoch >= epochs:  # a checkpoint: once the store holds the epochs before
                asked = time.time()
                held = await broker.recorded_through.remote(seq, epoch - 1, self.store_wait_s)
                self.store_waits.append(time.time() - asked)
                if not held:
                    return
            payload = {**epoch_report(trial_id, epoch, epochs, epoch_s), "posted_at": time.time()}
            go = await broker.report.remote(seq, payload, timeline if epoch == 1 else None, False)
            if any(epoch - 1 < point <= epoch for point in self.decision_points):
                self.decision_lags.append(time.time() - payload["posted_at"])
            if not go:
                return

    def figures(self) -> dict:
        return {"decision_lags": self.decision_lags, "store_waits": self.store_waits,
                "epochs": self.epochs, "released_at": self.released_at}


@functools.cache
def actor_classes():
    """(the simulated slots' actor, the broker actor that launches them): made on first use (Ray is imported
    here). The broker is the real `slots.Broker` with its `launch` replaced, and the driver's side of the protocol
    noted where it arrives: a trial's submit (Tune started it), each report's ack (Tune took it and let the trial
    go on), a trial's end (Tune stopped it: ASHA)."""
    import ray

    from raysweep.slots import Broker

    @ray.remote(num_cpus=0, max_restarts=0)
    class SimulatedBroker(Broker):
        def __init__(self, capacity: int, plan):
            super().__init__(capacity, self._launch, plan.keep_warm_s)
            self.simulated = ray.get_actor(SLOTS_ACTOR)
            self.started: list[float] = []  # when each trial was submitted (its relay runs: Tune started it)
            self.handled: list[tuple[float, float]] = []  # (when, since its slot posted it) per report Tune took
            self.ended = {"finished": 0, "pruned": 0, "failed": 0}
            self.running = self.max_running = 0
            self.counted: set[str] = set()  # trials counted in `ended`

        async def _launch(self, slot_id: int, trial: dict) -> None:
            await self.simulated.run.remote(slot_id, trial, ray.get_runtime_context().current_actor)

        async def submit(self, trial_id: str, *args, **kwargs) -> int:
            self.started.append(time.time())
            self.running += 1
            self.max_running = max(self.max_running, self.running)
            return await super().submit(trial_id, *args, **kwargs)

        async def ack(self, trial_id: str, seq: int, count: int) -> None:
            a = self.trials.get(trial_id)
            if a is not None and a.seq == seq:
                now = time.time()
                self.handled += [(now, now - r["posted_at"]) for r in a.reports[a.acked:count]]
            await super().ack(trial_id, seq, count)

        async def end(self, trial_id: str) -> None:
            a = self.trials.get(trial_id)
            if a is not None and not a.done:  # Tune ended it while it ran: its unacked reports were handled
                now = time.time()
                self.handled += [(now, now - r["posted_at"]) for r in a.reports[a.acked:]]
                last = a.reports[-1]["epoch"] if a.reports else 0  # ASHA stops a trial at max_t too
                self._ended(a, "finished" if last >= a.trial["train"]["epochs"] else "pruned")
            await super().end(trial_id)

        async def finish(self, seq: int, failure=None) -> None:
            a = self._assignment(seq)
            if a is not None and not a.done:  # ran its epochs, or failed
                self._ended(a, "failed" if failure else "finished")
            await super().finish(seq, failure)

        def _ended(self, a, how: str) -> None:
            if a.trial_id not in self.counted:  # the first word on it (Tune's end, or its slot's finish)
                self.counted.add(a.trial_id)
                self.ended[how] += 1
                self.running -= 1

        def figures(self) -> dict:
            return {"started": self.started, "handled": self.handled, "ended": self.ended,
                    "max_running": self.max_running}

    return ray.remote(num_cpus=0, max_restarts=0)(SimulatedSlots), SimulatedBroker


# ---------------------------------------------------------------------------------------------
# The driver's side: a sampler of the writer's queue, CPU and memory; the writer's store calls


GROUPS = {"ray::ImplicitFunc": "trial_actors", "ray::SimulatedBroker": "broker", "ray::SimulatedSlots": "slots"}


def process_group(process) -> str:
    """Which part of the run a process of the driver's tree is: its Ray process title says (else Ray's own)."""
    title = (process.cmdline() or [""])[0]
    return next((group for prefix, group in GROUPS.items() if title.startswith(prefix)), "ray_own")


CPU_GROUPS = ("tune_loop", "writer", "driver", "trial_actors", "broker", "slots", "ray_own", "machine")


class Sampler:
    """On a thread of its own: every SAMPLE_EVERY_S the writer's queue and the machine's memory in use; every
    TREE_EVERY_S the CPU seconds used so far (CPU_GROUPS: the driver's Tune loop and writer threads, the driver,
    each part of its process tree, the whole machine), so that `cores` can say what each used in any window; every
    USS_EVERY_S the trial actors' unique memory."""

    def __init__(self, write_queue, writer_thread: threading.Thread):
        import psutil

        self.write_queue, self.writer_thread = write_queue, writer_thread
        self.process = psutil.Process()
        self.backlog: list[tuple[float, int]] = []
        self.written: list[float] = []  # when the writer finished each write (its queue's task_done)
        done = write_queue.task_done

        def task_done() -> None:
            self.written.append(time.time())
            done()

        write_queue.task_done = task_done  # this queue only: the writer calls it once per write, failed or not
        self.min_available = psutil.virtual_memory().available
        self.seen: dict[int, tuple[str, float]] = {}  # pid → (its group, CPU seconds when last seen)
        self.cpu: list[tuple[float, dict[str, float]]] = []  # (when, CPU seconds so far per CPU_GROUPS)
        self.actors_peak = (0, 0.0)  # (trial actors, their summed unique memory in bytes) when most were alive
        self.cut_short = False  # the machine's available memory fell below MEM_FLOOR_GIB: Tune was stopped
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="driver-scale-sampler", daemon=True)

    def __enter__(self):
        self.t0_wall = time.time()
        self._sample_cpu(with_uss=False)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()
        self._sample_cpu(with_uss=False)

    def _run(self) -> None:
        import psutil

        tick = 0
        while not self.done.wait(SAMPLE_EVERY_S):
            self.backlog.append((time.time(), self.write_queue.qsize()))
            available = psutil.virtual_memory().available
            self.min_available = min(self.min_available, available)
            if available < MEM_FLOOR_GIB * 2**30 and not self.cut_short:
                self.cut_short = True  # Tune takes it as Ctrl-C: it stops the trials and fit() returns
                os.kill(os.getpid(), signal.SIGINT)
            tick += 1
            if tick % round(TREE_EVERY_S / SAMPLE_EVERY_S) == 0:
                self._sample_cpu(with_uss=tick % round(USS_EVERY_S / SAMPLE_EVERY_S) == 0)

    def _sample_cpu(self, with_uss: bool) -> None:
        import psutil

        actors, unique = 0, 0.0
        for child in self.process.children(recursive=True):
            try:
                with child.oneshot():
                    group = process_group(child)  # a worker's title names its actor once it holds one
                    self.seen[child.pid] = (group, sum(child.cpu_times()[:2]))
                    if with_uss and group == "trial_actors":
                        actors, unique = actors + 1, unique + child.memory_full_info().uss
            except psutil.Error:  # ended between the listing and the read: its last reading stands
                continue
        if actors > self.actors_peak[0]:
            self.actors_peak = (actors, unique)
        totals = dict.fromkeys(CPU_GROUPS, 0.0)
        for group, seconds in self.seen.values():
            totals[group] += seconds
        threads = {t.id: t.user_time + t.system_time for t in self.process.threads()}
        totals["tune_loop"] = threads.get(threading.main_thread().native_id, 0.0)
        totals["writer"] = threads.get(self.writer_thread.native_id, 0.0)
        # the driver's own: not this sampler's thread
        totals["driver"] = sum(self.process.cpu_times()[:2]) - threads.get(self.thread.native_id or -1, 0.0)
        machine = psutil.cpu_times()
        totals["machine"] = sum(machine) - machine.idle - machine.iowait
        self.cpu.append((time.time(), totals))

    def cores(self, start: float, end: float) -> dict[str, float]:
        """Cores each of CPU_GROUPS used between the samples nearest `start` and `end`, and `others`: the machine's
        busy cores less this run's (other jobs on the machine)."""
        first = min(self.cpu, key=lambda s: abs(s[0] - start))
        last = min(self.cpu, key=lambda s: abs(s[0] - end))
        wall = max(last[0] - first[0], 1e-9)
        used = {group: (last[1][group] - first[1][group]) / wall for group in CPU_GROUPS}
        ours = sum(used[g] for g in ("driver", "trial_actors", "broker", "slots", "ray_own"))
        used["others"] = max(0.0, used["machine"] - ours)
        return used


class StoreCalls:
    """Within the `with`: every MlflowClient call (STORE_METHODS) the writer's thread makes, with its time and
    method; each is a transaction of its own on the store."""

    def __init__(self, writer_thread: threading.Thread):
        self.writer_thread = writer_thread
        self.calls: list[tuple[float, str]] = []

    def __enter__(self):
        from mlflow.tracking import MlflowClient

        self.saved = {name: getattr(MlflowClient, name) for name in STORE_METHODS}
        for name, method in self.saved.items():
            setattr(MlflowClient, name, self._counted(name, method))
        return self

    def __exit__(self, *exc):
        from mlflow.tracking import MlflowClient

        for name, method in self.saved.items():
            setattr(MlflowClient, name, method)

    def _counted(self, name: str, method):
        @functools.wraps(method)
        def counted(client, *args, **kwargs):
            if threading.current_thread() is self.writer_thread:
                self.calls.append((time.time(), name))
            return method(client, *args, **kwargs)

        return counted

    def between(self, start: float, end: float) -> dict[str, int]:
        counts: dict[str, int] = {}
        for when, name in self.calls:
            if start <= when <= end:
                counts[name] = counts.get(name, 0) + 1
        return counts


# ---------------------------------------------------------------------------------------------
# One concurrency


def open_driver(config, concurrency: int):
    """The driver (`sweep.Sweep`) as `Sweep.start` leaves it, but with no data to load and slots simulated: its plan
    `concurrency` trials at once (the machine's CPUs do not bound simulated slots), its broker a SimulatedBroker
    opened as every sweep's is (`slots.open_broker`: the driver's callbacks find it by the sweep's folder)."""
    from raysweep import slots, storage
    from raysweep.asha import AshaPlan
    from raysweep.cluster import Plan, trial_driver_node
    from raysweep.relay import SweepContext
    from raysweep.sweep import Sweep, Where

    where = Where.of(config, single=False)
    sweep = Sweep(config, where, single=False)
    sweep.plan = Plan(concurrency, f"{concurrency} simulated slots")
    sweep.broker = slots.open_broker(
        where.experiment_path, concurrency,
        slots.SlotPlan(None, "", {}, None, trial_driver_node(), config.mlflow.retry_s, config.tune.keep_warm_s),
        broker_class=actor_classes()[1])
    sweep.asha = AshaPlan.of(config)
    sweep.context = SweepContext(config.trials, TRAIN_SIZE, storage.join(where.experiment_path, "train"),
                                 sweep.broker, None, sweep.asha.decision_points, config.time_attr)
    return sweep


def run_sweep(config, concurrency: int, args, folder: Path) -> tuple[dict, dict, Sampler, StoreCalls]:
    """The sweep, run by the driver's own `Sweep.open_runs` and `Sweep.fit` (Tune, ASHA, the callbacks, the
    writer; every write in the store when it returns) on the simulated slots: returns the broker's and the slots'
    figures, the sampler and the writer's store calls."""
    import ray

    from raysweep import tracking
    from raysweep.asha import AshaPlan

    points = AshaPlan.of(config).decision_points
    simulated = actor_classes()[0].options(name=SLOTS_ACTOR).remote(args.epoch_s, args.jitter, points,
                                                                  config.mlflow.retry_s, concurrency, RAMP_WAIT_S)
    sweep = None
    try:
        sweep = open_driver(config, concurrency)
        sweep.open_runs(None)
        writer = tracking.writer(sweep.parent_run_id, config.mlflow.retry_s)
        console_out = open(folder / f"console-{concurrency}.txt", "w")
        with Sampler(writer.queue, writer.thread) as sampler, StoreCalls(writer.thread) as calls, console_out:
            with contextlib.redirect_stdout(console_out):  # the console's trial lines: kept, not shown
                sweep.fit(resume=False, progress_every_s=30.0)
        return ray.get(sweep.broker.figures.remote()), ray.get(simulated.figures.remote()), sampler, calls
    finally:
        if sweep is not None:
            sweep.close(started_ray=False)
        ray.kill(simulated)


def measure(concurrency: int, args, folder: Path) -> DriverFigures:
    """One concurrency: its sweep in a folder of its own (its own SQLite store), then its figures."""
    folder = folder / f"c{concurrency}"
    folder.mkdir()
    trials = args.trials_per_slot * concurrency
    config = bench_config(folder, concurrency, trials, args.epochs, args.checkpoint_every)
    driver, slot_side, sampler, calls = run_sweep(config, concurrency, args, folder)
    # the broker may hear of a trial's start (from its actor) before the end of the one before (from the driver)
    running = min(driver["max_running"], concurrency)
    handled = sorted(driver["handled"])
    start, end = slot_side["released_at"] or 0.0, max(driver["started"], default=0.0)
    if end - start < 1.0:  # a sweep too short to have a steady part: all of it
        start, end = handled[0][0] if handled else 0.0, handled[-1][0] if handled else 0.0
    window_s = max(end - start, 1e-9)
    results = sum(1 for t, _ in handled if start <= t <= end)
    backlog = [(t, q) for t, q in sampler.backlog if start <= t <= end]
    epochs_s = sum(seconds for t, seconds in slot_side["epochs"] if start <= t <= end)
    lags, decisions, waits = [lag for _, lag in handled], slot_side["decision_lags"], slot_side["store_waits"]
    actors, unique = sampler.actors_peak
    cores = sampler.cores(start, end)
    store_calls = calls.between(start, end)
    return DriverFigures(
        concurrency=concurrency, trials=trials, epoch_s=args.epoch_s, actors_up_s=start - sampler.t0_wall,
        max_running=running, results=results, window_s=window_s, reports_per_s=results / window_s,
        handled_lag_p50_s=percentile(lags, 50), handled_lag_p99_s=percentile(lags, 99),
        decision_lag_p50_s=percentile(decisions, 50), decision_lag_p99_s=percentile(decisions, 99),
        store_wait_p50_s=percentile(waits, 50), store_wait_p99_s=percentile(waits, 99),
        slot_busy=min(1.0, epochs_s / (running * window_s)) if args.epoch_s > 0 else float("nan"),
        backlog_max=max((q for _, q in sampler.backlog), default=0), backlog_end=backlog[-1][1] if backlog else 0,
        backlog_growth_per_s=slope(backlog), tune_loop_cpu=cores["tune_loop"],
        drain_s=max(max(sampler.written, default=0.0) - handled[-1][0], 0.0) if handled else 0.0,
        writer_cpu=cores["writer"], driver_cores=cores["driver"], trial_actor_cores=cores["trial_actors"],
        broker_cores=cores["broker"], slots_cores=cores["slots"], ray_cores=cores["ray_own"],
        other_cores=cores["others"], machine_cpu=cores["machine"] / (os.cpu_count() or 1),
        writes_per_s=sum(1 for t in sampler.written if start <= t <= end) / window_s,
        driver_ms_per_report=1000 * cores["driver"] / max(results / window_s, 1e-9),
        writer_ms_per_report=1000 * cores["writer"] / max(results / window_s, 1e-9),
        tune_loop_ms_per_report=1000 * cores["tune_loop"] / max(results / window_s, 1e-9),
        actors_mem_gb=unique / 2**30, actor_uss_mb=unique / max(actors, 1) / 2**20,
        min_available_gb=sampler.min_available / 2**30,
        store_calls_per_report=sum(store_calls.values()) / max(results, 1),
        result_calls_share=min(results, store_calls.get("log_batch", 0)) / max(sum(store_calls.values()), 1),
        **driver["ended"], cut_short=sampler.cut_short,
        store_calls=",".join(f"{name}:{n}" for name, n in sorted(store_calls.items())))


HEADER = (f"{'trials':>6} {'at once':>7} {'up s':>5} {'reports/s':>9} {'handled p50/p99 s':>17} "
          f"{'decision p50/p99 s':>18} {'store p50/p99 s':>15} {'busy':>5} {'backlog max/end':>15} {'growth/s':>8} "
          f"{'drain s':>7} {'writes/s':>8} {'cores: loop':>11} {'writer':>6} {'actors':>6} {'broker':>6} {'others':>6} "
          f"{'ms/report: driver':>17} {'writer':>6} {'calls/report':>12} {'actors GiB':>10} {'actor MiB':>9}  "
          f"gives first")


def row(f: DriverFigures) -> str:
    return (f"{f.trials:>6} {f.max_running:>3}/{f.concurrency:<3} {f.actors_up_s:>5.0f} {f.reports_per_s:>9.1f} "
            f"{f.handled_lag_p50_s:>8.3f}/{f.handled_lag_p99_s:<8.3f} {f.decision_lag_p50_s:>8.3f}/"
            f"{f.decision_lag_p99_s:<9.3f} {f.store_wait_p50_s:>7.3f}/{f.store_wait_p99_s:<7.3f} "
            f"{f.slot_busy:>5.2f} {f.backlog_max:>7}/{f.backlog_end:<7} {f.backlog_growth_per_s:>8.2f} "
            f"{f.drain_s:>7.2f} {f.writes_per_s:>8.1f} {f.tune_loop_cpu:>11.2f} {f.writer_cpu:>6.2f} "
            f"{f.trial_actor_cores:>6.2f} {f.broker_cores:>6.2f} {f.other_cores:>6.2f} {f.driver_ms_per_report:>17.1f} "
            f"{f.writer_ms_per_report:>6.1f} {f.store_calls_per_report:>12.2f} {f.actors_mem_gb:>10.2f} "
            f"{f.actor_uss_mb:>9.0f}  {f.gives_first()}{' (cut short: memory)' if f.cut_short else ''}")


def result_line(f: DriverFigures) -> str:
    fields = {k: v for k, v in asdict(f).items() if k not in ("concurrency", "epoch_s")}
    text = " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in fields.items())
    return (f"RESULT driver_scale concurrency={f.concurrency} epoch_s={f.epoch_s:g} {text} "
            f"driver_ceiling_per_s={f.driver_ceiling_per_s:.1f} sustained={int(f.epoch_s > 0 and f.sustained)} "
            f"gives_first={f.gives_first()}")


def memory_short(concurrency: int, actor_mib: float) -> str | None:
    """Why `concurrency` trial actors (a Python process each, `actor_mib` of its own) would not fit in the memory
    available now with MEM_MARGIN_GIB to spare, or None. Ray's memory monitor would kill workers first, and the
    OOM killer might pick another job's process on a shared machine: better not to start."""
    import psutil

    need = concurrency * actor_mib / 1024 + MEM_MARGIN_GIB
    available = psutil.virtual_memory().available / 2**30
    if need <= available:
        return None
    return (f"{concurrency} trial actors need ≈ {concurrency * actor_mib / 1024:.1f} GiB ({actor_mib:.0f} MiB of its "
            f"own each) + {MEM_MARGIN_GIB:g} GiB spare; {available:.1f} GiB available")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 32, 128], help="trials at once, each run")
    parser.add_argument("--epoch-s", type=float, default=0.0, help="seconds a simulated epoch takes (0: none)")
    parser.add_argument("--jitter", type=float, default=0.2, help="each trial's epoch is epoch_s × (1 ± this)")
    parser.add_argument("--epochs", type=int, default=8, help="epochs per trial (ASHA's max_t)")
    parser.add_argument("--checkpoint-every", type=int, default=1,
                        help="train.checkpoint_every: a slot waits for the store before each checkpoint epoch")
    parser.add_argument("--trials-per-slot", type=int, default=6, help="trials = this × concurrency")
    parser.add_argument("--quick", action="store_true", help="2 trials at once, 2 per slot, 4 epochs: a smoke test")
    args = parser.parse_args()
    if args.quick:
        args.concurrency, args.trials_per_slot, args.epochs = [2], 2, 4
    # as the CLI sets them (cli.main): before Ray and MLflow are imported
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    import ray

    from raysweep.cluster import TRIAL_DRIVER, ray_init_kwargs

    # a cluster of its own (ray_init_kwargs: "local", never one another job started on this machine), with a
    # trial_driver per trial
    ray.init(num_cpus=os.cpu_count(), **{**ray_init_kwargs(), "resources": {TRIAL_DRIVER: max(args.concurrency)}})
    figures = []
    try:
        with tempfile.TemporaryDirectory(prefix="driver-scale-") as tmp:
            print(f"driver_scale on {os.cpu_count()} CPUs: epochs of {args.epoch_s:g} s (± {args.jitter:.0%}), "
                  f"{args.epochs} epochs a trial, {args.trials_per_slot} trials per slot\n{HEADER}", flush=True)
            for concurrency in args.concurrency:
                actor_mib = figures[-1].actor_uss_mb if figures and figures[-1].actor_uss_mb else ACTOR_MIB_GUESS
                short = memory_short(concurrency, actor_mib)
                if short:
                    print(f"{concurrency:>6} trials at once: not run: {short}", flush=True)
                    continue
                figures.append(measure(concurrency, args, Path(tmp)))
                print(row(figures[-1]), flush=True)
    finally:
        ray.shutdown()
    for f in figures:
        print(result_line(f))
    if args.epoch_s > 0:
        sustained = max((f.concurrency for f in figures if f.sustained), default=0)
        print(f"RESULT driver_scale_sustained value={float(sustained):.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
