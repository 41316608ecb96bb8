"""A sweep: Ray Tune + ASHA over trials that each run a Ray Train `TorchTrainer`; MLflow records it.

`tune` samples the spec's search space; `train` runs the same path with one trial at the defaults.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from raysweep import storage
from raysweep.config import Choice, LogUniform, RandInt, SweepConfig, Uniform, spec_yaml
from raysweep.errors import UserError
from raysweep.metrics import TrialView

log = logging.getLogger(__name__)


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
    train_storage: str  # absolute folder or URI: Train runs live at <storage>/<name>/train/trial-<id>
    worker_env: dict  # captured in the driver: trial actors do not see the driver's environment
    batch_cap: int | None = None  # per-GPU batches above it run as smaller micro-batches
    compile_cache: str | None = None  # <storage>/<name>/compile_cache: every trial's compiles (worker/compile_cache.py)


def run_trial(knobs: dict, context: SweepContext) -> None:
    """Tune function trainable: a TorchTrainer for this trial's knobs, named by the trial id."""
    from ray import tune
    from ray.train import TrainingFailedError
    from ray.tune.integration.ray_train import TuneReportCallback

    from raysweep.cluster import failure_path, make_trainer, read_failure

    trial_id = tune.get_context().get_trial_id()
    trial = context.config.trial(knobs, context.train_size, context.batch_cap)
    # the name must come from the trial id: an existing (storage, name) resumes from its checkpoint
    name = f"trial-{trial_id}"
    marker = failure_path(context.train_storage, name)
    storage.delete(marker)  # a restored trial tries again
    trainer = make_trainer(trial, context.data_ref, context.train_storage, name, [TuneReportCallback()],
                           env=context.worker_env, compile_cache=context.compile_cache)
    try:
        trainer.fit()
    except TrainingFailedError as e:
        if "OutOfMemoryError" in str(e):  # an OOM after the start-up probe: the same ending, retries spent
            raise TrialFailed(f"OOM at per-GPU batch {trial.knobs.per_gpu_batch_size} during training") from e
        raise
    failure = read_failure(marker)
    if failure is not None:  # agreed by every rank (OOM past the downshifts, divergence)
        raise TrialFailed(failure[1])


class TrialFailed(RuntimeError):
    """Ends a trial as errored in Tune with a one-line reason (MLflow tags it failure=oom/diverged)."""


# ---------------------------------------------------------------------------------------------
# The sweep


def run(config: SweepConfig, *, single: bool = False, address: str | None = None, resume: bool = False,
        verbose: bool = False, progress_every_s: float = 30.0, cap_batch: int | None = None) -> int:
    """Run a sweep (or, with `single`, one trial at the defaults). Returns the exit code.

    Once the parent run is open, whatever fails ends it (and its RUNNING children) FAILED with the cause as the
    `error` tag; Ctrl-C ends them KILLED + `interrupted`; a driver killed outright is found by the next command
    on the store (tracking.reconcile_orphans).
    """
    from raysweep import console, tracking
    from raysweep.cluster import connect, plan_concurrency, worker_env
    from raysweep.data import load_data

    t_start = time.monotonic()
    tracking_uri = tracking.resolve_tracking_uri(config.mlflow.tracking_uri)
    storage_root = storage.resolve(config.storage_path)
    name = f"{config.name}-train" if single else config.name
    experiment_path = storage.join(storage_root, name)
    resumed = check_resume(config, tracking_uri, experiment_path, name) if resume else None  # before Ray and data
    tracking.reconcile_orphans(tracking_uri, keep=resumed)

    started_ray = connect(address, config, verbose)
    parent_run_id, ended = None, False
    try:
        import ray

        num_samples = 1 if single else config.tune.num_samples
        plan = plan_concurrency(ray.cluster_resources(), config, num_samples)  # before any work: fail fast
        console.print_plan(plan)
        batch_cap = resolve_batch_cap(config, cap_batch)
        data = load_data(config.data, console.progress_printer())  # decoded once per sweep; trials get an object ref
        console.print_data(data, config)
        config.check_data_fits(len(data.train), batch_cap, searched=not single)  # before any trial starts
        compile_cache = storage.join(experiment_path, "compile_cache")
        context = SweepContext(config, ray.put(data), len(data.train), storage.join(experiment_path, "train"),
                               worker_env(compile_cache), batch_cap, compile_cache)
        del data
        if resumed:
            console.print_resumed(resume_summary(experiment_path, num_samples))
            experiment_id, parent_run_id = tracking.resumed_parent(tracking_uri, resumed), resumed
        else:
            experiment_id, parent_run_id = tracking.open_sweep(
                tracking_uri, config.experiment_name, run_name=f"{name} {datetime.now():%Y-%m-%d %H:%M:%S}",
                tags={"raysweep.kind": "train" if single else "tune", "raysweep.storage": str(experiment_path),
                      "raysweep.metric": config.tune.metric, "raysweep.mode": config.tune.mode},
                spec_text=spec_yaml(config))
        with tracking.Heartbeat(tracking_uri, parent_run_id):
            progress = console.ConsoleProgress(config, context.train_size, progress_every_s, per_epoch=single)
            callbacks = [tracking.make_mlflow_callback(tracking_uri, experiment_id, parent_run_id, config,
                                                       context.train_size),
                         console.make_console_callback(progress)]
            results = _tuner(config, context, plan, single, resume, experiment_path, storage_root, name,
                             callbacks).fit()
        wall_s = time.monotonic() - t_start
        if results.num_terminated + results.num_errors < num_samples:
            # Ctrl-C: Tune stopped the trials and saved the experiment; mark the runs, then say how to resume
            tracking.end_sweep(tracking_uri, parent_run_id, "KILLED")
            ended = True
            raise KeyboardInterrupt
        views = [TrialView.of_result(r, config.max_t) for r in results]
        ranked = rank(views, config.tune.metric, config.tune.mode)
        best = None
        if ranked:
            top = ranked[0]
            best = {"trial_id": top.trial_id, "value": top.value(config.tune.metric),
                    "params": config.trial(top.config, context.train_size).params()}
        built = None
        if not single:  # the report is built from the MLflow store, exactly as `raysweep report` rebuilds it
            from raysweep import report

            built = report.publish(tracking.load_sweep(tracking_uri, config.experiment_name, parent_run_id),
                                   storage.join(experiment_path, "report"))
        tracking.close_sweep(tracking_uri, parent_run_id, best, config.tune.metric, "FINISHED" if ranked else "FAILED")
        ended = True
        if single:
            first = min(progress.first_report_s.values(), default=None)
            console.print_train_summary(config, ranked[0] if ranked else None, context.train_size, wall_s, first)
        else:
            console.print_sweep_summary(config, views, built, wall_s)
        ui, link = tracking.runs_link(tracking_uri, experiment_id, None if single else parent_run_id,
                                      config.tune.metric, config.tune.mode)
        console.print_where(experiment_path, tracking_uri, config.experiment_name, experiment_id, ui, link,
                            config.tune.metric)
        return 0 if ranked else 1
    except BaseException as e:
        if parent_run_id is not None and not ended:
            interrupted = isinstance(e, KeyboardInterrupt)
            try:
                tracking.end_sweep(tracking_uri, parent_run_id, "KILLED" if interrupted else "FAILED",
                                   error=None if interrupted else _cause(e))
            except Exception as mlflow_error:  # the store itself failing: say so, and raise the first cause
                log.error("could not end MLflow run %s: %s", parent_run_id, mlflow_error)
        raise
    finally:
        if started_ray:
            import ray

            ray.shutdown()


def _cause(e: BaseException) -> str:
    """One line for the `error` tag: the exception and, for Tune's wrapper, what it wraps."""
    inner = e.__cause__ or e.__context__
    line = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    if inner is not None and type(e).__name__ == "TuneError":
        line = f"{type(inner).__name__}: {str(inner).strip()}"
    return line


# keys a resumed sweep may change: how long to wait and how often to retry, nothing a trial computes
RESUME_MAY_CHANGE = ("scaling.worker_start_timeout_s", "train.max_failures")
# the keys that found the sweep (its storage and store): compared by where they lead, not by their text
RESUME_IDENTITY = ("name", "storage_path", "mlflow.")


def check_resume(config: SweepConfig, tracking_uri: str, experiment_path: str, name: str) -> str:
    """What `--resume` needs, checked before Ray starts or the data loads: a restorable Tune experiment at
    `experiment_path`, its MLflow parent run, a spec that agrees with the spec.yaml logged there, and no driver
    still running it. Returns the parent run id; a UserError (one line) names what is wrong."""
    import yaml
    from ray.tune import Tuner

    from raysweep import drivers, tracking

    where = f"storage_path {str(config.storage_path)!r}, name {name!r}"
    if not storage.is_dir(experiment_path):
        raise UserError(f"--resume: no sweep at {experiment_path} ({where}); run it without --resume first")
    if not Tuner.can_restore(experiment_path):
        held = ", ".join(storage.list_names(experiment_path)) or "nothing"
        raise UserError(f"--resume: {experiment_path} holds no Tune experiment to resume (only {held}: `probe` "
                        f"output?); run the sweep without --resume")
    parent = tracking.find_parent(tracking_uri, experiment_path)
    logged = tracking.spec_of(tracking_uri, parent.info.run_id)
    if logged is not None:
        changed = spec_changes(yaml.safe_load(logged) or {}, config.model_dump(mode="json"))
        if changed:
            raise UserError(
                f"--resume: the spec differs from the sweep's own (spec.yaml of MLflow run {parent.info.run_id}): "
                f"{'; '.join(changed)}. Tune resumes the sweep's search space and ASHA as they were, so trials would "
                f"run another spec: undo the change, or start a new sweep (another name)")
    if parent.info.status == "RUNNING" and drivers.driver_alive(parent.data.tags):
        tags = parent.data.tags
        raise UserError(f"--resume: this sweep's driver still runs (pid {tags['raysweep.driver.pid']} on "
                        f"{tags['raysweep.driver.host']}); stop it first (Ctrl-C), or wait for it")
    return parent.info.run_id


def spec_changes(before: dict, after: dict) -> list[str]:
    """'key: old → new' for every key both specs hold whose value differs, but the ones a resume may change."""
    def flat(d, prefix=""):
        for k, v in d.items():
            if isinstance(v, dict) and v and not set(v) & {"choice", "loguniform", "uniform", "randint"}:
                yield from flat(v, f"{prefix}{k}.")
            else:
                yield f"{prefix}{k}", v

    old, new = dict(flat(before)), dict(flat(after))
    return [f"{k}: {old[k]!r} → {new[k]!r}" for k in old if k in new and old[k] != new[k]
            and k not in RESUME_MAY_CHANGE and not k.startswith(RESUME_IDENTITY)]


@dataclass(frozen=True)
class ResumeSummary:
    done: int  # trials that ended (finished, pruned or failed): not run again
    running: list[tuple[str, int]]  # (trial id, last reported epoch): continue from their Train checkpoints
    pending: int  # not started yet


def resume_summary(experiment_path: str, num_samples: int) -> ResumeSummary:
    """What `--resume` will find (read before Tune restores it): Tune's saved trial states, and for each
    unfinished trial the epoch of its last Train checkpoint, where it continues (Tune's state, saved every
    few seconds, can trail it, or hold no result for a trial that did train)."""
    import json

    from ray.tune import ExperimentAnalysis

    from raysweep.cluster import SNAPSHOT_FILE

    trials = ExperimentAnalysis(experiment_path).trials
    ended = [t for t in trials if t.status in ("TERMINATED", "ERROR")]
    running = []
    for t in trials:
        if t in ended:
            continue
        snapshot = storage.read_text(storage.join(experiment_path, "train", f"trial-{t.trial_id}", SNAPSHOT_FILE))
        try:
            latest = (json.loads(snapshot).get("latest_checkpoint_result") or {}) if snapshot else {}
        except ValueError:  # cut short by a kill: the trial resumes anyway (cluster.recover_torn_snapshot)
            latest = {}
        epoch = int((latest.get("metrics") or {}).get("epoch", 0) or (t.last_result or {}).get("epoch", 0))
        if epoch:  # a trial stopped by Ctrl-C is saved PENDING, but it has trained: it continues too
            running.append((t.trial_id, epoch))
    return ResumeSummary(len(ended), running, num_samples - len(ended) - len(running))


def make_rung_keeper(scheduler):
    """A Tune callback that saves ASHA's rung records with the experiment and puts them back on restore.

    `Tuner.restore` does not save the scheduler (ray #30838): without this a resumed sweep forgets every
    rung recorded before the crash and stops cutting trials until the rungs refill. The callback and the
    scheduler are pickled together in the tuner's state, so after a restore this callback holds the
    restored scheduler; Tune saves callback states beside its experiment state, on `storage_path`.
    """
    from ray.tune import Callback

    class RungKeeper(Callback):
        def __init__(self):
            self.scheduler = scheduler

        def get_state(self) -> dict:
            return {"rungs": [[(milestone, dict(recorded)) for milestone, recorded in bracket._rungs]
                              for bracket in self.scheduler._brackets]}

        def set_state(self, state: dict) -> None:
            for bracket, rungs in zip(self.scheduler._brackets, state["rungs"]):
                for (milestone, recorded), (saved_milestone, saved) in zip(bracket._rungs, rungs):
                    if milestone == saved_milestone:
                        recorded.update(saved)

    return RungKeeper()


def rank(views: list[TrialView], metric: str, mode: str) -> list[TrialView]:
    """Trials that did not fail and reported `metric`, best first."""
    ok = [v for v in views if v.status != "failed" and v.value(metric) is not None]
    return sorted(ok, key=lambda v: v.value(metric), reverse=(mode == "max"))


def resolve_batch_cap(config: SweepConfig, cap_batch: int | None) -> int | None:
    """--cap-batch, else search.per_gpu_batch_size.max (a number, or `probe`: measured now)."""
    from raysweep.console import print_batch_cap

    cap = cap_batch if cap_batch is not None else config.batch_cap
    probed = None
    if cap == "probe":
        from raysweep.probe import probe

        probed = probe(config)
        if probed.recommended is None:
            raise UserError(f"search.per_gpu_batch_size.max: probe found no per-GPU batch that fits "
                            f"(from 8 up); see {probed.path}")
        cap = probed.recommended
    if cap is not None:
        print_batch_cap(cap, probed)
    return cap


def _tuner(config, context, plan, single, resume, experiment_path, storage_root, name, callbacks):
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler
    from ray.tune.search.basic_variant import BasicVariantGenerator

    from raysweep.cluster import TRIAL_DRIVER

    trainable = tune.with_resources(tune.with_parameters(run_trial, context=context), {TRIAL_DRIVER: 1})
    if resume:
        if not tune.Tuner.can_restore(experiment_path):
            raise UserError(f"--resume: {experiment_path} holds no restorable Tune experiment")
        # callbacks (MLflow run ids, ASHA's rungs) come back from the experiment's own state. Errored trials
        # (OOM past the downshifts, divergence, restarts spent) ended with a verdict: they are not rerun.
        return tune.Tuner.restore(experiment_path, trainable=trainable, resume_unfinished=True, resume_errored=False)
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
        callbacks = [*callbacks, make_rung_keeper(scheduler)]
    return tune.Tuner(
        trainable,
        param_space=param_space,
        tune_config=tune.TuneConfig(
            metric=t.metric, mode=t.mode, num_samples=1 if single else t.num_samples, scheduler=scheduler,
            search_alg=search_alg, max_concurrent_trials=None if search_alg else plan.trials_at_once,
        ),
        run_config=tune.RunConfig(name=name, storage_path=storage_root, callbacks=callbacks, verbose=0),
    )
