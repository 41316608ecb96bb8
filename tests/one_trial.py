"""One trial on a worker group of its own, epoch 1 to its last, each epoch reported to Ray Train: what the tests that
fit a single TorchTrainer run (tests/test_train_ray.py, through `trainer.make_trainer`). A sweep's trials run on warm
groups instead (worker/entry.slot_worker), which keep their checkpoints and resume.

Ray's workers cannot import tests/ (pytest puts it on this process's path only), so this module travels to them by
value (cloudpickle's `register_pickle_by_value`).
"""

from __future__ import annotations

import sys


def one_trial_worker(config: dict) -> None:
    """Every rank of the trial: make_trainer's `config` ({"trial": TrialConfig dict, "data": ObjectRef,
    "compile_cache"}); a failure its ranks agreed on (OOM past the downshifts, divergence) fails the fit()."""
    import ray.train
    import ray.train.torch

    from raysweep.config import TrialConfig
    from raysweep.worker.entry import start_rank, train_epochs
    from raysweep.worker.run import TrainingRun

    trial = TrialConfig.from_dict(config["trial"])
    me = start_rank(config)
    run = TrainingRun.build(trial, me.data, me.rank, me.world_size, me.device, wrap=ray.train.torch.prepare_model)
    run.nodes = me.nodes

    def send(payload: dict, epoch: int | None) -> bool:
        ray.train.report(payload)  # every rank: it is a collective
        return True

    failure = train_epochs(run, 1, send, config.get("compile_cache"))[1]
    if failure is not None:  # no broker to hand it to
        raise failure


def _travel_by_value() -> None:
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


_travel_by_value()
