"""The `TorchTrainer` raysweep builds: its workers' environment (`worker_env`), `make_trainer`, and the trainer class
(`_trainer_class`) without the actors Train V2 starts that raysweep has no use for.

A warm slot (slots/) runs one trainer for the whole sweep; the probe (probe.py) runs one per probe; the tests and
benchmarks/ray_overhead.py run one per trial.
"""

from __future__ import annotations

import functools
import os

from raysweep.config import TrialConfig
from raysweep.worker.compile_cache import cache_env


def worker_env(compile_cache: str | None = None) -> dict[str, str]:
    """Environment for a trial's worker processes (it must be in place when they start).

    `compile_cache`: the sweep's compile cache (worker/compile_cache.py): on a path, Inductor's cache directory.

    glibc backs large allocations with transparent huge pages: an activation over 32 MB is a fresh
    mmap, faulted in 4 KiB pages on first touch (a 157 MB elementwise pass took 77 ms into new
    memory, 13 ms into reused memory here); 2 MiB pages cut the faults 512×. On the CPU step at
    batch 512: 48-52 → 65-69 images/s, same peak RSS.

    And every thread allocates from glibc's main arena. Ray Train runs the loop on a thread of the worker, and glibc
    gives each new thread an arena of its own, whose heaps hold at most 64 MB (HEAP_MAX_SIZE, glibc's malloc/arena.c):
    a larger tensor was mapped fresh and unmapped when freed, every step, whatever worker.device.keep_host_memory set
    (M_MMAP_MAX keeps blocks in the main arena's heap only). On the quickstart's images a CPU worker's epoch at
    per-GPU 192 took 7.42 s that way and 5.59 s on the main arena (benchmarks/worker_arena.py; RESULTS.md). Small
    allocations go through each thread's tcache either way, so the arena's lock is rarely taken.
    tests/test_train_ray.py checks where a worker's loop thread gets a 160 MB tensor.

    Plus the RAYSWEEP_TEST_* fault switches, where set (tests only).
    """
    ours = ("glibc.malloc.hugetlb=1", "glibc.malloc.arena_max=1")
    names = {o.split("=")[0] for o in ours}
    tunables = [t for t in os.environ.get("GLIBC_TUNABLES", "").split(":") if t and t.split("=")[0] not in names]
    env = {"GLIBC_TUNABLES": ":".join([*tunables, *ours])}
    env.update({k: v for k, v in os.environ.items() if k.startswith("RAYSWEEP_TEST_")})
    env.update(cache_env(compile_cache))
    return env


def make_trainer(trial: TrialConfig, data_ref, storage_path: str, name: str, callbacks=(), *, worker_fn,
                 env: dict | None = None, extra_config: dict | None = None, compile_cache: str | None = None,
                 max_failures: int | None = None, code: dict | None = None):
    """A `TorchTrainer` whose workers run `worker_fn` on the shape of `trial`: worker/entry.slot_worker on a warm
    slot, probe.probe_worker for the probe (the tests and benchmarks/ray_overhead.py pass a one-trial worker).

    No Ray Train checkpoints: a warm slot's trials keep their own, in their own folders (worker/entry.py).
    `worker_fn` gets {"trial": TrialConfig dict, "data": `data_ref`, "compile_cache", **`extra_config`}.
    `compile_cache`: the sweep's compile cache (worker/compile_cache.py); `env` (default `worker_env(compile_cache)`)
    must point Inductor at it. `max_failures`: group restarts Ray Train may make (None: the trial's
    `train.max_failures`; a warm slot's trainer passes -1, unlimited, and the broker counts each trial's, slots/).
    `code`: the user's model code for the workers (usercode.ship: {"py_modules": [...]}, or {}).
    """
    from ray.train import FailureConfig, LoggingConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig

    extra_config = {"compile_cache": compile_cache, **(extra_config or {})}
    resources = {"CPU": trial.scaling.cpus_per_worker}
    if trial.scaling.use_gpu:
        resources["GPU"] = trial.scaling.gpus_per_worker  # 1, or 1/k where k workers share a GPU
    return _trainer_class()(
        worker_fn,
        train_loop_config={"trial": trial.to_dict(), "data": data_ref, **extra_config},
        # ranks sharing a GPU: gloo (it all-reduces CUDA tensors); NCCL refuses two ranks of one communicator on one
        # device (ray-project/ray#48012). Otherwise Ray Train's choice: NCCL with GPUs, gloo without
        torch_config=TorchConfig(backend="gloo") if trial.scaling.shares_gpu else None,
        scaling_config=ScalingConfig(
            num_workers=trial.scaling.num_workers, use_gpu=trial.scaling.use_gpu, resources_per_worker=resources
        ),
        run_config=RunConfig(
            name=name,
            storage_path=storage_path,
            callbacks=list(callbacks),
            # a worker crash restarts the group (a slot's trial resumes from its own checkpoint); a group
            # that cannot start is retried once, so the wait is bounded by 2 × worker_start_timeout_s
            failure_config=FailureConfig(
                max_failures=trial.train.max_failures if max_failures is None else max_failures,
                controller_failure_limit=1),
            logging_config=LoggingConfig(log_level="WARNING"),
            worker_runtime_env={"env_vars": env if env is not None else worker_env(compile_cache), **(code or {})},
        ),
    )


@functools.cache
def _trainer_class():
    """`TorchTrainer` without Train V2's per-run `DatasetManager` and `PlacementGroupCleaner` actors, and without its
    cluster's `AutoscalingCoordinator`.

    Train V2 starts both for every run (`_create_default_callbacks`, ray/train/v2/api/data_parallel_trainer.py):
    - the DatasetManager whether or not the run has datasets: a fresh Python process importing ray.data (about 1 s
      of CPU), started while the worker group sets up, on the path to the first report. raysweep's data travels as
      one object ref, never as Ray Datasets (a trainer given `datasets` keeps it);
    - the PlacementGroupCleaner, a detached actor that asks the State API every second whether the controller still
      lives and removes the group the controller last registered with it once it does not
      (ray/train/v2/_internal/execution/controller/placement_group_cleaner.py). raysweep removes its groups itself:
      the broker removes a slot's group when the slot ends and every group whose placing actor is dead when a slot
      ends or waits for resources, and the planner does while a sweep waits to start
      (cluster.remove_orphaned_groups, which also finds the groups the cleaner misses: the docstring there). The
      cleaner is one more process per trainer (4.3 s of CPU over the quickstart's 107 s sweep), and it, with the
      dashboard's State API and the GCS it polls, costs the cores beside training for as long as the trainer lives
      (RESULTS.md, "A trial's idle Ray processes"; benchmarks/ray_idle.py).
    And no resource request to Ray's `AutoscalingCoordinator`. Train V2's fixed scaling policy asks it, at the
    controller's start and every 20 s after (ray/train/v2/_internal/execution/scaling_policy/), to reserve the group's
    resources, which it forwards to the autoscaler (`ray.autoscaler.sdk.request_resources`,
    ray/data/_internal/cluster_autoscaler/default_autoscaling_coordinator.py). It exists to share a cluster between
    Ray Data and Train; raysweep runs no Ray Data, and its groups' placement groups are themselves the demand Ray's
    autoscaler scales a `ray up` cluster for (doc/source/ray-core/internals/autoscaler-v2.rst: "resource demand from
    tasks, actors, and placement groups"). The coordinator is a detached actor that the cluster's first trainer
    creates and waits for, up to 5 s: a fresh cluster's first worker started 1.8 s sooner without it (8.6 s against
    10.3, medians of 3 alternating; RESULTS.md, "Ray's autoscaling coordinator"), and it wakes every 10 ms for as long
    as the cluster lives, as every Ray process does.
    `tests/test_train_ray.py` checks that a trial starts none of these, so a Ray upgrade that renames these private
    hooks fails there.

    And `fit()` puts back the SIGINT handler it found. Called on a main thread, Train V2's fit() installs
    one that aborts its controller (ray-project/ray#53600) and never removes it: that handler holds the
    controller's handle, so the TrainController stays alive after fit() returns, as long as the process
    does (a `probe` in a driver that goes on, a test session), and the process's Ctrl-C keeps going to a
    run that ended. `tests/test_train_ray.py` checks that no controller outlives its fit().
    """
    import signal
    import threading

    from ray.train.torch import TorchTrainer
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
    from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback
    from ray.train.v2._internal.execution.scaling_policy import FixedScalingPolicy

    class FixedWithoutRequests(FixedScalingPolicy):
        def after_controller_start(self, train_run_context):
            pass  # no coordinator client: nothing to request, and nothing for the shutdown to cancel

        def _maybe_send_resource_request(self):
            pass

    class CaptchaTrainer(TorchTrainer):
        def _create_default_callbacks(self):
            callbacks = super()._create_default_callbacks()
            dropped = (PlacementGroupCleanerCallback,) + (() if self.datasets else (DatasetsCallback,))
            return [c for c in callbacks if not isinstance(c, dropped)]

        def _initialize_and_run_controller(self, **controller_kwargs):
            if type(controller_kwargs.get("scaling_policy")) is FixedScalingPolicy:
                controller_kwargs["scaling_policy"] = FixedWithoutRequests(self.scaling_config)
            return super()._initialize_and_run_controller(**controller_kwargs)

        def fit(self):
            if threading.current_thread() is not threading.main_thread():
                return super().fit()
            handler = signal.getsignal(signal.SIGINT)
            try:
                return super().fit()
            finally:
                signal.signal(signal.SIGINT, handler)

    return CaptchaTrainer
