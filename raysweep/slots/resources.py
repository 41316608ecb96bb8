"""A worker group's resources: what one of a shape holds, and waiting until the cluster has them free."""

from __future__ import annotations

import asyncio
import logging
import time

log = logging.getLogger(__name__)

RESOURCE_POLL_S = 1.0  # how often the wait looks at what is free
RESOURCE_SAY_EVERY_S = 30.0  # how often it says what it waits for
SHORT_HOOK_EVERY_S = 10.0  # how long a wait goes before `while_short` is called, and how often after


def group_resources(scaling: dict) -> dict[str, float]:
    """What a worker group of this shape (a TrialConfig dict's scaling) holds in its placement group."""
    from raysweep.config.sections import ScalingConfig

    shape = ScalingConfig.model_validate(scaling)
    need = {"CPU": shape.num_workers * shape.cpus_per_worker}
    if shape.use_gpu:
        need["GPU"] = shape.gpus  # 1/k a worker where k share a GPU
    return need


async def wait_for_resources(need: dict[str, float], who: str, while_short=None) -> None:
    """Wait until the cluster has `need` free before asking Ray Train for a group: another sweep (or job) may hold
    them, and a worker group that waits for resources past RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S fails as if it
    could not start. Says once every RESOURCE_SAY_EVERY_S what it waits for. Unbounded by design: what frees them
    is the other job, and the plan (cluster.plan_concurrency) checked that the cluster can hold the group at all.
    `await while_short()` runs once the wait has lasted SHORT_HOOK_EVERY_S, and again every SHORT_HOOK_EVERY_S (the
    broker removes what dead slots left: a slow State API call, never at every look)."""
    import ray

    said, started = None, time.monotonic()
    hooked = started
    while True:
        free = ray.available_resources()
        short = {k: v for k, v in need.items() if free.get(k, 0.0) < v}
        if not short:
            return
        now = time.monotonic()
        if while_short is not None and now - hooked >= SHORT_HOOK_EVERY_S:
            await while_short()
            hooked = now
        if said is None or now - said >= RESOURCE_SAY_EVERY_S:
            log.warning("%s waits for %s free on the cluster (other jobs hold them)", who,
                        ", ".join(f"{v:g} {k}" for k, v in short.items()))
            said = now
        await asyncio.sleep(RESOURCE_POLL_S)
