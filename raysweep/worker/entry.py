"""The Ray Train entry point of every rank: the only worker module that talks to Ray.

Ray is imported inside the functions: the rest of the worker runs (and is tested) in a plain process.

    slot_worker     every rank of a warm worker group: set up once, then the broker's trials one after another
    start_rank      a rank's set-up, once per group (device, compile caches, data, nodes)
    SlotRank        one rank of a slot's group across its trials: rank 0's calls to the broker, one trial's run
    train_epochs    the epoch loop every rank runs for a trial
    save_checkpoint, load_latest: a trial's own checkpoints, in its folder (named in layout.py)
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass

import torch

from raysweep import layout, storage
from raysweep.config import TrialConfig
from raysweep.failures import INFRA, Failure
from raysweep.metrics import EAGER_FALLBACK, report_dict
from raysweep.models import resolve_on_worker
from raysweep.protocol import Retire, Task
from raysweep.worker import compile_cache
from raysweep.worker.clock import ClockWriter
from raysweep.worker.device import release_trial_memory, setup_device
from raysweep.worker.faults import FAULTS, TrialFailure
from raysweep.worker.reduce import agree, broadcast_object, gather_strings
from raysweep.worker.run import TrainingRun
from raysweep.worker.shard import Shard, rank_shards

log = logging.getLogger(__name__)

# a rank 0's call to the broker waits at most this long beyond the wait the call itself may make (the broker's long
# polls, a rung's decision, the store: slot_worker's config says how long)
BROKER_ANSWER_S = 30.0


def slot_worker(config: dict) -> None:
    """Every rank of a warm worker group (raysweep/slots/): set up once, then run the trials the sweep's broker
    hands this slot, one after another, until the slot is retired. `config` = {"trial": the first trial's
    TrialConfig dict (the group's shape), "data": ObjectRef, "broker", "slot": its number, "compile_cache",
    "decision_wait_s", "store_wait_s": how long the broker may hold a report (slots.Broker.report) and a checkpoint
    (Broker.recorded_through)}.

    What a trial builds is its own (model, optimizer, schedule, restore from its folder's checkpoint); the
    processes, the process group, the device, the data on it and the compile caches stay. Rank 0 talks to the
    broker; the others learn its answers by a broadcast, so every rank runs the same trial and stops at the same
    epoch.
    """
    group_started = time.time()
    me = SlotRank(config, start_rank(config), group_started)
    me.tell_placement()
    after = None  # the last assignment this group took (None: it just started)
    while True:
        assignment = me.next_assignment(after)
        if assignment is None:
            continue  # nothing to run yet: ask again
        if isinstance(assignment, Retire):
            return
        fresh, after = after is None, assignment.seq
        me.run_trial(assignment, fresh)


@dataclass(frozen=True)
class Rank:
    """What a rank of a worker group sets up once, whatever it then runs."""

    rank: int
    world_size: int
    device: torch.device
    data: object  # data.CaptchaData, zero-copy from the node's object store
    nodes: str  # every rank's node id, by rank, comma-separated (the trial's `nodes` param)


def start_rank(config: dict) -> Rank:
    """A rank's set-up, once per group: Ray Train's logs, the device, the compile caches, the data, the nodes.
    `config`: the trainer's train_loop_config ("data": ObjectRef, "compile_cache": compile_cache.py's)."""
    import ray
    import ray.train
    import ray.train.torch

    quiet_ray_train_logs()
    ctx = ray.train.get_context()
    # the model's code (shipped with the sweep) imports here, or the set-up fails naming the module and the node
    trial = TrialConfig.from_dict(config["trial"])
    resolve_on_worker(trial.model, ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id())
    device = ray.train.torch.get_device()
    setup_device(device, share=1 / trial.scaling.workers_per_gpu)
    FAULTS.check_setup()
    compile_cache.load_artifacts(config.get("compile_cache"))
    data = ray.get(config["data"])  # zero-copy from the node's object store
    nodes = gather_strings(ray.get_runtime_context().get_node_id())
    return Rank(ctx.get_world_rank(), ctx.get_world_size(), device, data, nodes)


class SlotRank:
    """One rank of a slot's warm group across its trials: what stays (its Rank, the data's shards on the device,
    the largest micro-batch a trial has trained here), rank 0's calls to the broker, and one trial's run."""

    def __init__(self, config: dict, me: Rank, group_started: float):
        """`config`: slot_worker's; `me`: this rank's set-up (start_rank); `group_started`: when it began."""
        self.broker, self.slot = config["broker"], config["slot"]
        self.decision_wait_s = config["decision_wait_s"]  # slots.broker.DECISION_WAIT_S
        self.store_wait_s = config["store_wait_s"]  # mlflow.retry_s: how long the store may blink
        self.cache = config.get("compile_cache")
        self.me, self.group_started = me, group_started
        self.group = uuid.uuid4().hex  # this group's token: the broker counts a restart once per group
        self.shards: dict[int, tuple[Shard, Shard]] = {}  # by number of classes: on the device once per group
        # the largest micro-batch a trial has trained in this group: later ones that fit skip the OOM probe
        self.proven = 0

    def tell_placement(self) -> None:
        """Rank 0: tell the broker the group's placement group (a slot whose host is lost has it removed,
        Broker.group_placement)."""
        if self.me.rank == 0:
            from ray.util import get_current_placement_group

            self.broker.group_placement.remote(self.slot, get_current_placement_group())

    def ask(self, call, wait_s: float = 0.0, again: bool = False):
        """Rank 0: the answer of `call()`, a call to the broker. Every call has a deadline: a broker that is gone
        raises at once (ActorDiedError); one that has not answered in BROKER_ANSWER_S + `wait_s` is asked again
        where the call may be repeated (`again`: an ask for work, a finish, a wait for the store), until
        slots.broker.BROKER_STALL_S, and raises then; either way this group ends instead of waiting forever. One
        slow answer crashed the group before, and counted a restart against the trial's train.max_failures."""
        import ray
        from ray.exceptions import GetTimeoutError

        from raysweep.slots.broker import BROKER_STALL_S

        deadline = time.monotonic() + BROKER_STALL_S
        while True:
            try:
                return ray.get(call(), timeout=BROKER_ANSWER_S + wait_s)
            except GetTimeoutError:
                if not again or time.monotonic() > deadline:
                    raise
                log.warning("slot %d: the sweep's broker has not answered in %.0f s; asking again (for up to %.0f s)",
                            self.slot, BROKER_ANSWER_S + wait_s, BROKER_STALL_S)

    def next_assignment(self, after: int | None) -> Task | Retire | None:
        """Every rank: what the group runs next (slots.Broker.next_assignment), as rank 0 heard it."""
        answer = (self.ask(lambda: self.broker.next_assignment.remote(self.slot, after, self.group), again=True)
                  if self.me.rank == 0 else None)
        return broadcast_object(answer, self.me.device)

    def run_trial(self, assignment: Task, fresh: bool) -> None:
        """Every rank: one assignment, start to end; then what it built goes and rank 0 tells the broker how it
        ended. `fresh`: the group's first trial (its start-up includes the group's)."""
        outcome = self._train(assignment, fresh)
        # the next trial starts as on a fresh group (no cycle keeps this one's model)
        release_trial_memory(self.me.device)
        if self.me.rank == 0:
            self.ask(lambda: self.broker.finish.remote(assignment.seq, outcome), again=True)

    def _train(self, assignment: Task, fresh: bool):
        """Build the trial, restore it from its folder's checkpoint, train it; returns how it failed (None: it did
        not). What it built is this call's alone: it goes when the call returns (tests/test_slot_memory.py)."""
        import ray.train.torch

        picked = time.time()
        trial = TrialConfig.from_dict(assignment.trial)
        shards = self._shards(trial.image.num_classes)
        data_ready = time.time()
        run = TrainingRun.build(trial, None, self.me.rank, self.me.world_size, self.me.device,
                                wrap=ray.train.torch.prepare_model, shards=shards)
        run.nodes = self.me.nodes
        run_dir = assignment.run_dir
        start_epoch = run.restore(load_latest(run_dir, self.me.device), layout.read_clock(run_dir))
        stamps = {"model_ready": time.time()}
        if fresh and assignment.slot_opened_at is not None:  # the group was built for this trial
            stamps.update(slot_asked=assignment.slot_opened_at, group_started=self.group_started,
                          data_ready=data_ready)
        else:  # a warm group: it only had to hear of the trial
            stamps.update(slot_asked=picked, group_started=picked, data_ready=picked)
        clock = ClockWriter(run_dir) if self.me.rank == 0 else None
        send = self._sender(run, run_dir, assignment.seq, stamps, clock)
        try:
            trained, failure = train_epochs(run, start_epoch, send, self.cache,
                                            on_probed=lambda: stamps.update(probed=time.time()), proven=self.proven)
        finally:
            if clock is not None:
                clock.close()
        if trained:
            self.proven = max(self.proven, run.micro_batch)
        # the failure as its record (failures.Failure: its kind reaches Tune and MLflow as it is); the exception goes
        # now: its traceback holds train_epochs' frame, which holds the run and links back to this frame (f_back):
        # kept to the end of this call, that is a reference cycle, and the run would wait for the cyclic collector
        outcome = failure.failure if failure is not None else None
        del failure
        if outcome is None and clock is not None and clock.failure is not None:  # the send that saw it stopped all
            outcome = Failure(INFRA, f"the trial's clock could not be written under {run_dir}: {clock.failure}")
        return outcome

    def _shards(self, classes: int) -> tuple[Shard, Shard]:
        """The data on the device for trials with `classes` classes: built by the first such trial, kept."""
        if classes not in self.shards:
            me = self.me
            self.shards[classes] = rank_shards(me.data, classes, me.device, me.rank, me.world_size)
        return self.shards[classes]

    def _sender(self, run: TrainingRun, run_dir: str, seq: int, timeline: dict | None,
                clock: ClockWriter | None = None):
        """train_epochs' `send` for one assignment: rank 0 checkpoints where due, has the clock written where not
        (`clock`, rank 0's) and reports to the broker (the start-up `timeline` with the first trained epoch); every
        rank gets its answer, whether to go on. A clock the store refused stops the trial here (`_train` ends it
        as `infra`)."""
        def send(payload: dict, epoch: int | None) -> bool:
            nonlocal timeline
            due = epoch is not None and (epoch % run.trial.train.checkpoint_every == 0 or epoch >= run.epochs
                                         or run.stops_at_target)
            go = True
            if self.me.rank == 0:
                # a checkpoint only once the store holds every earlier epoch (Broker.recorded_through): usually
                # at once (MLflow wrote the last epoch while this one trained)
                if clock is not None and clock.failure is not None:
                    go = False  # the store refused an earlier epoch's clock: a restart would forget its seconds
                elif due and not self.ask(lambda: self.broker.recorded_through.remote(seq, epoch - 1,
                                                                                      self.store_wait_s),
                                          self.store_wait_s, again=True):
                    go = False  # the trial was ended (or its driver stopped): no checkpoint past what the store holds
                else:
                    if due:
                        save_checkpoint(run_dir, epoch, run.state(epoch, payload))
                    elif epoch is not None and clock is not None:  # a restart trains it again: its seconds stay
                        clock.write(epoch, run.train_seconds)
                    go = self.ask(lambda: self.broker.report.remote(  # not repeated: a report is appended
                        seq, payload, timeline if epoch is not None else None, epoch is None), self.decision_wait_s)
                if epoch is not None:
                    timeline = None
            return agree(go, self.me.device)

        return send


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
    if run.last_report and run.stops_at_target:  # it had ended at its target: the re-sent report was its last
        return trained, None
    try:
        run.fit_in_memory(proven)
        if on_probed is not None:
            on_probed()
        if run.rank == 0 and run.net.compile_s > 0:
            compile_cache.save_artifacts(cache)
        if start_epoch == 1:
            run.watch_start()
        epoch = start_epoch
        while epoch <= run.epochs:  # run.epochs: under a time budget, fixed by the end of warmup (resolve_epochs)
            payload = report_dict(run.epoch(epoch), run.worker_params())
            if run.net.eager_fallback:  # a compiled path ran eager (its reason's number): the driver warns and tags
                payload[EAGER_FALLBACK] = run.net.eager_fallback
            trained = True
            if not send(payload, epoch) or run.stops_at_target:
                break
            epoch += 1
    except TrialFailure as failure:  # every rank raised it at the same point: end cleanly, no retry
        return trained, failure
    return trained, None

# raysweep's own checkpoints of a trial on a warm group, in the trial's folder (layout.py names them): the newest
# layout.KEPT_CHECKPOINTS kept


def save_checkpoint(run_dir: str, epoch: int, state: dict) -> str:
    """Rank 0: the trial's state after `epoch`, written whole (storage.write_bytes), then older ones dropped."""
    import io

    buffer = io.BytesIO()
    torch.save(state, buffer)
    location = storage.join(run_dir, layout.checkpoint_name(epoch), layout.CHECKPOINT_FILE)
    storage.write_bytes(location, buffer.getvalue())
    for name in layout.checkpoint_names(run_dir)[:-layout.KEPT_CHECKPOINTS]:
        storage.delete_dir(storage.join(run_dir, name))
    return location


def load_latest(run_dir: str, device: torch.device) -> dict | None:
    """The newest readable checkpoint's state in a trial's folder (an unreadable newest one, torn by a kill,
    falls back to the one before it); None: none there, or none readable (the trial starts over)."""
    import io

    names = layout.checkpoint_names(run_dir)[::-1]
    for name in names:
        location = storage.join(run_dir, name, layout.CHECKPOINT_FILE)
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


def quiet_ray_train_logs() -> None:
    """The per-report INFO line ignores LoggingConfig: its logger is named by file path
    (ray/train/v2/_internal/execution/context.py: `logging.getLogger(__file__)`)."""
    try:
        import ray.train.v2._internal.execution.context as context

        logging.getLogger(context.__file__).setLevel(logging.WARNING)
    except ImportError:
        pass
