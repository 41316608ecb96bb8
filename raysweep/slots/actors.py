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
from dataclasses import dataclass, field

from raysweep import layout
from raysweep.failures import ERROR, INFRA, OOM, died, find_cause
from raysweep.slots.broker import DECISION_WAIT_S, Broker, Slot
from raysweep.slots.resources import group_resources, wait_for_resources

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SlotPlan:
    """What every slot's trainer is built from (trainer.make_trainer)."""

    data_ref: object  # ObjectRef of data.CaptchaData
    storage_path: str  # the slots' Ray Train runs live at <storage_path>/slot-<n> (no checkpoints: trials keep theirs)
    env: dict  # worker environment (trainer.worker_env)
    compile_cache: str | None
    node_id: str  # the trial drivers' node (cluster.trial_driver_node): the broker, slot hosts and their controllers
    store_wait_s: float = 300.0  # mlflow.retry_s: how long a slot waits for the store before a checkpoint
    keep_warm_s: float | None = None  # tune.keep_warm_s: an idle slot with nothing queued leaves after this long
    code: dict = field(default_factory=dict)  # the user's model code: usercode.ship's runtime_env ({} for none)


@functools.cache
def actor_classes():
    """(BrokerActor, SlotHost) as Ray actor classes, made once per process on first use."""
    import ray

    return (ray.remote(num_cpus=0, max_restarts=0)(BrokerActor),
            ray.remote(num_cpus=0, max_restarts=0)(SlotHost))


class SlotHost:
    """Runs one slot's long-lived trainer: fit() returns when the slot is retired."""

    def run(self, plan: SlotPlan, slot_id: int, trial: dict, broker) -> None:
        from raysweep.config import TrialConfig
        from raysweep.trainer import make_trainer
        from raysweep.worker.entry import slot_worker

        make_trainer(TrialConfig.from_dict(trial), plan.data_ref, plan.storage_path, layout.slot_name(slot_id),
                     [_error_forwarder(broker, slot_id)], env=plan.env, worker_fn=slot_worker,
                     extra_config={"broker": broker, "slot": slot_id, "decision_wait_s": DECISION_WAIT_S,
                                   "store_wait_s": plan.store_wait_s},
                     compile_cache=plan.compile_cache, code=plan.code,
                     # restarts are counted by the broker: per trial, and set-ups that fail in a row per slot
                     max_failures=-1).fit()


class BrokerActor(Broker):
    """The sweep's broker on Ray: a slot is a SlotHost on the trial drivers' node, and what its groups left placed
    is removed when it ends."""

    def __init__(self, capacity: int, plan: SlotPlan):
        super().__init__(capacity, self._launch, plan.keep_warm_s)
        self.plan = plan

    async def _launch(self, slot_id: int, trial: dict) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        me = ray.get_runtime_context().current_actor
        await wait_for_resources(group_resources(trial["scaling"]), f"slot {slot_id}", self._remove_orphans)
        host = actor_classes()[1].options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(self.plan.node_id, soft=False),
            runtime_env=self.plan.code or None).remote()
        try:
            await host.run.remote(self.plan, slot_id, trial, me)
        finally:
            ray.kill(host)

    async def _release(self, slot: Slot) -> None:
        """Remove what the slot's groups left placed: the placement group its rank 0 reported, and every group of
        this job whose placing actor is dead (`_remove_orphans`). A controller that dies with its host (SIGKILL,
        the OOM killer) leaves its group holding the group's CPUs and GPUs: Ray frees an actor's group only once
        its job ends too (raysweep's trainers start no Train V2 PlacementGroupCleaner: trainer._trainer_class; it
        removed only the group its controller last registered, so a host killed while its controller restarted
        the group left one for good even with it). A group is
        this slot's, or no one's, by who placed it, never by when: a live controller's group (another slot's,
        still setting up; another sweep's) is never touched. A group that retired removed its own: nothing is
        left then."""
        import ray
        from ray.util.placement_group import remove_placement_group

        if slot.placement is not None:
            try:
                await asyncio.to_thread(remove_placement_group, slot.placement)
            except Exception as e:  # already removed
                log.debug("slot %d: placement group %s: %s", slot.slot_id, slot.placement.id.hex(), e)
        if ray.is_initialized():
            await self._remove_orphans()

    async def _remove_orphans(self) -> None:
        """Remove this job's placement groups whose placing actor is dead (cluster.remove_orphaned_groups), off the
        broker's event loop (a GCS call: the loop keeps answering its slots and trials). Called when a slot ends
        and while a new slot waits for resources: Ray kills the actors an actor owns asynchronously, so a slot's
        controller can place a group after its host was killed and after the slot's own `_release` ran; it is
        dead, and its group removed, by the next look."""
        from raysweep.cluster import remove_orphaned_groups

        await asyncio.to_thread(remove_orphaned_groups)


def group_failure_kind(errors: list[BaseException]) -> str:
    """The kind of a worker group's failure from what its ranks raised (failures.py tells the two apart): `oom`
    where torch ran out of memory on a rank; `infra` where a rank's process died without raising (its peers' errors,
    a collective's lost connection, are the symptom); else `error`, raised by the trial's code."""
    import torch

    if any(find_cause(e, torch.OutOfMemoryError) for e in errors):
        return OOM
    if any(died(e) for e in errors):
        return INFRA
    return ERROR


def _error_forwarder(broker, slot_id: int):
    """A Ray Train callback (it runs in the slot's controller) that hands the broker what the workers raised
    before the group restarts: the trial that uses up its restarts fails with it."""
    import ray.train

    class ErrorForwarder(ray.train.UserCallback):
        def after_exception(self, run_context, worker_exceptions):
            text = "\n".join(f"rank {rank}: {e}" for rank, e in sorted(worker_exceptions.items()))
            broker.group_error.remote(slot_id, text, group_failure_kind(list(worker_exceptions.values())))

    return ErrorForwarder()
