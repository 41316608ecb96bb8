"""A sweep: Ray Tune + ASHA over trials that each run a Ray Train `TorchTrainer`; MLflow records it.

`tune` samples the spec's search space; `train` runs the same path with one trial at the defaults.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from raysweep import storage
from raysweep.config import Choice, LogUniform, RandInt, SweepConfig, Uniform, spec_yaml
from raysweep.errors import SweepFailed, UserError
from raysweep.failures import find_cause
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
    train_size: int
    train_storage: str  # absolute folder or URI: each trial's folder is <storage>/<name>/train/trial-<id>
    broker: Any  # the sweep's slots.Broker actor: trials run on its warm worker groups
    batch_cap: int | None = None  # per-GPU batches above it run as smaller micro-batches
    decision_points: tuple[float, ...] = ()  # where the scheduler may stop a trial, in time_attr (decision_points())
    time_attr: str = "epoch"  # what ASHA counts: epoch or train_seconds
    settled: dict = field(default_factory=dict)  # --resume: trial id → how the store says it ended (resume.py)


POLL_ANSWER_S = 30.0  # a poll of the broker waits at most this long beyond its own long poll (slots.ASK_WAIT_S)


def run_trial(knobs: dict, context: SweepContext) -> None:
    """Tune function trainable: hands the trial to a warm worker group (slots.py) and relays each epoch's report to
    Tune, where ASHA judges it; ends as the trial ended (failures.TrialFailure, typed: its own failures are final;
    an infrastructure failure is submitted again, to resume from its checkpoint on another group, at most
    train.max_infra_retries times). A trial the store already settled (--resume: pruned, finished, or failed on
    its own) ends at once, as it ended: it never trains again."""
    from ray import tune
    from ray.exceptions import GetTimeoutError, RayActorError

    from raysweep.failures import INFRA, TrialFailure

    relay_started = time.time()
    trial_id = tune.get_context().get_trial_id()
    if trial_id in context.settled:
        ended = context.settled[trial_id]
        if ended["failure"] is not None:
            raise TrialFailure.from_dict(ended["failure"])
        tune.report(ended["last"])  # Tune needs a last result with the metric; the store is not written again
        return
    trial = context.config.trial(knobs, context.train_size, context.batch_cap)
    # the folder comes from the trial id: a trial run again (restart, --resume) continues from its checkpoint there
    run_dir = storage.join(context.train_storage, f"trial-{trial_id}")
    retries = 0
    while True:
        try:
            failure = _relay(context, trial_id, trial, run_dir, relay_started, retries)
        except (RayActorError, GetTimeoutError) as e:  # the broker is gone (or hung): no group can run the trial
            raise TrialFailure(INFRA, f"the sweep's broker was lost ({type(e).__name__})") from None
        if failure is None:
            return
        if failure.final or retries >= trial.train.max_infra_retries:
            if not failure.final:
                failure = TrialFailure(INFRA, f"{failure.message} (train.max_infra_retries {retries} spent)")
            raise failure
        retries += 1
        log.warning("trial %s: %s; submitted again (%d of train.max_infra_retries %d)", trial_id, failure.message,
                    retries, trial.train.max_infra_retries)


def _relay(context: SweepContext, trial_id: str, trial, run_dir: str, relay_started: float, retries: int):
    """One attempt: submit the trial to the broker, relay its reports to Tune until it is done; returns how it
    failed (failures.TrialFailure) or None."""
    import ray
    from ray import tune

    from raysweep.failures import TrialFailure
    from raysweep.slots import ASK_WAIT_S

    broker = context.broker
    seq = ray.get(broker.submit.remote(trial_id, trial.to_dict(), run_dir, trial.train.max_failures,
                                       context.decision_points, context.time_attr), timeout=POLL_ANSWER_S)
    since = 0
    while True:
        out = ray.get(broker.poll.remote(trial_id, seq, since), timeout=ASK_WAIT_S + POLL_ANSWER_S)
        for i, metrics in enumerate(out["reports"], start=since):
            if i == out["timeline_at"] and not retries:  # the first epoch: how long the trial took to start
                metrics = {**metrics, STARTUP_STAMPS: json.dumps({**out["timeline"], "relay_started": relay_started})}
            if retries:
                metrics = {**metrics, INFRA_RETRIES: retries}
            tune.report(metrics)  # returns once Tune has let the trial go on (a stop ends this process's trial here)
            broker.ack.remote(trial_id, seq, i + 1)
        since += len(out["reports"])
        if out["done"]:
            return TrialFailure.from_dict(out["failure"]) if out["failure"] else None


INFRA_RETRIES = "infra_retries"  # reported by a trial submitted again after an infrastructure failure (MLflow tag)
class BrokerLost(SweepFailed):
    """The sweep's broker actor died (its node, the OOM killer): the sweep ends with the cause."""


STARTUP_STAMPS = "startup_stamps"  # the first report's start-up stamps (JSON), turned into metrics by SweepClock


def make_sweep_clock(experiment_path: str):
    """The first of the sweep's Tune callbacks, on the driver: stamps each trial's start, turns the stamps its
    first report carries into `startup_s` and its phases (metrics.startup_phases; the callbacks after it log and
    print them), and tells the broker when Tune ended a trial (ASHA's stop, an error), so its slot stops at the
    epoch's end and takes the next trial.

    It finds the broker by the sweep's folder rather than holding it: Tune pickles callbacks with the experiment,
    and a resumed sweep's restored callback must find the new driver's broker (slots.active).
    """
    from ray.tune import Callback

    from raysweep.metrics import startup_phases

    class SweepClock(Callback):
        def __init__(self):
            self.experiment_path = experiment_path
            self.started: dict[str, float] = {}

        def on_step_begin(self, iteration, trials, **info):
            from raysweep import slots

            lost = slots.broker_lost(self.experiment_path)
            if lost:  # every trial's relay fails with it too (failure: infra): --resume continues them
                raise BrokerLost(f"the sweep's broker was lost ({lost}); the trials' checkpoints are kept: "
                                 f"`tune --resume` continues them")

        def on_trial_start(self, iteration, trials, trial, **info):
            self.started[trial.trial_id] = time.time()

        def on_trial_result(self, iteration, trials, trial, result, **info):
            stamps = result.pop(STARTUP_STAMPS, None)
            if stamps is not None:
                stamps = json.loads(stamps)
                stamps["trial_started"] = self.started.get(trial.trial_id, stamps["relay_started"])
                result.update(startup_phases(stamps))

        def on_trial_complete(self, iteration, trials, trial, **info):
            self._end(trial)

        def on_trial_error(self, iteration, trials, trial, **info):
            self._end(trial)

        def _end(self, trial):
            from raysweep import slots

            broker = slots.active(self.experiment_path)
            if broker is not None:
                broker.end.remote(trial.trial_id)

    return SweepClock()


# ---------------------------------------------------------------------------------------------
# The sweep


def run(config: SweepConfig, *, single: bool = False, address: str | None = None, resume: bool = False,
        verbose: bool = False, progress_every_s: float = 30.0, cap_batch: int | None = None) -> int:
    """Run a sweep (or, with `single`, one trial at the defaults). Returns the exit code.

    Once the parent run is open, whatever fails ends it (and its RUNNING children) FAILED with the cause as the
    `error` tag; Ctrl-C ends them KILLED + `interrupted`; a driver killed outright is found by the next command
    on the store (tracking.reconcile_orphans).
    """
    from raysweep import console, slots, tracking
    from raysweep.cluster import connect, plan_when_free, trial_driver_node, worker_env
    from raysweep.data import load_data

    t_start = time.monotonic()
    tracking_uri = tracking.resolve_tracking_uri(config.mlflow.tracking_uri)
    storage_root = storage.resolve(config.storage_path)
    name = f"{config.name}-train" if single else config.name
    experiment_path = storage.join(storage_root, name)
    resumed = check_resume(config, tracking_uri, experiment_path, name) if resume else None  # before Ray and data
    tracking.reconcile_orphans(tracking_uri, keep=resumed)

    started_ray = connect(address, config, verbose)
    parent_run_id, ended, broker = None, False, None
    try:
        import ray

        num_samples = 1 if single else config.tune.num_samples
        # before any work: a trial that could never fit fails fast; one that does not fit yet waits, saying for what
        plan = plan_when_free(config, num_samples, console.print_waiting)
        console.print_plan(plan)
        batch_cap = resolve_batch_cap(config, cap_batch)
        data = load_data(config.data, console.progress_printer())  # decoded once per sweep; trials get an object ref
        console.print_data(data, config)
        config.check_data_fits(len(data.train), batch_cap, searched=not single)  # before any trial starts
        compile_cache = storage.join(experiment_path, "compile_cache")
        broker = slots.open_broker(experiment_path, plan.trials_at_once, slots.SlotPlan(
            ray.put(data), storage.join(experiment_path, "slots"), worker_env(compile_cache), compile_cache,
            trial_driver_node(), config.mlflow.retry_s, config.tune.keep_warm_s))
        # the groups start building now, while MLflow opens and Tune starts (every trial of a spec has its scaling)
        broker.prewarm.remote(config.trial(config.default_knobs(), len(data.train), batch_cap).to_dict(),
                              min(plan.trials_at_once, num_samples))
        scheduler = None if single else asha(config)
        # --resume: trials the store says ended for good (pruned, finished, failed on their own) stay as they ended
        settled = tracking.settled_trials(tracking_uri, resumed) if resumed else {}
        context = SweepContext(config, len(data.train), storage.join(experiment_path, "train"), broker, batch_cap,
                               decision_points(scheduler, config), config.time_attr, settled)
        del data
        if resumed:
            console.print_resumed(resume_summary(experiment_path, num_samples))
            experiment_id, parent_run_id = tracking.resumed_parent(tracking_uri, resumed), resumed
        else:
            experiment_id, parent_run_id = tracking.open_sweep(
                tracking_uri, config.experiment_name, run_name=f"{name} {datetime.now():%Y-%m-%d %H:%M:%S}",
                tags={"raysweep.kind": "train" if single else "tune", "raysweep.storage": str(experiment_path),
                      "raysweep.metric": config.tune.metric, "raysweep.mode": config.tune.mode,
                      **tracking.target_tags(config.tune.target)},
                spec_text=spec_yaml(config))
        with tracking.Heartbeat(tracking_uri, parent_run_id):
            progress = console.ConsoleProgress(config, context.train_size, progress_every_s, per_epoch=single)
            callbacks = [make_sweep_clock(experiment_path),  # first: the others log what it adds
                         tracking.make_mlflow_callback(tracking_uri, experiment_id, parent_run_id, config,
                                                       context.train_size,
                                                       functools.partial(slots.recorded, experiment_path)),
                         console.make_console_callback(progress)]
            try:
                results = _tuner(config, context, plan, single, resume, experiment_path, storage_root, name,
                                 callbacks, scheduler, (tracking_uri, parent_run_id)).fit()
            except Exception as e:  # Tune may wrap what a callback raised: the broker lost is the cause to show
                lost = find_cause(e, BrokerLost)
                if lost is not None and lost is not e:
                    raise lost from e
                raise
            tracking.flush_writes(parent_run_id)  # the trials' runs whole before anything reads or ends them
        lost = slots.broker_lost(experiment_path, wait_s=1.0)  # the trials may have ended with it before Tune's loop saw
        if lost:
            raise BrokerLost(f"the sweep's broker was lost ({lost}); the trials' checkpoints are kept: "
                             f"`tune --resume` continues them")
        wall_s = time.monotonic() - t_start
        busy = busy_share(ray.get(broker.state.remote())["busy_s"], wall_s, plan.trials_at_once)
        tracking.log_sweep_figures(tracking_uri, parent_run_id, {"busy_share": busy, "sweep_wall_s": wall_s})
        if results.num_terminated + results.num_errors < num_samples:
            # Ctrl-C: Tune stopped the trials and saved the experiment; mark the runs, then say how to resume
            tracking.end_sweep(tracking_uri, parent_run_id, "KILLED")
            ended = True
            raise KeyboardInterrupt
        views = [TrialView.of_result(r, config.horizon) for r in results]
        ranked = rank(views, config.tune.metric, config.tune.mode, config.tune.target is not None)
        best = None
        if ranked:
            top = ranked[0]
            best = {"trial_id": top.trial_id, "value": top.value(config.tune.metric),
                    "time_to_target_s": top.value("time_to_target_s"),
                    "params": config.trial(top.config, context.train_size).params()}
        built = None
        if not single:  # the report is built from the MLflow store, exactly as `raysweep report` rebuilds it
            from raysweep import report

            built = report.publish(tracking.load_sweep(tracking_uri, config.experiment_name, parent_run_id),
                                   storage.join(experiment_path, "report"))
        tracking.close_sweep(tracking_uri, parent_run_id, best, config.tune.metric, "FINISHED" if ranked else "FAILED")
        ended = True
        if single:
            top = ranked[0] if ranked else None
            console.print_train_summary(config, top, context.train_size, wall_s,
                                        progress.startups.get(top.trial_id) if top else None)
        else:
            console.print_sweep_summary(config, views, built, wall_s)
        console.print_busy(busy, wall_s, plan.trials_at_once, progress.startups)
        ui, link = tracking.runs_link(tracking_uri, experiment_id, None if single else parent_run_id,
                                      config.tune.metric, config.tune.mode)
        console.print_where(experiment_path, tracking_uri, config.experiment_name, experiment_id, ui, link,
                            config.tune.metric)
        return 0 if ranked else 1
    except BaseException as e:
        if parent_run_id is not None and not ended:
            interrupted = isinstance(e, KeyboardInterrupt)
            try:
                tracking.flush_writes(parent_run_id)  # what the trials reported, then their ending
            except Exception as mlflow_error:
                log.error("MLflow writes of run %s: %s", parent_run_id, mlflow_error)
            try:
                tracking.end_sweep(tracking_uri, parent_run_id, "KILLED" if interrupted else "FAILED",
                                   error=None if interrupted else _cause(e))
            except Exception as mlflow_error:  # the store itself failing: say so, and raise the first cause
                log.error("could not end MLflow run %s: %s", parent_run_id, mlflow_error)
        raise
    finally:
        if broker is not None:
            slots.close_broker(experiment_path)
        if started_ray:
            import ray

            ray.shutdown()


def busy_share(busy_s: float, wall_s: float, slots: int) -> float:
    """The share of the sweep's slot-seconds (wall time × concurrency) its workers spent training and evaluating
    (busy_s: every epoch's epoch_time_s); the rest went to start-up, waiting and bookkeeping."""
    return busy_s / max(wall_s * slots, 1e-9)


def _cause(e: BaseException) -> str:
    """One line for the `error` tag: the exception and, for Tune's wrapper, what it wraps."""
    inner = e.__cause__ or e.__context__
    line = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    if inner is not None and type(e).__name__ == "TuneError":
        line = f"{type(inner).__name__}: {str(inner).strip()}"
    return line


# keys a resumed sweep may change: how long to wait and how often to retry, nothing a trial computes
RESUME_MAY_CHANGE = ("scaling.worker_start_timeout_s", "scaling.max_setup_failures", "train.max_failures",
                     "train.max_infra_retries", "tune.keep_warm_s")
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
    running: list[tuple[str, int]]  # (trial id, last reported epoch): continue from their own checkpoints
    pending: int  # not started yet


def resume_summary(experiment_path: str, num_samples: int) -> ResumeSummary:
    """What `--resume` will find (read before Tune restores it): Tune's saved trial states, and for each
    unfinished trial the epoch of its newest checkpoint, where it continues (Tune's state, saved every few
    seconds, can trail it, or hold no result for a trial that did train)."""
    from ray.tune import ExperimentAnalysis

    from raysweep.worker.entry import last_checkpoint_epoch

    trials = ExperimentAnalysis(experiment_path).trials
    ended = [t for t in trials if t.status in ("TERMINATED", "ERROR")]
    running = []
    for t in trials:
        if t in ended:
            continue
        epoch = last_checkpoint_epoch(storage.join(experiment_path, "train", f"trial-{t.trial_id}"))
        if epoch:  # a trial stopped by Ctrl-C is saved PENDING, but it has trained: it continues too
            running.append((t.trial_id, epoch))
    return ResumeSummary(len(ended), running, num_samples - len(ended) - len(running))


def make_rung_keeper(scheduler, tracking_uri: str | None = None, parent_run_id: str | None = None):
    """A Tune callback that saves ASHA's rung records with the experiment and puts them back on restore.

    `Tuner.restore` does not save the scheduler (ray #30838): without this a resumed sweep forgets every
    rung recorded before the crash and stops cutting trials until the rungs refill. The callback and the
    scheduler are pickled together in the tuner's state, so after a restore this callback holds the
    restored scheduler; Tune saves callback states beside its experiment state, on `storage_path`.

    That state is only as new as Tune's last periodic save: a trial recorded at a rung after it (and before a
    crash) would be missing, and its resumed run judged again at that rung. So on restore the rungs are also
    replayed from the MLflow store (the sweep's parent run: every trial's reported history, which the slots never
    run ahead of), through ASHA's own bookkeeping: what a rung already holds stays; what only the store knew is
    added. Rung records are per time attribute (epoch, train_seconds): a state of another unit is not used.
    """
    from ray.tune import Callback

    class RungKeeper(Callback):
        def __init__(self):
            self.scheduler = scheduler
            self.tracking_uri, self.parent_run_id = tracking_uri, parent_run_id

        def get_state(self) -> dict:
            return {"time_attr": self.scheduler._time_attr,
                    "rungs": [[(milestone, dict(recorded)) for milestone, recorded in bracket._rungs]
                              for bracket in self.scheduler._brackets]}

        def set_state(self, state: dict) -> None:
            if state.get("time_attr", "epoch") == self.scheduler._time_attr:  # rungs of another unit: not these
                for bracket, rungs in zip(self.scheduler._brackets, state["rungs"]):
                    for (milestone, recorded), (saved_milestone, saved) in zip(bracket._rungs, rungs):
                        if milestone == saved_milestone:
                            recorded.update(saved)
            if getattr(self, "tracking_uri", None) and getattr(self, "parent_run_id", None):
                try:
                    from raysweep.tracking import trial_histories

                    self.replay(trial_histories(self.tracking_uri, self.parent_run_id, self.scheduler._time_attr,
                                                self.scheduler._metric))
                except Exception as e:  # the saved rungs still hold; say what could not be added
                    log.warning("ASHA's rungs not refilled from MLflow (%s: %s)", type(e).__name__, e)

        def replay(self, histories: dict[str, list[tuple[float, float]]]) -> None:
            """Each trial's (time, metric) reports in order, through ASHA's own rung bookkeeping (a trial is
            recorded once per rung, at its first report at or past it); its decisions are not acted on here."""
            class Stub:
                def __init__(self, trial_id):
                    self.trial_id = trial_id

            op = self.scheduler._metric_op
            for trial_id, reports in histories.items():
                for time_value, metric in reports:
                    for bracket in self.scheduler._brackets:
                        bracket.on_result(Stub(trial_id), time_value, op * metric)

    return RungKeeper()


def rank(views: list[TrialView], metric: str, mode: str, target: bool = False) -> list[TrialView]:
    """Trials that did not fail, best first: by `metric`, or with a target by time_to_target_s and then the ones
    that never reached it by `metric` (metrics.rank)."""
    from raysweep.metrics import rank as ranked

    return ranked([v for v in views if v.status != "failed"], TrialView.value, metric, mode, target)


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


def asha(config: SweepConfig):
    """The sweep's ASHA scheduler."""
    from ray.tune.schedulers import ASHAScheduler

    a = config.tune.asha
    return ASHAScheduler(
        time_attr=config.time_attr,  # worker-reported epoch or train_seconds: Tune's own counters restart on restore
        max_t=config.max_t, grace_period=a.grace_period, reduction_factor=a.reduction_factor,
    )


def decision_points(scheduler, config: SweepConfig) -> tuple[float, ...]:
    """Where `scheduler` may stop a trial, in its time attribute: ASHA's rungs (its one bracket's milestones) and
    max_t (in epochs, where it comes before the last epoch). ASHA decides at the first report at or past each;
    between them it always lets a trial go on (slots.Broker.report)."""
    if scheduler is None:
        return ()
    rungs = {float(milestone) for bracket in scheduler._brackets for milestone, _ in bracket._rungs}
    if config.time_attr != "epoch" or config.max_t < config.train.epochs:
        rungs.add(float(config.max_t))
    return tuple(sorted(rungs))


def rung_table(config: SweepConfig, epoch_seconds: dict[int, float]) -> list[list[str]]:
    """ASHA's rungs (then max_t) in the spec's unit and in the other one for each of the spec's global batches
    (`epoch_seconds`: training seconds an epoch per global batch, as measured; a batch without one gets '?'):
    `check` prints it."""
    scheduler = asha(config)
    points = sorted({float(m) for b in scheduler._brackets for m, _ in b._rungs} | {float(config.max_t)})
    batches = config.global_batches()
    seconds = config.time_attr == "train_seconds"
    rows = []
    for i, point in enumerate(points):
        row = [f"rung {i + 1}" if i < len(points) - 1 else "max_t", f"{point:g} {'s' if seconds else 'ep'}"]
        for batch in batches:
            per_epoch = epoch_seconds.get(batch)
            if per_epoch is None:
                row.append("?")
            else:
                row.append(f"{point / per_epoch:.1f} ep" if seconds else f"{point * per_epoch:.0f} s")
        rows.append(row)
    return rows


def _tuner(config, context, plan, single, resume, experiment_path, storage_root, name, callbacks, scheduler,
           rung_store=(None, None)):
    from ray import tune
    from ray.tune.search.basic_variant import BasicVariantGenerator

    from raysweep.cluster import TRIAL_DRIVER

    trainable = tune.with_resources(tune.with_parameters(run_trial, context=context), {TRIAL_DRIVER: 1})
    if resume:
        if not tune.Tuner.can_restore(experiment_path):
            raise UserError(f"--resume: {experiment_path} holds no restorable Tune experiment")
        # callbacks (MLflow run ids, ASHA's rungs) come back from the experiment's own state.
        # Errored trials come back too: the relay ends the ones the store says failed on their own as they ended
        # (SweepContext.settled), and the ones that failed for the infrastructure continue from their checkpoints
        return tune.Tuner.restore(experiment_path, trainable=trainable, resume_unfinished=True, resume_errored=True)
    t = config.tune
    if single:
        param_space, search_alg = config.default_knobs(), None
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
        callbacks = [*callbacks, make_rung_keeper(scheduler, *rung_store)]
    return tune.Tuner(
        trainable,
        param_space=param_space,
        tune_config=tune.TuneConfig(
            metric=t.metric, mode=t.mode, num_samples=1 if single else t.num_samples, scheduler=scheduler,
            search_alg=search_alg, max_concurrent_trials=None if search_alg else plan.trials_at_once,
            # the next trial starts in the actor the last one ended in (no new process: the gap between trials)
            reuse_actors=True,
        ),
        run_config=tune.RunConfig(name=name, storage_path=storage_root, callbacks=callbacks, verbose=0),
    )
