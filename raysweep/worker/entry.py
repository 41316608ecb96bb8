"""The Ray Train entry point of every rank: the only worker module that talks to Ray.

Ray is imported inside the functions: the rest of the worker runs (and is tested) in a plain process.
"""

from __future__ import annotations

import logging
import time

import torch

from raysweep import storage
from raysweep.config import TrialConfig
from raysweep.metrics import EAGER_FALLBACK, report_dict
from raysweep.worker import compile_cache
from raysweep.worker.device import release_trial_memory, setup_device
from raysweep.worker.faults import FAULTS, TrialFailure
from raysweep.worker.reduce import agree, broadcast_object, gather_strings
from raysweep.worker.run import CHECKPOINT_FILE, KEPT_CHECKPOINTS, TrainingRun
from raysweep.worker.shard import Shard

log = logging.getLogger(__name__)

# a rank 0's call to the broker waits at most this long beyond the wait the call itself may make (the broker's long
# polls, a rung's decision, the store: slot_worker's config says how long)
BROKER_ANSWER_S = 30.0


def train_worker(config: dict) -> None:
    """Every rank of one trial on a group of its own, from epoch 1 (`cluster.make_trainer`'s default: the
    benchmarks' cold start and the tests that fit one trainer); a sweep's trials run on warm groups instead
    (`slot_worker`), which keep their checkpoints and resume. `config` = {"trial": TrialConfig dict, "data":
    ObjectRef, "compile_cache": the sweep's compile cache (compile_cache.py)}."""
    import ray
    import ray.train
    import ray.train.torch

    trial = TrialConfig.from_dict(config["trial"])
    quiet_ray_train_logs()
    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    data = ray.get(config["data"])  # zero-copy from the node's object store
    device = ray.train.torch.get_device()
    setup_device(device)
    compile_cache.load_artifacts(config.get("compile_cache"))
    run = TrainingRun.build(trial, data, rank, ctx.get_world_size(), device, wrap=ray.train.torch.prepare_model)
    run.nodes = gather_strings(ray.get_runtime_context().get_node_id())
    del data

    def send(payload: dict, epoch: int | None) -> bool:
        ray.train.report(payload)  # every rank: it is a collective
        return True

    failure = train_epochs(run, 1, send, config.get("compile_cache"))[1]
    if failure is not None:  # no broker to hand it to: the fit() fails with it
        raise failure


def train_epochs(run: TrainingRun, start_epoch: int, send, cache: str | None, on_probed=None,
                 proven: int = 0) -> tuple[bool, TrialFailure | None]:
    """The loop every rank runs for a trial once its run is built and restored: the restored epoch's report again,
    the OOM probe step, then train · evaluate · reduce · `send(payload, epoch)` per epoch while `send` says go on
    (every rank gets the same answer). `send(payload, None)`: the re-sent report (no checkpoint with it).
    `proven`: TrainingRun.fit_in_memory's. Returns (whether an epoch trained at the run's micro-batch, the agreed
    failure that ended the trial: OOM past the downshifts, divergence; None when it did not fail).

    The restored checkpoint's report goes out first (every rank): it may have died with a killed driver, and a
    run that had finished must end with its real final result; trackers skip what they already hold.
    """
    trained = False
    if run.last_report and not send(run.last_report, None):
        return trained, None
    try:
        run.fit_in_memory(proven)
        if on_probed is not None:
            on_probed()
        if run.rank == 0 and run.net.compile_s > 0:
            compile_cache.save_artifacts(cache)
        epoch = start_epoch
        while epoch <= run.epochs:  # run.epochs: under a time budget, fixed by the end of warmup (resolve_epochs)
            payload = report_dict(run.epoch(epoch), run.worker_params())
            if run.net.eager_fallback:  # Dynamo refused a compile (a recompile limit): the driver warns and tags
                payload[EAGER_FALLBACK] = 1
            trained = True
            if not send(payload, epoch) or run.stops_at_target:
                break
            epoch += 1
    except TrialFailure as failure:  # every rank raised it at the same point: end cleanly, no retry
        return trained, failure
    return trained, None


def slot_worker(config: dict) -> None:
    """Every rank of a warm worker group (raysweep/slots.py): set up once, then run the trials the sweep's broker
    hands this slot, one after another, until the slot is retired. `config` = {"trial": the first trial's
    TrialConfig dict (the group's shape), "data": ObjectRef, "broker", "slot": its number, "compile_cache",
    "decision_wait_s", "store_wait_s": how long the broker may hold a report (slots.Broker.report) and a checkpoint
    (Broker.recorded_through)}.

    What a trial builds is its own (model, optimizer, schedule, restore from its folder's checkpoint); the
    processes, the process group, the device, the data on it and the compile caches stay. Rank 0 talks to the
    broker; the others learn its answers by a broadcast, so every rank runs the same trial and stops at the same
    epoch.
    """
    import ray
    import ray.train
    import ray.train.torch

    group_started = time.time()
    quiet_ray_train_logs()
    ctx = ray.train.get_context()
    rank, world_size = ctx.get_world_rank(), ctx.get_world_size()
    broker, slot = config["broker"], config["slot"]
    device = ray.train.torch.get_device()
    setup_device(device)
    FAULTS.check_setup()
    compile_cache.load_artifacts(config.get("compile_cache"))
    data = ray.get(config["data"])  # zero-copy from the node's object store
    nodes = gather_strings(ray.get_runtime_context().get_node_id())
    if rank == 0:  # the group's placement group: a slot whose host is lost has it removed (Broker.group_placement)
        from ray.util import get_current_placement_group

        broker.group_placement.remote(slot, get_current_placement_group())
    decision_wait_s = config["decision_wait_s"]  # slots.DECISION_WAIT_S
    store_wait_s = config["store_wait_s"]  # mlflow.retry_s: how long the store may blink

    def ask(ref, wait_s: float = 0.0):
        return ray.get(ref, timeout=BROKER_ANSWER_S + wait_s)

    shards: dict[int, tuple[Shard, Shard]] = {}  # by number of classes: on the device once per group
    after, fresh = None, True
    proven = 0  # the largest micro-batch a trial has trained in this group: later ones that fit skip the OOM probe
    while True:
        # every call to the broker has a deadline: a broker that is gone raises at once (ActorDiedError), one that
        # no longer answers raises here, and either way this group ends instead of waiting forever
        assignment = broadcast_object(ask(broker.next_assignment.remote(slot, after)) if rank == 0 else None, device)
        if assignment is None:
            continue  # nothing to run yet: ask again
        if assignment.get("retire"):
            return
        after = assignment["seq"]
        picked = time.time()
        trial = TrialConfig.from_dict(assignment["trial"])
        classes = trial.image.num_classes
        if classes not in shards:
            shards[classes] = (Shard.build(data.train, rank, world_size, classes, device),
                               Shard.build(data.val, rank, world_size, classes, device))
        data_ready = time.time()
        run = TrainingRun.build(trial, None, rank, world_size, device, wrap=ray.train.torch.prepare_model,
                                shards=shards[classes])
        run.nodes = nodes
        run_dir = assignment["run_dir"]
        start_epoch = run.restore(load_latest(run_dir, device))
        stamps = {"model_ready": time.time()}
        if fresh and assignment.get("slot_opened_at") is not None:  # the group was built for this trial
            stamps.update(slot_asked=assignment["slot_opened_at"], group_started=group_started, data_ready=data_ready)
        else:  # a warm group: it only had to hear of the trial
            stamps.update(slot_asked=picked, group_started=picked, data_ready=picked)
        fresh = False
        seq, timeline = assignment["seq"], stamps

        def send(payload: dict, epoch: int | None, run=run, run_dir=run_dir, seq=seq) -> bool:
            nonlocal timeline
            due = epoch is not None and (epoch % run.trial.train.checkpoint_every == 0 or epoch >= run.epochs
                                         or run.stops_at_target)
            go = True
            if rank == 0:
                # a checkpoint only once the store holds every earlier epoch (Broker.recorded_through): usually
                # at once (MLflow wrote the last epoch while this one trained)
                if due and not ask(broker.recorded_through.remote(seq, epoch - 1, store_wait_s), store_wait_s):
                    go = False  # the trial was ended (or its driver stopped): no checkpoint past what the store holds
                else:
                    if due:
                        save_checkpoint(run_dir, epoch, run.state(epoch, payload))
                    go = ask(broker.report.remote(seq, payload, timeline if epoch is not None else None,
                                                  epoch is None), decision_wait_s)
                if epoch is not None:
                    timeline = None
            return agree(go, device)

        trained, failure = train_epochs(run, start_epoch, send, config.get("compile_cache"),
                                        on_probed=lambda: stamps.update(probed=time.time()), proven=proven)
        if trained:
            proven = max(proven, run.micro_batch)
        # the failure as data (its kind reaches Tune and MLflow as it is, failures.py); the exception itself goes:
        # its traceback holds train_epochs' frame, and with it the run
        outcome = failure.as_dict() if failure is not None else None
        del run, send, failure
        release_trial_memory(device)  # the next trial starts as on a fresh group (no cycle keeps this one's model)
        if rank == 0:
            ask(broker.finish.remote(seq, outcome))


# raysweep's own checkpoints of a trial on a warm group, in the trial's folder: checkpoint_<epoch>/state.pt, the
# newest KEPT_CHECKPOINTS kept


def save_checkpoint(run_dir: str, epoch: int, state: dict) -> str:
    """Rank 0: the trial's state after `epoch`, written whole (storage.write_bytes), then older ones dropped."""
    import io

    buffer = io.BytesIO()
    torch.save(state, buffer)
    location = storage.join(run_dir, f"checkpoint_{epoch:06d}", CHECKPOINT_FILE)
    storage.write_bytes(location, buffer.getvalue())
    kept = [n for n in storage.list_names(run_dir) if n.startswith("checkpoint_")]
    for name in kept[:-KEPT_CHECKPOINTS]:
        storage.delete_dir(storage.join(run_dir, name))
    return location


def load_latest(run_dir: str, device: torch.device) -> dict | None:
    """The newest readable checkpoint's state in a trial's folder (an unreadable newest one, torn by a kill,
    falls back to the one before it); None: none there, or none readable (the trial starts over)."""
    import io

    names = sorted((n for n in storage.list_names(run_dir) if n.startswith("checkpoint_")), reverse=True)
    for name in names:
        location = storage.join(run_dir, name, CHECKPOINT_FILE)
        try:
            data = storage.read_bytes(location)
            if data is None:
                raise FileNotFoundError(location)
            return torch.load(io.BytesIO(data), map_location=device, weights_only=True)
        except Exception as e:  # torn: EOFError, RuntimeError (zip), UnpicklingError, FileNotFoundError
            log.warning("checkpoint %s cannot be read (%s: %s); trying the one before it", location,
                        type(e).__name__, e)
    if names:
        log.warning("no readable checkpoint under %s: the trial starts over", run_dir)
    return None


def last_checkpoint_epoch(run_dir: str) -> int:
    """The epoch of a trial's newest checkpoint folder (0: none), from its name alone."""
    names = [n for n in storage.list_names(run_dir) if n.startswith("checkpoint_")]
    return max((int(n.removeprefix("checkpoint_")) for n in names if n.removeprefix("checkpoint_").isdigit()),
               default=0)


def quiet_ray_train_logs() -> None:
    """The per-report INFO line ignores LoggingConfig: its logger is named by file path (RAY_NOTES.md)."""
    try:
        import ray.train.v2._internal.execution.context as context

        logging.getLogger(context.__file__).setLevel(logging.WARNING)
    except ImportError:
        pass
