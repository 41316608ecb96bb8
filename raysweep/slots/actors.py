"""The sweep's Ray actors: the broker (broker.Broker as an async actor) and one slot host per slot, which runs the
slot's long-lived trainer; and the Ray Train callback that hands the broker what a group's workers raised.

The classes live at module level and become Ray actor classes on first use (`actor_classes`): importing this
module imports no Ray. Ray names their actors and processes by class name (`ray::SlotHost.run`), which
lifecycle.SLOT_ACTORS, tests/test_faults.py and benchmarks/soak.py look for.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from dataclasses import dataclass

from raysweep.failures import ERROR, OOM, find_cause
from raysweep.slots.broker import DECISION_WAIT_S, Broker, Slot
from raysweep.slots.resources import group_resources, wait_for_resources

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SlotPlan:
    """What every slot's trainer is built from (cluster.make_trainer)."""

    data_ref: object  # ObjectRef of data.CaptchaData
    storage_path: str  # the slots' Ray Train runs live at <storage_path>/slot-<n> (no checkpoints: trials keep theirs)
    env: dict  # worker environment (cluster.worker_env)
    compile_cache: str | None
    node_id: str  # the trial drivers' node (cluster.trial_driver_node): the broker, slot hosts and their controllers
    store_wait_s: float = 300.0  # mlflow.retry_s: how long a slot waits for the store before a checkpoint
    keep_warm_s: float | None = None  # tune.keep_warm_s: an idle slot with nothing queued leaves after this long


@functools.cache
def actor_classes():
    """(BrokerActor, SlotHost) as Ray actor classes, made once per process on first use."""
    import ray

    return (ray.remote(num_cpus=0, max_restarts=0)(BrokerActor),
            ray.remote(num_cpus=0, max_restarts=0)(SlotHost))


class SlotHost:
    """Runs one slot's long-lived trainer: fit() returns when the slot is retired."""

    def run(self, plan: SlotPlan, slot_id: int, trial: dict, broker) -> None:
        from raysweep.cluster import make_trainer
        from raysweep.config import TrialConfig
        from raysweep.worker.entry import slot_worker

        make_trainer(TrialConfig.from_dict(trial), plan.data_ref, plan.storage_path, f"slot-{slot_id}",
                     [_error_forwarder(broker, slot_id)], env=plan.env, worker_fn=slot_worker,
                     extra_config={"broker": broker, "slot": slot_id, "decision_wait_s": DECISION_WAIT_S,
                                   "store_wait_s": plan.store_wait_s},
                     compile_cache=plan.compile_cache,
                     # restarts are counted by the broker: per trial, and set-ups that fail in a row per slot
                     max_failures=-1).fit()


class BrokerActor(Broker):
    """The sweep's broker on Ray: a slot is a SlotHost on the trial drivers' node, and what its groups left placed
    is removed when it ends."""

    def __init__(self, capacity: int, plan: SlotPlan):
        super().__init__(capacity, self._launch, plan.keep_warm_s)
        self.plan = plan
        self.placed_before: dict[int, set[str]] = {}  # slot id → placement groups there before its launch

    async def _launch(self, slot_id: int, trial: dict) -> None:
        import ray
        from ray.util.placement_group import placement_group_table
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        me = ray.get_runtime_context().current_actor
        await wait_for_resources(group_resources(trial["scaling"]), f"slot {slot_id}", self._remove_orphans)
        self.placed_before[slot_id] = set(placement_group_table())  # what this slot's groups did not place
        host = actor_classes()[1].options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(self.plan.node_id, soft=False)).remote()
        try:
            await host.run.remote(self.plan, slot_id, trial, me)
        finally:
            ray.kill(host)

    async def _release(self, slot: Slot) -> None:
        """Remove what the slot's groups left placed. A controller that dies with its host (SIGKILL, the OOM
        killer) leaves its group's placement group holding the group's CPUs and GPUs; Train V2's
        PlacementGroupCleaner removes only the one its controller last registered, and a host killed while
        the controller restarted the group (a new placement group, not yet registered, not yet reported by
        the new group's rank 0) left one holding both CPUs here for good: the soak's next slot waited for
        resources forever. So: the one rank 0 reported, and every placement group of this job created since
        the slot launched that no other slot of this broker reported and whose bundles are a worker group's
        (CPUs, no trial_driver: never a Tune trial's, whose removal kills the trial's actor). A group that
        retired removed its own: nothing is left then."""
        import ray
        from ray.util.placement_group import PlacementGroup, remove_placement_group

        ours = {slot.placement.id.hex()} if slot.placement is not None else set()
        others = {s.placement.id.hex() for s in self.slots.values() if s is not slot and s.placement is not None}
        try:
            ours |= _worker_groups_placed_since(self.placed_before.get(slot.slot_id, set())) - others
        except Exception as e:  # no State API: the reported one alone
            log.debug("slot %d: listing placement groups: %s", slot.slot_id, e)
        for pg_id in ours:
            try:
                remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id))))
            except Exception as e:  # already removed
                log.debug("slot %d: placement group %s: %s", slot.slot_id, pg_id, e)


    async def _remove_orphans(self) -> None:
        """While a new slot waits for resources: remove the worker-shaped placement groups (created, or pending)
        that no live slot can own. A slot's host killed while its controller restarted the group lets that
        controller, killed with the host a moment later (Ray kills the actors an actor owns asynchronously), place
        a new group after the slot's own `_release` ran: the soak's next slot then waited for CPUs forever. A
        placement group is an orphan when no live slot reported it and it existed before every live slot
        launched (a live slot's own groups are placed after its launch)."""
        import ray
        from ray.util.placement_group import PlacementGroup, remove_placement_group

        live = [s for s in self.slots.values() if s.slot_id in self.placed_before]
        reported = {s.placement.id.hex() for s in self.slots.values() if s.placement is not None}
        try:  # the State API's answer in a thread: the broker's loop keeps answering its slots and trials
            found = await asyncio.to_thread(_worker_groups_placed_since, set(), ("CREATED", "PENDING"))
        except Exception as e:  # no State API: nothing known to be an orphan
            log.debug("listing placement groups: %s", e)
            return
        for pg_id in found - reported:
            if all(pg_id in self.placed_before[s.slot_id] for s in live):
                log.warning("removing placement group %s: left by a slot that ended", pg_id)
                try:
                    remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id))))
                except Exception as e:  # already removed
                    log.debug("placement group %s: %s", pg_id, e)


def _worker_groups_placed_since(before: set[str], states: tuple[str, ...] = ("CREATED",)) -> set[str]:
    """Ids of this job's placement groups in `states` not in `before` whose bundles are all a worker group's (CPUs,
    no trial_driver). Raises where the State API cannot be asked."""
    import ray
    from ray.util.placement_group import placement_group_table
    from ray.util.state import list_placement_groups

    from raysweep.cluster import TRIAL_DRIVER

    job = ray.get_runtime_context().get_job_id()
    table = placement_group_table()  # {id: {"bundles": {index: {resource: amount}}, ...}}
    found = set()
    for pg in list_placement_groups(limit=10_000, raise_on_missing_output=False):
        if pg.state not in states:
            continue
        pg_id = pg.placement_group_id
        bundles = list(table.get(pg_id, {}).get("bundles", {}).values())
        workers = bool(bundles) and all("CPU" in b and TRIAL_DRIVER not in b for b in bundles)
        if pg.creator_job_id == job and pg_id not in before and workers:
            found.add(pg_id)
    return found


def _error_forwarder(broker, slot_id: int):
    """A Ray Train callback (it runs in the slot's controller) that hands the broker what the workers raised
    before the group restarts: the trial that uses up its restarts fails with it."""
    import ray.train
    import torch

    class ErrorForwarder(ray.train.UserCallback):
        def after_exception(self, run_context, worker_exceptions):
            text = "\n".join(f"rank {rank}: {e}" for rank, e in sorted(worker_exceptions.items()))
            oom = any(find_cause(e, torch.OutOfMemoryError) for e in worker_exceptions.values())
            broker.group_error.remote(slot_id, text, OOM if oom else ERROR)

    return ErrorForwarder()
