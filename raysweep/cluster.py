"""The Ray runtime that `tune`, `train` and `probe` share: connect, plan (the trainer they build: trainer.py).

Trial drivers hold a custom `trial_driver` resource (no CPU); each trial's workers hold
`num_workers × resources_per_worker` in their own placement group. Concurrency is planned here so
that every concurrent trial's workers fit at once: Ray Train queues no worker group the cluster cannot hold, its
placement group waits for the resources until the group's start times out (`WorkerGroup._start_impl`,
ray/train/v2/_internal/execution/worker_group/worker_group.py).
"""

from __future__ import annotations

import logging
import math
import os
import re
import sys
from dataclasses import dataclass

from raysweep.config import SweepConfig
from raysweep.errors import RayNotStarted, UserError

log = logging.getLogger(__name__)

TRIAL_DRIVER = "trial_driver"  # custom resource a trial's driver holds, so drivers never take workers' CPUs
LOCAL_TRIAL_DRIVERS = 64


FORWARDED_ENV = ("NCCL_", "TORCH_NCCL_")  # the driver's settings of these go to every worker (ray_env)


def ray_env(worker_start_timeout_s: float) -> dict[str, str]:
    """Environment for every Ray process of the job (workers inherit the raylet's, not the driver's: on a cluster
    `ray start` set it). The driver's NCCL_* and TORCH_NCCL_* go too, so that `NCCL_DEBUG=INFO python -m raysweep …`
    reaches the ranks that run NCCL (docs/troubleshooting.md, NCCL)."""
    return {
        **{k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV)},
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


def pin_ray_address() -> None:
    """`worker_process_setup_hook` of the job: every Ray process of it knows its own cluster's address.

    Ray's libraries ask the State API with no address from inside a job (Train V2's PlacementGroupCleaner asks
    for its controller's state; raysweep's trainers no longer start one: trainer._trainer_class); with two Ray
    instances on one machine (a test cluster beside a sweep's, two `ray start` sessions) such a call raises
    "Found multiple active Ray instances". The cleaner's thread died of it and every finished trial's worker
    placement group stayed: the next trial's workers waited until they timed out. Seen here.
    """
    import ray

    os.environ.setdefault("RAY_ADDRESS", ray.get_runtime_context().gcs_address)


# Ray's log monitor (ray/_private/log_monitor.py) globs the log folder for new files every 0.1 s below 1000 files
# (each trial adds ~8 processes' files); with these, every 5 s. Idle at 280 files: 3.8 % of a core, now 1.6 %
# (RESULTS.md, "Ray's daemons"); a worker's first lines reach a verbose driver up to 5 s later.
LOG_MONITOR_ENV = {"RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0", "LOG_NAME_UPDATE_INTERVAL_S": "5"}

# Ray's worker pool (src/ray/common/ray_config_def.h): the raylet prestarts one Python worker per CPU for the first
# driver (--num_prestart_python_workers in ray/_private/services.py) and keeps up to one idle worker per CPU, each
# waking every 10 ms doing nothing (0.85 % of the 2 cores each here: RESULTS.md, "Ray's idle worker pool"). raysweep's
# trials run in actors, which get processes of their own; its few tasks start a worker when they need one, which
# Ray ends after 1 s idle (idle_worker_killing_time_threshold_ms).
WORKER_POOL = {"enable_worker_prestart": False, "prestart_worker_first_driver": False, "num_workers_soft_limit": 0}


def ray_init_kwargs(worker_start_timeout_s: float = 60, verbose: bool = False) -> dict:
    """`ray.init` keywords for a local cluster, always a new one (a bare ray.init() joins the cluster
    recorded_address() names, with keywords Ray refuses there); tests and benchmarks start theirs with these too.
    The daemons that ray.init starts read this process's environment: LOG_MONITOR_ENV is put there, where unset;
    the raylet keeps no idle pooled worker (WORKER_POOL)."""
    for key, value in LOG_MONITOR_ENV.items():
        os.environ.setdefault(key, value)
    return dict(
        address="local",
        resources={TRIAL_DRIVER: LOCAL_TRIAL_DRIVERS},
        runtime_env={"env_vars": ray_env(worker_start_timeout_s),
                     "worker_process_setup_hook": "raysweep.cluster.pin_ray_address"},
        log_to_driver=verbose,
        logging_level=logging.INFO if verbose else logging.WARNING,
        _system_config=dict(WORKER_POOL),
    )


TOKEN_FIX = ("export RAY_AUTH_MODE=token and put the cluster's token in ~/.ray/auth_token or RAY_AUTH_TOKEN "
             "(`ray get-auth-token` on the head prints it)")


def recorded_address() -> tuple[str, str] | None:
    """The cluster a bare `ray.init()` joins on this machine: the address the last `ray start` here wrote to Ray's
    address file (<RAY_TMPDIR, else TMPDIR, else /tmp>/ray/ray_current_cluster; `ray stop` removes it), as
    (address, file), or None. Ray looks there when given no address (get_ray_address_from_environment in
    ray/_private/services.py). The file's place as Ray finds it (get_default_system_temp_dir and
    get_ray_address_file in ray/_common/utils.py), without importing Ray: the CLI calls this before Ray's first
    import, which fixes the process's auth mode."""
    if "RAY_TMPDIR" in os.environ:
        tmp = os.environ["RAY_TMPDIR"]
    else:
        tmp = os.environ.get("TMPDIR", "/tmp") if sys.platform.startswith("linux") else "/tmp"
    path = os.path.join(tmp, "ray", "ray_current_cluster")
    try:
        with open(path) as f:
            address = f.read().strip()
    except OSError:
        return None
    return (address, path) if address else None


def _join_error(address: str, e: Exception) -> UserError:
    """The one line for a `ray.init(address=...)` that failed; a token-auth refusal names the token fix."""
    from ray.exceptions import AuthenticationError

    recorded = recorded_address()
    if recorded and recorded[0] == address:  # no --address: the cluster the last `ray start` here left its address of
        where = f"{address} (no --address: the last `ray start` on this machine left it in {recorded[1]})"
        instead = "or pass --address local for a cluster of this driver's own (`ray stop` removes the file)"
    else:
        where, instead = f"--address {address}", "or leave --address out for a local one"
    if isinstance(e, AuthenticationError):  # token mode on, no token here: Ray raises before connecting
        return UserError(f"{where}: RAY_AUTH_MODE=token but this machine has no token; {TOKEN_FIX}")
    chain, link = [], e
    while link is not None and len(chain) < 10:
        chain.append(str(link).lower())
        link = link.__cause__ or link.__context__
    # A token-auth GCS refuses a driver that sends no token (RAY_AUTH_MODE unset) or the wrong one: Ray wraps
    # its "InvalidAuthToken" in a ConnectionError after retrying for ~20 s (Python services say UNAUTHENTICATED)
    if any("invalidauthtoken" in text or "unauthenticated" in text for text in chain):
        token_mode = os.environ.get("RAY_AUTH_MODE") == "token"  # Ray sends a token only in token mode
        sent = "the wrong token" if token_mode else "no token (RAY_AUTH_MODE is not 'token')"
        return UserError(f"{where}: the cluster uses token authentication and this driver sent {sent}; "
                         f"{TOKEN_FIX}")
    reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return UserError(f"{where}: cannot join a Ray cluster there ({reason}); start one with "
                     f"`ray start --head` (or `ray up cluster.yaml`), {instead}")


def check_address(address: str | None) -> None:
    """An --address Ray could never parse is one line before anything slow starts (a sweep lists its data folder
    before it joins Ray): Ray takes `auto`, `local`, `ray://…` or host:port (`canonicalize_bootstrap_address` in
    ray/_private/services.py)."""
    if address and not re.fullmatch(r"auto|local|ray://\S+|\S+:\d+", address):
        raise _join_error(address, ValueError(f"Invalid address format: {address}"))


def connect(address: str | None, worker_start_timeout_s: float, verbose: bool) -> bool:
    """Start or join Ray; returns True when this call started it (and so must shut it down).
    `address`: the cluster to join (the CLI resolves --address, $RAY_ADDRESS and recorded_address()); None starts a
    local cluster, always a new one (ray_init_kwargs).
    `worker_start_timeout_s`: scaling.worker_start_timeout_s, for every Ray process of the job (ray_env)."""
    import ray
    from ray.exceptions import AuthenticationError

    if ray.is_initialized():
        return False
    kwargs = ray_init_kwargs(worker_start_timeout_s, verbose)
    if address:
        kwargs.pop("resources")  # a running cluster's resources were set by `ray start` (cluster.yaml)
        kwargs.pop("_system_config")  # its raylets' too: Ray refuses one when joining (ray/_private/worker.py)
        kwargs["address"] = address
        try:
            ray.init(**kwargs)
        except (ConnectionError, ValueError, AuthenticationError) as e:
            raise _join_error(address, e) from e
    else:
        try:
            ray.init(**kwargs)
        except Exception as e:  # Ray raises a bare Exception for it (ray/_private/node.py)
            if RAYLET_TIMEOUT not in str(e):
                raise
            raise RayNotStarted(
                "the local Ray cluster did not start: its raylet did not register with its GCS within Ray's fixed "
                "30 s (raylet_start_wait_time_s in ray/_private/node.py), as on a machine busy with other work; "
                "nothing of the sweep started: run the command again, or start Ray once with `ray start --head "
                f"--resources='{{\"{TRIAL_DRIVER}\": 8}}'` and the command joins it") from e
    return True


RAYLET_TIMEOUT = "timed out during startup"  # Ray's words when a new node's raylet misses its registration wait


def trial_driver_node() -> str:
    """The node trial drivers run on (the one holding the `trial_driver` resource: the head, as cluster.yaml starts
    it), this driver's own where it holds some: the sweep's broker and its slots' trainers live there, beside the
    trials, never on a worker node a sweep may lose. The driver's node is not it: several raylets on one machine
    share an IP, and a driver joining with --address may attach to any of them."""
    import ray

    mine = ray.get_runtime_context().get_node_id()
    holders = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get(TRIAL_DRIVER, 0) >= 1]
    return mine if mine in holders else holders[0]


@dataclass(frozen=True)
class Plan:
    trials_at_once: int
    message: str


def plan_concurrency(resources: dict[str, float], config: SweepConfig, num_samples: int,
                     free: dict[str, float] | None = None) -> Plan:
    """How many trials fit at once: each holds a trial_driver and its workers' CPUs (and GPUs). `resources`: the
    cluster's total (a trial that could never fit is an error); `free`: what is free now (other sweeps' groups hold
    the rest): the plan fits in it, and is 0 trials when not even one fits yet (`plan_when_free` waits)."""
    s = config.scaling
    cpus, gpus, drivers = resources.get("CPU", 0), resources.get("GPU", 0), resources.get(TRIAL_DRIVER, 0)
    need_cpu = s.num_workers * s.cpus_per_worker
    if drivers < 1:
        raise UserError(
            f"the cluster has no '{TRIAL_DRIVER}' resource; start its head with "
            f"ray start --head --resources='{{\"{TRIAL_DRIVER}\": 8}}' (cluster.yaml does)"
        )
    if s.use_gpu and gpus < s.gpus:
        raise UserError(
            f"scaling: a trial needs {s.gpus:g} GPU(s) ({s.num_workers} workers × "
            f"{'1' if s.workers_per_gpu == 1 else f'1/{s.workers_per_gpu}'}) but the cluster has {gpus:g}; lower "
            f"scaling.num_workers to {int(gpus * s.workers_per_gpu)} or set scaling.use_gpu: false" if gpus > 0 else
            "scaling.use_gpu: true but the cluster has no GPU; set scaling.use_gpu: false (CPU workers, gloo) "
            "or run on a GPU cluster (--address)"
        )
    if cpus < need_cpu:
        raise UserError(
            f"scaling: a trial needs {need_cpu:g} CPUs ({s.num_workers} workers × {s.cpus_per_worker:g}) but the "
            f"cluster has {cpus:g}; lower scaling.num_workers or scaling.cpus_per_worker"
        )
    held = ""
    if free is not None:
        total = f"{gpus:g} GPU" if s.use_gpu else f"{cpus:g} CPU"
        cpus, gpus, drivers = free.get("CPU", 0), free.get("GPU", 0), free.get(TRIAL_DRIVER, 0)
        if (gpus if s.use_gpu else cpus) < (resources.get("GPU", 0) if s.use_gpu else resources.get("CPU", 0)):
            held = f" (free of {total}: other jobs hold the rest)"
    fit = int(cpus // need_cpu)
    if s.use_gpu:
        fit = min(fit, int(gpus // s.gpus))
    n = min(fit, int(drivers), num_samples, config.tune.max_concurrent_trials or fit)
    unit = f"{gpus:g} GPU" if s.use_gpu else f"{cpus:g} CPU"
    if n < 1:
        short = f"{s.gpus:g} GPUs and {need_cpu:g} CPUs" if s.use_gpu else f"{need_cpu:g} CPUs"
        return Plan(0, f"waiting for {short} free for one trial's workers: {unit} free{held}")
    shared = f" ({s.workers_per_gpu} to a GPU, gloo)" if s.shares_gpu else ""
    message = f"{unit}{held}, {s.num_workers} workers/trial{shared} → {n} trial{'s' if n > 1 else ''} at a time"
    if n == 1 and num_samples > 1:
        message += "; ASHA prunes sequentially"
    return Plan(n, message)


PLAN_POLL_S = 2.0
PLAN_SAY_EVERY_S = 60.0


def plan_when_free(config: SweepConfig, num_samples: int, say) -> Plan:
    """`plan_concurrency` on what the cluster has free now; while not even one trial fits, wait (`say(line)`:
    once, then every PLAN_SAY_EVERY_S, what for). Ray's resources freed a moment ago (a sweep that just ended in
    this process) may take a poll or two to show. While short, it removes the placement groups of this job whose
    creator is dead (remove_orphaned_groups): what an earlier sweep of this process left when its broker was lost."""
    import time

    import ray

    said = None
    started = time.monotonic()
    cleaned = None  # when the orphans were last looked for
    while True:
        plan = plan_concurrency(ray.cluster_resources(), config, num_samples, ray.available_resources())
        if plan.trials_at_once > 0:
            return plan
        now = time.monotonic()
        if cleaned is None or now - cleaned >= ORPHAN_LOOK_EVERY_S:
            cleaned = now
            if remove_orphaned_groups():
                continue  # look again at once (what was removed shows free within a poll or two)
        if now - started > 2 * PLAN_POLL_S and (said is None or now - said >= PLAN_SAY_EVERY_S):
            say(plan.message)
            said = now
        time.sleep(PLAN_POLL_S)


ORPHAN_LOOK_EVERY_S = 10.0


def remove_orphaned_groups() -> list[str]:
    """Remove this job's placement groups whose creating actor is dead; returns their ids.

    Train V2's controller (an actor) places its worker group's placement group; Ray frees such a group only once
    its creating actor *and* its job have both died (the GCS's lifetime rule, GcsPlacementGroup::
    IsPlacementGroupLifetimeDone in ray's src/ray/gcs/gcs_placement_group.cc). raysweep's trainers start no Train
    V2 PlacementGroupCleaner (trainer._trainer_class): this is what removes such groups, and the cleaner removed
    only the group the controller last registered with it. A slot's host killed while its controller restarted the group
    (a broker lost, a SIGKILL) leaves the new group holding its CPUs and GPUs for as long as the driver's job lives:
    for ever in a process that goes on (a test session, a notebook). Such a group is owned by no one by
    construction: its creator is dead and it is not detached, so nothing can schedule into it again. Only this job's
    groups are touched (another driver's go with its job). A group placed by a driver (Tune's trial groups) has the
    nil actor as its creator: those are left alone.

    Dead by the GCS's own tables (ray._private.state, as `ray.util.placement_group_table` reads them): the group's
    `creator_actor_dead` flag, which the public table omits, or else its creator's entry in the actor table. The
    flag alone misses a death the GCS handled before it registered the group: a controller whose slot host was
    SIGKILLed is marked dead at once (OWNER_DIED) while its process still runs, and a group it asks for in that
    moment is registered with the flag unset and never set (seen here: a sweep waited for ever for the 2 CPUs of
    such a group, its creator DEAD in the actor table)."""
    import ray
    from ray._private.state import state
    from ray.core.generated import gcs_pb2
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    table = gcs_pb2.PlacementGroupTableData
    job = ray.get_runtime_context().get_job_id()
    removed = []
    try:
        accessor = state._connect_and_get_accessor()
        infos = [table.FromString(blob) for blob in accessor.get_placement_group_table()]
    except Exception as e:  # the GCS briefly unreachable: nothing known to be an orphan
        log.debug("reading the placement group table: %s", e)
        return removed
    dead: dict[bytes, bool] = {}  # creator id → dead, by the actor table (one look per creator)
    for info in infos:
        placed_by_actor = info.creator_actor_id and not ray.ActorID(info.creator_actor_id).is_nil()
        if (info.state == table.REMOVED or info.is_detached or not placed_by_actor
                or info.creator_job_id.hex() != job):
            continue
        if not info.creator_actor_dead:
            if info.creator_actor_id not in dead:
                dead[info.creator_actor_id] = _actor_dead(accessor, info.creator_actor_id)
            if not dead[info.creator_actor_id]:
                continue
        pg_id = info.placement_group_id.hex()
        log.warning("removing placement group %s: the actor that placed it is dead", pg_id)
        try:
            remove_placement_group(PlacementGroup(ray.PlacementGroupID(info.placement_group_id)))
            removed.append(pg_id)
        except Exception as e:  # removed meanwhile
            log.debug("placement group %s: %s", pg_id, e)
    return removed


def _actor_dead(accessor, actor_id: bytes) -> bool:
    """The GCS's actor table holds `actor_id` as DEAD (unknown or unreadable: not known dead)."""
    import ray
    from ray.core.generated import gcs_pb2

    try:
        blob = accessor.get_actor_info(ray.ActorID(actor_id))
    except Exception as e:  # noqa: BLE001 - the GCS briefly unreachable
        log.debug("reading actor %s: %s", actor_id.hex(), e)
        return False
    return blob is not None and gcs_pb2.ActorTableData.FromString(blob).state == gcs_pb2.ActorTableData.DEAD
