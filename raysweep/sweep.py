"""A sweep: Ray Tune + ASHA over trials that each run on a warm Ray Train worker group; MLflow records it.

`tune` samples the spec's search space; `train` runs the same path with one trial at the defaults; `confirm` runs a
recipe (the sweep's answer) on a few seeds for its whole budget, outside ASHA (`Confirming`). `run` is the table of
contents; the rooms it visits: resume.py (before anything starts), cluster.py (the plan: how many trials
at once), slots/ (the warm worker groups), relay.py (a trial in its Tune actor), asha.py, callbacks.py (Tune's
events on the driver), tracking/ (the store), report/ and console.py (what is shown).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import datetime

from raysweep import layout, storage
from raysweep.errors import BrokerLost, StoreUnavailable, UserError
from raysweep.failures import find_cause

log = logging.getLogger(__name__)

END_WAIT_S = 30.0  # how long a failed sweep waits for the store to end its runs (the next command ends the rest)
STORE_LOST_END_WAIT_S = 3.0  # the same where the store itself failed the sweep (it had mlflow.retry_s already)


def in_store(config, call, what: str, wait_s: float | None = None):
    """`call()`, an MLflow call of the sweep's driver, bounded by the spec's mlflow.retry_s (tracking.in_store)."""
    from raysweep import tracking

    return tracking.in_store(call, tracking.resolve_tracking_uri(config.mlflow.tracking_uri), config.mlflow.retry_s,
                             what, wait_s)


@dataclass(frozen=True)
class Confirming:
    """A `confirm` run (raysweep/confirm.py): the recipe is the spec's knobs, fixed; each seed one trial, run for its
    whole budget outside ASHA; its parent run names the sweep it confirms and what was predicted."""

    sweep_run_id: str  # the confirmed sweep's parent run
    seeds: tuple[int, ...]
    predicted: str  # answer.Expected as JSON: what the recipe is expected to reach
    global_batch: int
    peak_lr: float


@dataclass(frozen=True)
class Where:
    """Where a sweep lives: its name, its MLflow store and its folder (storage_path/name)."""

    name: str
    tracking_uri: str
    storage_root: str
    experiment_path: str

    @classmethod
    def of(cls, config, single: bool, confirming: Confirming | None = None) -> Where:
        from raysweep.tracking import resolve_tracking_uri

        root = storage.resolve(config.storage_path)
        name = f"{config.name}-confirm" if confirming else f"{config.name}-train" if single else config.name
        return cls(name, resolve_tracking_uri(config.mlflow.tracking_uri), root, storage.join(root, name))


def run(config, *, single: bool = False, address: str | None = None, resume: bool = False, verbose: bool = False,
        progress_every_s: float = 30.0, cap_batch: int | None = None, confirming: Confirming | None = None) -> int:
    """Run a sweep (config.SweepConfig; with `single`, one trial at the defaults; with `confirming`, the defaults
    on each of its seeds, outside ASHA). Returns the exit code.

    Once the parent run is open, whatever fails ends it (and its RUNNING children) FAILED with the cause as the
    `error` tag; Ctrl-C ends them KILLED + `interrupted`; a driver killed outright is found by the next command
    on the store (tracking.reconcile_orphans).
    """
    from raysweep import tracking
    from raysweep.cluster import check_address, connect
    from raysweep.models import check_spec_model
    from raysweep.resume import check_resume

    t_start = time.monotonic()
    where = Where.of(config, single, confirming)
    resumed = in_store(config, lambda: check_resume(config, where.tracking_uri, where.experiment_path, where.name),
                       "the resume's checks") if resume else None
    check_address(address)
    # before Ray: a batch the data cannot run, a model that cannot train, are refused here
    check_batches(config, single or confirming is not None, cap_batch)
    model = check_spec_model(config)
    in_store(config, lambda: tracking.reconcile_orphans(where.tracking_uri, keep=resumed), "the orphans' search")
    started_ray = connect(address, config.scaling.worker_start_timeout_s, verbose)
    sweep = Sweep(config, where, single, confirming, model)
    try:
        if address:  # a cluster of machines: all of them up, and one storage_path that every one sees
            from raysweep import console, nodes
            nodes.check_cluster(where.storage_root, console.print_cluster)
        sweep.start(cap_batch)  # the plan, the data, the broker (its groups start building), ASHA
        sweep.open_runs(resumed)  # the parent run: new, or taken over (--resume)
        with tracking.Heartbeat(where.tracking_uri, sweep.parent_run_id):
            results = sweep.fit(resume, progress_every_s)  # every trial's run whole in the store when it returns
        sweep.log_figures(time.monotonic() - t_start)
        if results.num_terminated + results.num_errors < sweep.num_samples:
            sweep.interrupted()  # Ctrl-C: Tune stopped the trials and saved the experiment
        return sweep.finish()  # the summary, the report and the parent's verdict: from the store alone
    except BaseException as e:
        sweep.end_failed(e)
        raise
    finally:
        sweep.close(started_ray)


class Sweep:
    """One driver's run of a sweep, step by step (`run` calls them in order)."""

    def __init__(self, config, where: Where, single: bool, confirming: Confirming | None = None, model=None):
        self.config, self.where, self.single, self.confirming = config, where, single, confirming
        self.model = model  # models.ModelFacts: the check before Ray (None: not checked)
        self.searched = not single and confirming is None  # a tune sweep: its search, ASHA, the report, the answer
        self.num_samples = len(confirming.seeds) if confirming else 1 if single else config.tune.num_samples
        self.broker = self.plan = self.context = self.asha = self.scheduler = self.progress = None
        self.data_params: dict[str, str] = {}  # what the data was and what reading it changed: the parent run's params
        self.wall_s = self.busy = 0.0
        self.parent_run_id: str | None = None
        self.experiment_id: str | None = None
        self.ended = False  # the parent run has its verdict: nothing to end on the way out

    def start(self, cap_batch: int | None) -> None:
        """Before any trial: a trial that could never fit fails fast, one that does not fit yet waits (saying for
        what); the data is decoded (or read from its cache) once per sweep and goes into the object store once
        (trials get an object ref: the driver keeps no copy); the broker opens and its first groups start building
        while MLflow opens and Tune starts (every trial of a spec has its scaling)."""
        import ray

        from raysweep import console, slots, usercode
        from raysweep.asha import AshaPlan
        from raysweep.cluster import plan_when_free, trial_driver_node
        from raysweep.data import load_data
        from raysweep.data.describe import mlflow_params
        from raysweep.relay import SweepContext
        from raysweep.trainer import worker_env

        config, where = self.config, self.where
        self.plan = plan_when_free(config, self.num_samples, console.print_waiting)
        console.print_plan(self.plan, self.model)
        code = usercode.ship_for(config)
        batch_cap = resolve_batch_cap(config, cap_batch, code)
        data = load_data(config.data, console.progress_printer())
        console.print_data(data, config.data)
        train_size = len(data.train)  # what check_batches counted, unless the folder changed since
        config.trials.check_data_fits(train_size, batch_cap, searched=self.searched, source=config.source)
        self.data_params = mlflow_params(data)
        data_ref = ray.put(data.for_workers())
        del data  # the object store holds it for the ranks: the driver's own copy (0.5 GiB at 55,000 images) goes
        compile_cache = storage.join(where.experiment_path, layout.COMPILE_CACHE)
        self.broker = slots.open_broker(where.experiment_path, self.plan.trials_at_once, slots.SlotPlan(
            data_ref, storage.join(where.experiment_path, layout.SLOTS), worker_env(compile_cache), compile_cache,
            trial_driver_node(), config.mlflow.retry_s, config.tune.keep_warm_s, code))
        self.broker.prewarm.remote(config.trials.trial(config.trials.default_knobs(), train_size, batch_cap).to_dict(),
                                   min(self.plan.trials_at_once, self.num_samples))
        self.asha = AshaPlan.of(config) if self.searched else None
        self.context = SweepContext(config.trials, train_size, storage.join(where.experiment_path, layout.TRAIN),
                                    self.broker, batch_cap, self.asha.decision_points if self.asha else (),
                                    config.time_attr)

    def open_runs(self, resumed: str | None) -> None:
        """The sweep's parent run: a new one with the spec, or (--resume) the sweep's own, taken over; a resume's
        relays end the trials the store says ended for good as they ended (relay.SweepContext.settled)."""
        import dataclasses

        from raysweep import console, tracking
        from raysweep.config import spec_yaml
        from raysweep.resume import take_over

        config, where = self.config, self.where
        if resumed:
            taken = in_store(config, lambda: take_over(where.tracking_uri, resumed, where.experiment_path,
                                                       self.num_samples), "the resume's take-over")
            console.print_resumed(taken.summary)
            self.context = dataclasses.replace(self.context, settled=taken.settled)
            self.experiment_id, self.parent_run_id = taken.experiment_id, resumed
            return
        kind = "confirm" if self.confirming else "train" if self.single else "tune"
        self.experiment_id, self.parent_run_id = in_store(config, lambda: tracking.open_sweep(
            where.tracking_uri, config.experiment_name, run_name=f"{where.name} {datetime.now():%Y-%m-%d %H:%M:%S}",
            tags={"raysweep.kind": kind, "raysweep.storage": str(where.experiment_path),
                  "raysweep.metric": config.tune.metric, "raysweep.mode": config.tune.mode,
                  **tracking.target_tags(config.tune.target), **tracking.confirm_tags(self.confirming)},
            spec_text=spec_yaml(config), params={**self.data_params, **(self.model.params() if self.model else {})}),
            "the sweep's parent run")

    def fit(self, resume: bool, progress_every_s: float):
        """Tune's run of the trials, with the driver's callbacks; every write in the store when it returns."""
        from raysweep import slots, tracking
        from raysweep.callbacks import show_progress

        self.progress = _progress(self.config, self.context.train_size, progress_every_s, self.single)
        show_progress(self.where.experiment_path, self.progress)  # a restored sweep's callbacks print here too
        try:
            results = _tuner(self, resume).fit()
        except Exception as e:  # Tune may wrap what a callback raised: the broker or the store lost is the cause
            for cause in (BrokerLost, StoreUnavailable):
                lost = find_cause(e, cause)
                if lost is not None and lost is not e:
                    raise lost from e
            raise
        tracking.flush_writes(self.parent_run_id)  # the trials' runs whole before anything reads or ends them
        lost = slots.broker_lost(self.where.experiment_path, wait_s=1.0)  # trials may have ended with it unseen
        if lost:
            raise BrokerLost.of(lost)
        return results

    def interrupted(self) -> None:
        """Ctrl-C: mark the runs KILLED + interrupted (`tune --resume` continues them), then say how to resume."""
        from raysweep import tracking

        in_store(self.config, lambda: tracking.end_sweep(self.where.tracking_uri, self.parent_run_id, "KILLED"),
                 "the sweep's end")
        self.ended = True
        raise KeyboardInterrupt

    def log_figures(self, wall_s: float) -> None:
        """The sweep's own figures on the parent run: its wall time and the share of it its slots trained."""
        import ray

        from raysweep import tracking

        self.wall_s = wall_s
        self.busy = busy_share(ray.get(self.broker.state.remote())["busy_s"], wall_s, self.plan.trials_at_once)
        in_store(self.config, lambda: tracking.log_sweep_figures(
            self.where.tracking_uri, self.parent_run_id, {"busy_share": self.busy, "sweep_wall_s": wall_s}),
            "the sweep's figures")

    def finish(self) -> int:
        """From the store alone (tracking.load_sweep, exactly as `raysweep report` reads it): the best trial, the
        parent run's verdict, the report (sweeps) and the closing lines. Exit 0 when a trial succeeded, else 1."""
        from raysweep import console, report, tracking
        from raysweep.answer import console as answer_console
        from raysweep.metrics import WORKER_PARAMS

        config, where = self.config, self.where
        record = in_store(config, lambda: tracking.load_sweep(where.tracking_uri, config.experiment_name,
                                                              self.parent_run_id), "the sweep's read")
        ranked = report.ranked(record)
        best = None
        if ranked:
            top = ranked[0]
            best = {"trial_id": top.trial_id, "value": top.last(record.metric),
                    "time_to_target_s": top.last("time_to_target_s"),
                    "params": {k: v for k, v in top.params.items() if k not in WORKER_PARAMS}}
        report_dir = storage.join(where.experiment_path, layout.REPORT)
        built = in_store(config, lambda: report.publish(record, report_dir, config.command_args),
                         "the report") if self.searched else None
        in_store(config, lambda: tracking.close_sweep(where.tracking_uri, self.parent_run_id, best, record.metric,
                                                      "FINISHED" if ranked else "FAILED"), "the sweep's end")
        self.ended = True
        if self.single:
            top = ranked[0] if ranked else None
            console.print_train_summary(top, self.wall_s, self.progress.startups.get(top.trial_id) if top else None)
        elif self.searched:
            console.print_sweep_summary(built, self.wall_s, config.horizon, config.train)
        console.print_busy(self.busy, self.wall_s, self.plan.trials_at_once, self.progress.startups)
        if self.confirming:  # confirm.run prints the comparison, from the store, once this returns
            return 0 if ranked else 1
        ui, link = tracking.runs_link(where.tracking_uri, self.experiment_id,
                                      None if self.single else self.parent_run_id, config.tune.metric,
                                      config.tune.mode)
        console.print_where(where.experiment_path, where.tracking_uri, config.experiment_name, self.experiment_id,
                            ui, link, config.tune.metric)
        if built is not None:  # the sweep's last block: its one answer
            written = storage.join(report_dir, report.ANSWER_FILE) if built.answer else None
            answer_console.print_answer(built.answer, written)
        return 0 if ranked else 1

    def end_failed(self, e: BaseException) -> None:
        """Whatever failed once the parent run was open ends it (and its RUNNING children): FAILED with the cause
        as the `error` tag, or KILLED + interrupted for Ctrl-C. The store failing too is logged, never raised over
        the first cause."""
        from raysweep import tracking

        if self.parent_run_id is None or self.ended:
            return
        interrupted = isinstance(e, KeyboardInterrupt)
        try:
            tracking.flush_writes(self.parent_run_id)  # what the trials reported, then their ending
        except Exception as mlflow_error:
            log.error("MLflow writes of run %s: %s", self.parent_run_id, mlflow_error)
        # bounded: a store that stopped answering must not hold the sweep's end (the next command ends the runs);
        # where the store is the cause, it already had mlflow.retry_s, so the end is one short attempt
        wait_s = STORE_LOST_END_WAIT_S if find_cause(e, StoreUnavailable) is not None else END_WAIT_S
        try:
            in_store(self.config, lambda: tracking.end_sweep(
                self.where.tracking_uri, self.parent_run_id, "KILLED" if interrupted else "FAILED",
                error=None if interrupted else _cause(e)), "the sweep's end", wait_s)
        except Exception as mlflow_error:
            log.error("could not end MLflow run %s (the next raysweep command on the store ends it): %s",
                      self.parent_run_id, mlflow_error)

    def close(self, started_ray: bool) -> None:
        """The broker and its slots gone; Ray stopped where this driver started it."""
        from raysweep import slots

        if self.broker is not None:
            slots.close_broker(self.where.experiment_path)
        if started_ray:
            import ray

            ray.shutdown()


def _progress(config, train_size: int, every_s: float, single: bool):
    from raysweep.console import ConsoleProgress

    return ConsoleProgress(config.trials, config.tune, config.train.epochs, train_size, every_s, per_epoch=single)


def _callbacks(sweep: Sweep) -> list:
    """The driver's Tune callbacks, in order (callbacks.py): the clock first (the others log what it adds)."""
    import functools

    from raysweep import slots
    from raysweep.asha import RungKeeper
    from raysweep.callbacks import BrokerLink, ConsoleEvents, MLflowEvents, SweepClock
    from raysweep.tracking import TrialRuns

    config, where = sweep.config, sweep.where
    horizon = config.horizon
    runs = TrialRuns(where.tracking_uri, sweep.experiment_id, sweep.parent_run_id)
    callbacks = [SweepClock(), BrokerLink(where.experiment_path),
                 MLflowEvents(runs, config.trials, sweep.context.train_size, horizon, config.mlflow.retry_s,
                              functools.partial(slots.recorded, where.experiment_path)),
                 ConsoleEvents(where.experiment_path, horizon)]
    if sweep.asha is not None:
        callbacks.append(RungKeeper(sweep.scheduler, where.tracking_uri, sweep.parent_run_id))
    return callbacks


def _tuner(sweep: Sweep, resume: bool):
    """Tune's Tuner for the sweep (or, --resume, the sweep's own restored: its callbacks, MLflow run ids and ASHA's
    rungs come back from the experiment's state)."""
    from ray import tune
    from ray.tune.search.basic_variant import BasicVariantGenerator

    from raysweep.cluster import TRIAL_DRIVER
    from raysweep.config.trial import SEED
    from raysweep.console import print_search
    from raysweep.relay import run_trial
    from raysweep.search import describe, searcher

    config, where = sweep.config, sweep.where
    trainable = tune.with_resources(tune.with_parameters(run_trial, context=sweep.context), {TRIAL_DRIVER: 1})
    if resume:
        # errored trials come back too: the relay ends the ones the store says failed on their own as they ended
        # (SweepContext.settled); the ones that failed for the infrastructure continue from their checkpoints
        return tune.Tuner.restore(where.experiment_path, trainable=trainable, resume_unfinished=True,
                                  resume_errored=True)
    sweep.scheduler = sweep.asha.scheduler() if sweep.asha else None
    num_samples = sweep.num_samples
    if sweep.confirming:  # the recipe (the spec's knobs, fixed) once per seed: a grid, no search, no ASHA
        param_space = {**config.trials.default_knobs(), SEED: tune.grid_search(list(sweep.confirming.seeds))}
        search_alg, num_samples = None, 1
    elif sweep.single:
        param_space, search_alg = config.trials.default_knobs(), None
    else:  # the spec's defaults run first: a known baseline every sweep can be compared against
        search_alg, param_space = searcher(config, sweep.plan.trials_at_once, sweep.asha.rungs)
        print_search(describe(config))
    # Tune wraps a Searcher (tpe) in its ConcurrencyLimiter for max_concurrent_trials, which hands the limit to
    # search.RungTPE (it limits itself); Tune ignores it for a BasicVariantGenerator (random), limited in
    # search.searcher
    limit = None if isinstance(search_alg, BasicVariantGenerator) else sweep.plan.trials_at_once
    return tune.Tuner(
        trainable, param_space=param_space,
        tune_config=tune.TuneConfig(
            metric=config.tune.metric, mode=config.tune.mode, num_samples=num_samples,
            scheduler=sweep.scheduler, search_alg=search_alg,
            max_concurrent_trials=limit,
            # the next trial starts in the actor the last one ended in (no new process: the gap between trials)
            reuse_actors=True),
        run_config=tune.RunConfig(name=where.name, storage_path=where.storage_root, callbacks=_callbacks(sweep),
                                  verbose=0))


def check_batches(config, single: bool, cap_batch: int | None) -> None:
    """The search's batches against the training set's size (a folder listed, not decoded: a fraction of a second
    for 50,000 files): what the data cannot run is one line and exit 2 before Ray starts. The sweep checks again
    with the decoded set and a measured batch cap (Sweep.start)."""
    from raysweep.data import train_size

    config.trials.check_data_fits(train_size(config.data), static_batch_cap(config, cap_batch), searched=not single,
                                  source=config.source)


def static_batch_cap(config, cap_batch: int | None) -> int | None:
    """The batch cap known without measuring: --cap-batch, else a number in search.per_gpu_batch_size.max (`probe`
    is measured once Ray runs: resolve_batch_cap)."""
    cap = cap_batch if cap_batch is not None else config.trials.batch_cap
    return cap if isinstance(cap, int) else None


def resolve_batch_cap(config, cap_batch: int | None, code: dict | None = None) -> int | None:
    """--cap-batch, else search.per_gpu_batch_size.max (a number, or `probe`: measured now; `code`: the user's model
    code for the probe's workers, usercode.ship_for)."""
    from raysweep.console import print_batch_cap

    cap = cap_batch if cap_batch is not None else config.trials.batch_cap
    probed = None
    if cap == "probe":
        from raysweep.probe import probe

        probed = probe(config, code=code)
        if probed.recommended is None:
            raise UserError(f"search.per_gpu_batch_size.max: probe found no per-GPU batch that fits "
                            f"(from 8 up); see {probed.path}")
        cap = probed.recommended
    if cap is not None:
        print_batch_cap(cap, probed)
    return cap


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
