"""The Ray Train entry point of every rank: the only worker module that talks to Ray.

Ray is imported inside the functions: the rest of the worker runs (and is tested) in a plain process.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile

import torch

from raysweep.config import TrialConfig
from raysweep.metrics import report_dict
from raysweep.worker import compile_cache
from raysweep.worker.device import setup_device
from raysweep.worker.faults import TrialFailure
from raysweep.worker.reduce import gather_strings
from raysweep.worker.run import CHECKPOINT_FILE, TrainingRun

log = logging.getLogger(__name__)


def train_worker(config: dict) -> None:
    """Every rank; `config` = {"trial": TrialConfig dict, "data": ObjectRef, "failure_file", "compile_cache": the
    sweep's compile cache (compile_cache.py), "resume_from": a checkpoint folder to load when Ray Train hands none
    (cluster.recover_torn_snapshot)}."""
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
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None and config.get("resume_from"):  # Ray's checkpoint list was torn by a kill (cluster.py)
        checkpoint = ray.train.Checkpoint(config["resume_from"])
    start_epoch = run.restore(load_state(checkpoint, device))
    if run.last_report:
        # the checkpoint's epoch again (every rank): its report may have died with a killed driver, and a run
        # that had finished must end with its real final result; trackers skip what they already hold
        ray.train.report(run.last_report)
    try:
        run.fit_in_memory()
        if rank == 0 and run.net.compile_s > 0:
            compile_cache.save_artifacts(config.get("compile_cache"))
        for epoch in range(start_epoch, trial.train.epochs + 1):
            payload = report_dict(run.epoch(epoch), run.worker_params())
            due = epoch % trial.train.checkpoint_every == 0 or epoch == trial.train.epochs
            report(payload, rank, due, lambda: run.state(epoch, payload))
    except TrialFailure as failure:  # every rank raised it at the same point: end cleanly, no retry
        if rank == 0:
            write_failure(config["failure_file"], failure)


def load_state(checkpoint, device: torch.device) -> dict | None:
    """The state saved in Ray's latest checkpoint; where that one cannot be read (torn by a kill or a full disk
    mid-write), the newest earlier one in the run's folder (cluster.KEPT_CHECKPOINTS keeps two). None: no
    checkpoint, or none readable (the trial starts over, as it would have without one)."""
    if checkpoint is None:
        return None
    import pyarrow.fs
    import ray.train

    fs = checkpoint.filesystem
    run_dir, name = checkpoint.path.rstrip("/").rsplit("/", 1)
    earlier = sorted((info.base_name for info in fs.get_file_info(pyarrow.fs.FileSelector(run_dir))
                      if info.base_name.startswith("checkpoint_") and info.base_name < name), reverse=True)
    for candidate in [checkpoint, *(ray.train.Checkpoint(f"{run_dir}/{n}", filesystem=fs) for n in earlier)]:
        try:
            with candidate.as_directory() as d:
                return torch.load(os.path.join(d, CHECKPOINT_FILE), map_location=device, weights_only=True)
        except Exception as e:  # torn: EOFError, RuntimeError (zip), UnpicklingError, FileNotFoundError
            log.warning("checkpoint %s cannot be read (%s: %s); trying the one before it", candidate.path,
                        type(e).__name__, e)
    log.warning("no readable checkpoint under %s: the trial starts over", run_dir)
    return None


def report(metrics: dict, rank: int, checkpoint_due: bool, state_fn) -> None:
    """Every rank reports (it is a collective); rank 0 alone attaches the checkpoint."""
    import ray.train

    if rank == 0 and checkpoint_due:
        with tempfile.TemporaryDirectory() as d:
            torch.save(state_fn(), os.path.join(d, CHECKPOINT_FILE))
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d))
    else:
        ray.train.report(metrics)


def write_failure(location: str, failure: TrialFailure) -> None:
    """Rank 0's half of the agreed-failure file (cluster.read_failure is the trial function's half)."""
    from raysweep import storage

    storage.write_text(location, json.dumps({"kind": failure.kind, "message": str(failure)}))


def quiet_ray_train_logs() -> None:
    """The per-report INFO line ignores LoggingConfig: its logger is named by file path (RAY_NOTES.md)."""
    try:
        import ray.train.v2._internal.execution.context as context

        logging.getLogger(context.__file__).setLevel(logging.WARNING)
    except ImportError:
        pass
