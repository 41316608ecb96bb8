"""What the sweep's driver calls: open the broker, ask whether it is lost, tell it what the store holds, close it
(and wait until every actor its slots started is gone)."""

from __future__ import annotations

import logging
import time

from raysweep.slots.actors import BrokerActor, SlotHost, SlotPlan, actor_classes
from raysweep.slots.broker import CLOSE_WAIT_S

log = logging.getLogger(__name__)

GONE_WAIT_S = 20.0  # after the slots were retired (or killed), how long their actors may take to be gone
ORPHAN_SETTLE_S = 5.0  # then how long to keep removing the groups they left, while each look finds one
# the actors a sweep's slots start, by class name: the broker, the slot hosts, Ray Train's controllers and workers
SLOT_ACTORS = frozenset({BrokerActor.__name__, SlotHost.__name__, "TrainController", "RayTrainWorker"})
WATCH_EVERY_S = 1.0  # broker_lost looks at the broker's `watch` call at most this often

_BEFORE: dict[str, set[str] | None] = {}  # the slot actors alive when each sweep opened (close_broker)
_ACTIVE: dict[str, object] = {}  # this driver's brokers, by the sweep's folder (a driver runs one sweep at a time)
_WATCH: dict[str, list] = {}  # each broker's `watch` call [ref, last checked], by the sweep's folder


def open_broker(experiment_path: str, capacity: int, plan: SlotPlan, broker_class=None):
    """The sweep's broker, an async actor on the driver's node, for at most `capacity` slots at once;
    `close_broker` ends it and every slot. `broker_class`: the broker's Ray actor class, taking (capacity, plan)
    (None: actors.BrokerActor's; benchmarks/driver_scale.py passes one whose slots are simulated)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    broker_class = broker_class or actor_classes()[0]
    _BEFORE[experiment_path] = _slot_actor_ids()  # what close_broker waits to see gone is what starts after this
    # the broker names the user's code (plan.code) for the whole sweep: Ray keeps the uploaded package while it lives
    broker = broker_class.options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(plan.node_id, soft=False),
        runtime_env=plan.code or None).remote(capacity, plan)
    _ACTIVE[experiment_path] = broker
    _WATCH[experiment_path] = [broker.watch.remote(), 0.0]
    return broker


def broker_lost(experiment_path: str, wait_s: float | None = None) -> str | None:
    """Why the sweep's broker is gone (its actor died: the OOM killer, its node), else None. Checked at most every
    WATCH_EVERY_S, without waiting (the broker's `watch` call fails as soon as the actor dies); with `wait_s`, now:
    a broker that answers is alive (at once: the watch alone waited all of `wait_s` for a live one), and one that
    fails or does not answer within `wait_s` is given up to `wait_s` more for its watch to say why."""
    import ray

    watch = _WATCH.get(experiment_path)
    if watch is None or (wait_s is None and time.monotonic() - watch[1] < WATCH_EVERY_S):
        return None
    watch[1] = time.monotonic()
    if wait_s:
        asked = _ACTIVE[experiment_path].state.remote()
        if ray.wait([asked, watch[0]], num_returns=1, timeout=wait_s)[0] == [asked]:
            try:
                ray.get(asked)
                return None  # it answered
            except Exception as e:  # it died after all: its watch says why
                log.debug("the broker did not answer: %s", e)
    ready, _ = ray.wait([watch[0]], timeout=wait_s or 0)
    if not ready:
        return None
    try:
        ray.get(ready[0])
    except Exception as e:
        from raysweep.metrics import error_line

        return f"{type(e).__name__}: {error_line(str(e))}"
    return None  # it closed


def active(experiment_path: str):
    """The broker of the sweep this driver runs at `experiment_path` (None: none, or it closed)."""
    return _ACTIVE.get(experiment_path)


def recorded(experiment_path: str, trial_id: str, epoch: int) -> None:
    """Tell the sweep's broker the store holds `trial_id` through `epoch` (the MLflow callback's `on_recorded`,
    a partial of this: it pickles with the experiment, and a resumed sweep's finds the new broker)."""
    broker = active(experiment_path)
    if broker is not None:
        broker.recorded.remote(trial_id, epoch)


def close_broker(experiment_path: str) -> None:
    """Retire the slots (their groups leave between trials), then end the broker and whatever is left of them."""
    import ray

    broker = _ACTIVE.pop(experiment_path, None)
    _WATCH.pop(experiment_path, None)
    if broker is None:
        return
    try:
        left = ray.get(broker.close.remote(), timeout=CLOSE_WAIT_S + 10)
        if left:
            log.warning("%d worker group(s) did not leave in %.0f s; ending them", left, CLOSE_WAIT_S)
    except Exception as e:  # the broker already gone (Ray shutting down): nothing to retire
        log.debug("closing the slots: %s", e)
    ray.kill(broker)  # the slot hosts it owns, their controllers and workers go with it
    _wait_gone(_BEFORE.pop(experiment_path, None), GONE_WAIT_S)
    _remove_left_groups(ORPHAN_SETTLE_S)


def _remove_left_groups(wait_s: float) -> None:
    """Remove the placement groups the sweep's dead slot actors left (cluster.remove_orphaned_groups), looking
    again until a look finds none, within `wait_s`. A controller killed with its slot can have asked for a group
    just before it died, and the GCS places that group after the broker's own last look: with no slot left to look
    again, it held the group's CPUs for as long as the driver's job lived (a test session, a notebook). CI saw it
    once: 2 CPUs held after a sweep whose every group set-up failed."""
    from raysweep.cluster import remove_orphaned_groups

    started = time.monotonic()
    while True:
        try:
            removed = remove_orphaned_groups()
        except Exception as e:  # noqa: BLE001 - Ray shutting down: nothing more to do
            log.debug("removing left placement groups: %s", e)
            return
        waited = time.monotonic() - started
        # a clean look a second after the actors were gone ends it; a look that removed one looks again
        if (not removed and waited >= 1.0) or waited > wait_s:
            return
        time.sleep(0.5)


def _slot_actor_ids() -> set[str] | None:
    """Ids of this driver's live actors of the kinds a sweep's slots start (None: no state API to ask)."""
    import ray
    from ray.util.state import list_actors

    job = ray.get_runtime_context().get_job_id()
    try:
        # this cluster's address: without one the State API looks for every Ray instance on the machine
        # (get_address_for_submission_client in ray/dashboard/utils.py) and refuses when it finds two
        return {a.actor_id for a in list_actors(address=ray.get_runtime_context().gcs_address,
                                                filters=[("job_id", "=", job), ("state", "=", "ALIVE")],
                                                limit=10_000, raise_on_missing_output=False)
                if a.class_name.rsplit(".", 1)[-1] in SLOT_ACTORS}  # a qualified name's last part
    except Exception as e:  # no dashboard: nothing to wait on
        log.debug("listing actors: %s", e)
        return None


def _wait_gone(before: set[str] | None, wait_s: float) -> None:
    """Wait until none of the slot actors started since `before` (open_broker's snapshot) is alive. Ray ends a
    killed or unreferenced actor asynchronously, so without this a sweep's controller could outlive `tune` by a
    moment (and a next sweep in the same process find its resources still held)."""
    if before is None:
        return
    deadline = time.monotonic() + wait_s
    while True:
        alive = _slot_actor_ids()
        left = (alive or set()) - before
        if not left or time.monotonic() > deadline:
            if left:
                log.warning("%d slot actor(s) still alive %.0f s after the sweep closed its slots", len(left), wait_s)
            return
        time.sleep(0.2)
