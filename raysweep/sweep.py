"""A sweep: Ray Tune + ASHA over trials that each run a Ray Train `TorchTrainer`; MLflow records it.

`tune` samples the spec's search space; `train` runs the same path with one trial at the defaults.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from raysweep.config import Choice, LogUniform, RandInt, SweepConfig, Uniform, spec_yaml
from raysweep.errors import UserError

log = logging.getLogger(__name__)

TRIAL_DRIVER = "trial_driver"  # custom resource a trial's driver holds, so drivers never take workers' CPUs
LOCAL_TRIAL_DRIVERS = 64


# ---------------------------------------------------------------------------------------------
# Ray


def ray_env(worker_start_timeout_s: float) -> dict[str, str]:
    """Environment for every Ray process of the job (workers inherit the raylet's, not the driver's)."""
    return {
        "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": str(int(math.ceil(worker_start_timeout_s))),
        "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
        # the controller collects workers' reports this often; a worker's report() blocks while its
        # one-slot queue still holds the previous epoch's, so the poll must be shorter than an epoch
        # (GPU epochs can be well under the 2 s default)
        "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2",
        # a watcher actor per trial (one more Python process to start on the path to the first
        # report) that polls for preempted nodes; raysweep's clusters are fixed machines, and a
        # lost node still fails the worker group, restarted by FailureConfig
        "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
    }


def ray_init_kwargs(worker_start_timeout_s: float = 60, verbose: bool = False) -> dict:
    """`ray.init` keywords for a local cluster; tests start theirs with these too."""
    return dict(
        resources={TRIAL_DRIVER: LOCAL_TRIAL_DRIVERS},
        runtime_env={"env_vars": ray_env(worker_start_timeout_s)},
        log_to_driver=verbose,
        logging_level=logging.INFO if verbose else logging.WARNING,
    )


def connect(address: str | None, config: SweepConfig, verbose: bool) -> bool:
    """Start or join Ray; returns True when this call started it (and so must shut it down)."""
    import ray

    if ray.is_initialized():
        return False
    kwargs = ray_init_kwargs(config.scaling.worker_start_timeout_s, verbose)
    if address:
        kwargs.pop("resources")  # a running cluster's resources were set by `ray start` (cluster.yaml)
        ray.init(address=address, **kwargs)
    else:
        ray.init(**kwargs)
    return True


@dataclass(frozen=True)
class Plan:
    trials_at_once: int
    message: str


def plan_concurrency(resources: dict[str, float], config: SweepConfig, num_samples: int) -> Plan:
    """How many trials fit at once: each holds a trial_driver and its workers' CPUs (and GPUs).

    Never rely on Ray to queue: an oversubscribed worker group waits forever (RAY_NOTES.md).
    """
    s = config.scaling
    cpus, gpus, drivers = resources.get("CPU", 0), resources.get("GPU", 0), resources.get(TRIAL_DRIVER, 0)
    need_cpu = s.num_workers * s.cpus_per_worker
    if drivers < 1:
        raise UserError(
            f"the cluster has no '{TRIAL_DRIVER}' resource; start its head with "
            f"ray start --head --resources='{{\"{TRIAL_DRIVER}\": 8}}' (cluster.yaml does)"
        )
    if s.use_gpu and gpus < s.num_workers:
        raise UserError(
            f"scaling: a trial needs {s.num_workers} GPUs ({s.num_workers} workers × 1) but the cluster has {gpus:g}; "
            f"lower scaling.num_workers to {int(gpus)} or set scaling.use_gpu: false" if gpus >= 1 else
            "scaling.use_gpu: true but the cluster has no GPU; set scaling.use_gpu: false (CPU workers, gloo) "
            "or run on a GPU cluster (--address)"
        )
    if cpus < need_cpu:
        raise UserError(
            f"scaling: a trial needs {need_cpu:g} CPUs ({s.num_workers} workers × {s.cpus_per_worker:g}) but the "
            f"cluster has {cpus:g}; lower scaling.num_workers or scaling.cpus_per_worker"
        )
    fit = int(cpus // need_cpu)
    if s.use_gpu:
        fit = min(fit, int(gpus // s.num_workers))
    n = min(fit, int(drivers), num_samples, config.tune.max_concurrent_trials or fit)
    unit = f"{gpus:g} GPU" if s.use_gpu else f"{cpus:g} CPU"
    message = f"{unit}, {s.num_workers} workers/trial → {n} trial{'s' if n > 1 else ''} at a time"
    if n == 1 and num_samples > 1:
        message += "; ASHA prunes sequentially"
    return Plan(n, message)


def search_space(config: SweepConfig) -> dict[str, Any]:
    """Tune's param_space: one entry per set knob (fixed values pass through)."""
    from ray import tune

    space = {}
    for name, knob in config.search.knobs().items():
        if isinstance(knob, Choice):
            space[name] = tune.choice(list(knob.choice))
        elif isinstance(knob, LogUniform):
            space[name] = tune.loguniform(*knob.loguniform)
        elif isinstance(knob, Uniform):
            space[name] = tune.uniform(*knob.uniform)
        elif isinstance(knob, RandInt):
            space[name] = tune.randint(knob.randint[0], knob.randint[1] + 1)  # Tune's high is exclusive
        else:
            space[name] = knob
    return space


# ---------------------------------------------------------------------------------------------
# One trial (runs in a Tune trial actor)


@dataclass(frozen=True)
class SweepContext:
    """What every trial needs from the driver; travels once via `tune.with_parameters`."""

    config: SweepConfig
    data_ref: Any  # ObjectRef of data.CaptchaData: decoded once per sweep, zero-copy on each node
    train_size: int
    train_storage: str  # absolute: Train runs live at <storage>/<name>/train/trial-<id>
    worker_env: dict  # captured in the driver: trial actors do not see the driver's environment
    batch_cap: int | None = None  # per-GPU batches above it run as smaller micro-batches


def run_trial(knobs: dict, context: SweepContext) -> None:
    """Tune function trainable: a TorchTrainer for this trial's knobs, named by the trial id."""
    from ray import tune
    from ray.tune.integration.ray_train import TuneReportCallback

    from ray.train import TrainingFailedError

    from raysweep.train_loop import failure_path, make_trainer, read_failure

    trial_id = tune.get_context().get_trial_id()
    trial = context.config.trial(knobs, context.train_size, context.batch_cap)
    # the name must come from the trial id: an existing (storage, name) resumes from its checkpoint
    name = f"trial-{trial_id}"
    marker = failure_path(context.train_storage, name)
    if os.path.exists(marker):
        os.remove(marker)  # a restored trial tries again
    trainer = make_trainer(trial, context.data_ref, context.train_storage, name, [TuneReportCallback()],
                           env=context.worker_env)
    try:
        trainer.fit()
    except TrainingFailedError as e:
        if "OutOfMemoryError" in str(e):  # an OOM after the start-up probe: the same ending, retries spent
            raise TrialFailed(f"OOM at per-GPU batch {trial.knobs.per_gpu_batch_size} during training") from e
        raise
    failure = read_failure(marker)
    if failure is not None:  # agreed by every rank (OOM past the downshifts, divergence)
        raise TrialFailed(str(failure))


class TrialFailed(RuntimeError):
    """Ends a trial as errored in Tune with a one-line reason (MLflow tags it failure=oom/diverged)."""


# ---------------------------------------------------------------------------------------------
# Console


def _fmt(value, spec: str = ".4g") -> str:
    if value is None or value == "":
        return "-"
    if isinstance(value, float):
        return format(value, spec)
    return str(value)


class ConsoleProgress:
    """Readable progress on the driver: events as they happen and a table every `every_s` seconds.

    In `train` mode (one trial) it prints one line per epoch instead of tables.
    """

    COLUMNS = ("trial", "status", "per_gpu", "global", "base_lr", "peak_lr", "warmup", "wd", "epoch",
               "val_loss", "val_exact", "samples/s", "mem_gib")

    def __init__(self, config: SweepConfig, train_size: int, every_s: float = 30.0, per_epoch: bool = False):
        self.config, self.train_size, self.every_s, self.per_epoch = config, train_size, every_s, per_epoch
        self.started: dict[str, float] = {}
        self.first_report_s: dict[str, float] = {}
        self.last_table = time.monotonic()

    def _trial_cfg(self, trial):
        return self.config.trial(dict(trial.config), self.train_size)

    def row(self, trial) -> list[str]:
        t = self._trial_cfg(trial)
        r = trial.last_result or {}
        mem = r.get("peak_mem_allocated_gb") or r.get("rss_gb")
        status = trial.status.lower()
        if status == "terminated":
            status = "done" if int(r.get("epoch", 0)) >= self.config.max_t else "pruned"
        return [trial.trial_id, status, str(t.knobs.per_gpu_batch_size), str(t.global_batch_size),
                _fmt(t.knobs.base_lr, ".2e"), _fmt(t.peak_lr, ".2e"), _fmt(t.knobs.warmup_epochs, "g"),
                _fmt(t.knobs.weight_decay, ".1e"), _fmt(r.get("epoch")), _fmt(r.get("val_loss")),
                _fmt(r.get("val_exact_acc"), ".3f"), _fmt(r.get("samples_per_s"), ",.0f"), _fmt(mem, ".2f")]

    def table(self, trials) -> str:
        return format_table(self.COLUMNS, [self.row(t) for t in trials])

    # Tune callback hooks (ConsoleCallback forwards to these)
    def trial_start(self, trial):
        self.started.setdefault(trial.trial_id, time.monotonic())
        if not self.per_epoch:
            t = self._trial_cfg(trial)
            print(f"[{_now()}] start  {trial.trial_id}: per-GPU batch {t.knobs.per_gpu_batch_size} × "
                  f"{t.world_size} workers × {t.knobs.grad_accum_steps} accum = global {t.global_batch_size}, "
                  f"peak LR {t.peak_lr:.2e}, warmup {t.knobs.warmup_epochs:g} ep, wd {t.knobs.weight_decay:.1e}", flush=True)

    def trial_result(self, trial, result):
        if trial.trial_id not in self.first_report_s and trial.trial_id in self.started:
            self.first_report_s[trial.trial_id] = time.monotonic() - self.started[trial.trial_id]
        if self.per_epoch:
            print(epoch_line(result, self.config.train.epochs), flush=True)

    def trial_end(self, trial, how: str):
        r = trial.last_result or {}
        print(f"[{_now()}] {how:<6} {trial.trial_id} at epoch {r.get('epoch', 0)}: "
              f"{self.config.tune.metric} {_fmt(r.get(self.config.tune.metric))}", flush=True)

    def step(self, trials):
        if self.per_epoch or time.monotonic() - self.last_table < self.every_s:
            return
        self.last_table = time.monotonic()
        print(f"[{_now()}] progress\n{self.table(trials)}", flush=True)


def epoch_line(r: dict, epochs: int) -> str:
    mem = f"peak mem {r['peak_mem_allocated_gb']:.2f} GiB" if r.get("peak_mem_allocated_gb") else f"rss {r.get('rss_gb', 0):.2f} GiB"
    return (f"epoch {int(r['epoch'])}/{epochs}  train_loss {r['train_loss']:.4f}  val_loss {r['val_loss']:.4f}  "
            f"val_exact_acc {r['val_exact_acc']:.3f}  val_char_acc {r['val_char_acc']:.3f}  lr {r['lr']:.2e}  "
            f"{r['samples_per_s']:,.0f} samples/s  {mem}")


def format_table(columns, rows) -> str:
    widths = [max(len(str(c)), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(columns)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def _now() -> str:
    return datetime.now().strftime("%H:%M:%S")


def make_console_callback(progress: ConsoleProgress):
    from ray.tune import Callback

    class ConsoleCallback(Callback):
        def on_trial_start(self, iteration, trials, trial, **info):
            progress.trial_start(trial)

        def on_trial_result(self, iteration, trials, trial, result, **info):
            progress.trial_result(trial, result)

        def on_trial_complete(self, iteration, trials, trial, **info):
            epoch = int((trial.last_result or {}).get("epoch", 0))
            progress.trial_end(trial, "done" if epoch >= progress.config.max_t else "pruned")

        def on_trial_error(self, iteration, trials, trial, **info):
            from raysweep.tracking import trial_error_line

            progress.trial_end(trial, "failed")
            print(f"         {trial.trial_id}: {trial_error_line(trial)}", flush=True)

        def on_step_end(self, iteration, trials, **info):
            progress.step(trials)

    return ConsoleCallback()


# ---------------------------------------------------------------------------------------------
# The sweep


def run(config: SweepConfig, *, single: bool = False, address: str | None = None, resume: bool = False,
        verbose: bool = False, progress_every_s: float = 30.0, cap_batch: int | None = None) -> int:
    """Run a sweep (or, with `single`, one trial at the defaults). Returns the exit code."""
    from raysweep import tracking
    from raysweep.data import load_data

    t_start = time.monotonic()
    tracking_uri = tracking.resolve_tracking_uri(config.mlflow.tracking_uri)
    storage = config.storage_path.expanduser().resolve()
    name = f"{config.name}-train" if single else config.name
    experiment_path = storage / name
    if resume and not experiment_path.is_dir():
        raise UserError(f"--resume: no sweep at {experiment_path} (storage_path {str(config.storage_path)!r}, name {name!r})")

    started_ray = connect(address, config, verbose)
    try:
        import ray

        num_samples = 1 if single else config.tune.num_samples
        plan = plan_concurrency(ray.cluster_resources(), config, num_samples)  # before any work: fail fast
        print(f"plan: {plan.message}")
        batch_cap = resolve_batch_cap(config, cap_batch)
        data = load_data(config.data)  # decoded once per sweep; trials get an object ref, never paths
        print(f"data: {data.source}: {len(data.train)} train / {len(data.val)} val images "
              f"{config.data.width}×{config.data.height}, {config.data.length} characters of {config.data.num_classes}")
        from raysweep.train_loop import worker_env

        context = SweepContext(config, ray.put(data), len(data.train), str(experiment_path / "train"), worker_env(),
                               batch_cap)
        del data
        experiment_id, parent_run_id = tracking.open_sweep(
            tracking_uri, config.experiment_name, run_name=f"{name} {datetime.now():%Y-%m-%d %H:%M:%S}",
            tags={"raysweep.kind": "train" if single else "tune", "raysweep.storage": str(experiment_path)},
            spec_text=spec_yaml(config),
        ) if not resume else _resumed_parent(tracking_uri, experiment_path)
        progress = ConsoleProgress(config, context.train_size, progress_every_s, per_epoch=single)
        mlflow_cb = tracking.MLflowSweepCallback(tracking_uri, experiment_id, parent_run_id, config, context.train_size)
        tuner = _tuner(config, context, plan, single, resume, experiment_path, storage, name,
                       [mlflow_cb, make_console_callback(progress)])
        results = tuner.fit()
        code, best = _summarize(config, results, progress, single, time.monotonic() - t_start)
        tracking.close_sweep(tracking_uri, parent_run_id, best, config.tune.metric, "FINISHED" if code == 0 else "FAILED")
        ui, link = tracking.runs_link(tracking_uri, experiment_id)
        print(f"results: {experiment_path}")
        print(f"mlflow:  {tracking_uri} (experiment {config.experiment_name!r}, id {experiment_id})")
        print(f"review:  {ui}\n         then open {link}")
        return code
    finally:
        if started_ray:
            import ray

            ray.shutdown()


def resolve_batch_cap(config: SweepConfig, cap_batch: int | None) -> int | None:
    """--cap-batch, else search.per_gpu_batch_size.max (a number, or `probe`: measured now)."""
    cap = cap_batch if cap_batch is not None else config.batch_cap
    if cap == "probe":
        from raysweep.probe import probe

        result = probe(config)
        if result.recommended is None:
            raise UserError(f"search.per_gpu_batch_size.max: probe found no per-GPU batch that fits "
                            f"(from 8 up); see {result.path}")
        cap = result.recommended
        print(f"probe: largest per-GPU batch that fits {result.largest}, cap {cap} after the margin")
    if cap is not None:
        print(f"batch cap: per-GPU batches above {cap} run as micro-batches ≤ {cap} with more accumulation "
              f"(same global batch and LR)")
    return cap


def _resumed_parent(tracking_uri: str, experiment_path: Path) -> tuple[str, str]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    runs = client.search_runs(
        [e.experiment_id for e in client.search_experiments()],
        filter_string=f"tags.`raysweep.storage` = '{experiment_path}'", order_by=["attributes.start_time DESC"], max_results=1,
    )
    if not runs:
        raise UserError(f"--resume: no MLflow parent run for {experiment_path} in {tracking_uri}")
    client.update_run(runs[0].info.run_id, status="RUNNING")
    return runs[0].info.experiment_id, runs[0].info.run_id


def _tuner(config, context, plan, single, resume, experiment_path, storage, name, callbacks):
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler
    from ray.tune.search.basic_variant import BasicVariantGenerator

    trainable = tune.with_resources(tune.with_parameters(run_trial, context=context), {TRIAL_DRIVER: 1})
    if resume:
        if not tune.Tuner.can_restore(str(experiment_path)):
            raise UserError(f"--resume: {experiment_path} holds no restorable Tune experiment")
        # callbacks come back from the experiment's own state (with their run ids)
        return tune.Tuner.restore(str(experiment_path), trainable=trainable, resume_unfinished=True, resume_errored=True)
    t = config.tune
    if single:
        param_space, scheduler, search_alg = config.default_knobs(), None, None
    else:
        param_space = search_space(config)
        defaults = config.default_knobs()
        searched = config.searched()
        # the spec's defaults run first: a known baseline every sweep can be compared against
        first = [{k: defaults[k] for k in searched}] if searched else None
        # max_concurrent must be set here: Tune ignores TuneConfig.max_concurrent_trials when search_alg
        # is a BasicVariantGenerator instance (tune.py wraps only Searchers), and oversubscribed
        # trials then wait for workers until they time out
        search_alg = BasicVariantGenerator(points_to_evaluate=first, random_state=t.seed,
                                           max_concurrent=plan.trials_at_once)
        scheduler = ASHAScheduler(
            time_attr="epoch",  # worker-reported: Tune's training_iteration restarts at 1 after a restore
            max_t=config.max_t, grace_period=t.asha.grace_period, reduction_factor=t.asha.reduction_factor,
        )
    return tune.Tuner(
        trainable,
        param_space=param_space,
        tune_config=tune.TuneConfig(
            metric=t.metric, mode=t.mode, num_samples=1 if single else t.num_samples, scheduler=scheduler,
            search_alg=search_alg, max_concurrent_trials=None if search_alg else plan.trials_at_once,
        ),
        run_config=tune.RunConfig(name=name, storage_path=str(storage), callbacks=callbacks, verbose=0),
    )


def _summarize(config: SweepConfig, results, progress: ConsoleProgress, single: bool, wall_s: float):
    """Print the outcome; returns (exit code, best trial dict or None)."""
    metric, mode = config.tune.metric, config.tune.mode
    rows, ok = [], []
    for r in results:
        m = r.metrics or {}
        trial_id = m.get("trial_id", "?")  # Tune adds it to every result
        if r.error is not None:
            status = "failed"
        elif int(m.get("epoch", 0)) >= config.max_t:
            status = "finished"
        else:
            status = "pruned"
        if r.error is None and metric in m:
            ok.append((m[metric], trial_id, r))
        rows.append((m.get(metric), trial_id, status, r))
    ok.sort(key=lambda x: x[0], reverse=(mode == "max"))
    epochs_run = sum(int((r.metrics or {}).get("epoch", 0)) for _, _, _, r in rows)
    budget = len(rows) * config.max_t
    first = sorted(progress.first_report_s.values())
    if single:
        if ok:
            value, trial_id, r = ok[0]
            m = r.metrics
            trial = config.trial(r.config, progress.train_size)
            print(f"summary: {int(m['epoch'])} epochs in {wall_s:.0f}s; global batch {trial.global_batch_size}, "
                  f"peak LR {trial.peak_lr:.2e}; final train_loss {m['train_loss']:.4f}, val_loss {m['val_loss']:.4f}, "
                  f"val_exact_acc {m['val_exact_acc']:.3f}, val_char_acc {m['val_char_acc']:.3f}; "
                  f"{m['samples_per_s']:,.0f} samples/s (last epoch); first epoch reported "
                  f"{first[0]:.1f}s after the trial started" if first else "")
    else:
        n_failed = sum(1 for row in rows if row[2] == "failed")
        n_pruned = sum(1 for row in rows if row[2] == "pruned")
        print(f"\nsweep: {len(rows)} trials in {wall_s:.0f}s: {len(rows) - n_failed - n_pruned} finished, "
              f"{n_pruned} pruned by ASHA, {n_failed} failed; {epochs_run} of {budget} epochs run "
              f"({budget - epochs_run} saved)")
        top = []
        for value, trial_id, r in ok[:5]:
            trial = config.trial(r.config, progress.train_size)
            m = r.metrics
            top.append([trial_id, str(trial.knobs.per_gpu_batch_size), str(trial.global_batch_size),
                        f"{trial.knobs.base_lr:.2e}", f"{trial.peak_lr:.2e}", f"{trial.knobs.warmup_epochs:g}",
                        f"{trial.knobs.weight_decay:.1e}", str(int(m["epoch"])), _fmt(m.get(metric)),
                        _fmt(m.get("val_exact_acc"), ".3f"), _fmt(m.get("samples_per_s"), ",.0f")])
        if top:
            print(f"top trials by {metric} ({mode}):")
            print(format_table(("trial", "per_gpu", "global", "base_lr", "peak_lr", "warmup", "wd", "epoch", metric,
                                "val_exact", "samples/s"), top))
    if not ok:
        print("no trial succeeded", file=sys.stderr)
        return 1, None
    value, trial_id, r = ok[0]
    best = {"trial_id": trial_id, "value": value, "params": config.trial(r.config, progress.train_size).params()}
    return 0, best
