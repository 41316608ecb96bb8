"""A trial runs the batch it logs: every optimizer step of every rank takes exactly per-GPU batch × accumulation
samples (DistributedSampler's drop_last: whole steps per epoch, the rest sit out, others each epoch), and what the
reports, the params and the search read is what ran. Observed on the real step (a forward pre-hook counts what the
model is given), at the users' scale (50,000 images, 3 ranks, per-GPU up to 8,192) and on small folders."""

import numpy as np
import pytest
import torch

from raysweep.config import ImageSpec, Knobs, ModelConfig, ScalingConfig, TrainConfig, TrialConfig
from raysweep.data import CaptchaArrays, CaptchaData
from raysweep.errors import UserError
from raysweep.worker.shard import epoch_plan

from ranks import run_ranks

USERS = 50_000  # the users' folders: ~50,000 images on 3 GPUs
IMAGE = ImageSpec(width=16, height=8, length=4, num_classes=36)  # small images: the batch arithmetic is the same


def _trial(per_gpu, accum=1, workers=3, n=USERS, splits=1):
    return TrialConfig(
        knobs=Knobs(per_gpu_batch_size=per_gpu, base_lr=1e-3, warmup_epochs=0, weight_decay=0.0,
                    grad_accum_steps=accum, lr_rule="sqrt"),
        micro_splits=splits, train=TrainConfig(epochs=2, reference_batch_size=256), model=ModelConfig(dropout=0.0),
        scaling=ScalingConfig(num_workers=workers), image=IMAGE, train_size=n)


def _arrays(n):
    rng = np.random.default_rng(0)
    return CaptchaArrays(rng.integers(0, 255, (n, IMAGE.height, IMAGE.width), dtype=np.uint8),
                         rng.integers(0, 36, (n, IMAGE.length), dtype=np.uint8))


def _one_rank_epoch(trial, rank, epoch=1):
    """Rank `rank`'s epoch as a worker trains it (its plan, its step; no process group, so no all-reduce):
    the sizes of the micro-batches the model was given, the optimizer steps taken, and the epoch's sums."""
    from raysweep.worker.run import TrainingRun
    from raysweep.worker.step import train_one_epoch

    data = CaptchaData(_arrays(trial.train_size), _arrays(8), "random")
    run = TrainingRun.build(trial, data, rank, 1, torch.device("cpu"))
    run.net.noise = None  # one rank's meter runs a half-batch forward of its own, out of the step's way (not a step)
    sizes = []
    run.net.model.register_forward_pre_hook(lambda module, args: sizes.append(args[0].shape[0]))
    before = run.scheduler.last_epoch
    sums = train_one_epoch(run.net, run.train, run.scheduler, run.trial, epoch, rank)
    return sizes, run.scheduler.last_epoch - before, sums


@pytest.mark.parametrize("per_gpu, accum", [(1024, 1), (2048, 1), (4096, 1), (8192, 1), (2048, 2), (64, 1)])
def test_at_the_users_scale_every_step_takes_the_whole_per_gpu_batch_times_accumulation(per_gpu, accum):
    """50,000 images on 3 ranks: per-GPU 8192 ran 5,555 a step (ceil(50,000 / 24,576) = 3 steps cut from a share of
    16,666), 4096 ran 3,333, 2048 1,851, 1024 980. Now every step is whole and the epoch has floor(n / global)
    of them."""
    trial = _trial(per_gpu, accum)
    global_batch = per_gpu * 3 * accum
    assert trial.global_batch_size == global_batch and trial.steps_per_epoch == USERS // global_batch
    assert trial.samples_per_epoch == trial.steps_per_epoch * global_batch
    if per_gpu > 1024 or accum > 1:  # the plan alone, every rank; the real step below on the largest batches
        sizes, steps, sums = _one_rank_epoch(trial, rank=2)
        assert steps == trial.steps_per_epoch
        assert sizes == [per_gpu] * (steps * accum), sorted(set(sizes))
        assert sums.samples == steps * per_gpu * accum and sums.optimizer_steps == steps
    for epoch in (1, 2):
        plans = [epoch_plan(USERS, trial.micro_batches_per_epoch, trial.micro_batch_size, 0, epoch, rank, 3)
                 for rank in range(3)]
        assert all(p.shape == (trial.steps_per_epoch * accum, per_gpu) for p in plans)
        used = np.concatenate([p.ravel() for p in plans])
        assert len(np.unique(used)) == len(used) == trial.samples_per_epoch  # each sample at most once


def test_the_samples_that_sit_out_are_others_each_epoch():
    """Per-GPU 8192 on 50,000: 2 steps of 24,576 an epoch, 848 sit out, a different 848 every epoch (none for
    good over a few epochs)."""
    trial = _trial(8192)
    left_out = []
    for epoch in range(1, 6):
        used = np.concatenate([epoch_plan(USERS, trial.micro_batches_per_epoch, trial.micro_batch_size, 0, epoch,
                                          rank, 3).ravel() for rank in range(3)])
        left_out.append(set(range(USERS)) - set(used.tolist()))
    assert all(len(s) == USERS - 2 * 24_576 for s in left_out)
    assert not set.intersection(*left_out)


@pytest.mark.parametrize("per_gpu, accum, steps", [(300, 1, 1), (64, 1, 5), (100, 2, 1), (16, 1, 20)])
def test_on_a_small_folder_every_step_is_whole(per_gpu, accum, steps):
    """1,000 images on 3 ranks: per-GPU 300 ran 166 a step (45 % short) and 64 ran 55 (14 %)."""
    trial = _trial(per_gpu, accum, n=1000)
    assert trial.steps_per_epoch == steps
    sizes, taken, sums = _one_rank_epoch(trial, rank=1)
    assert taken == steps and sizes == [per_gpu] * (steps * accum)
    assert sums.samples == steps * per_gpu * accum


def test_a_capped_or_downshifted_batch_is_still_the_whole_batch():
    """Micro-batches always divide the per-GPU batch exactly: a cap (search.per_gpu_batch_size.max, --cap-batch)
    and each OOM downshift pick the next micro-batch that does, so a step still takes per-GPU × accumulation."""
    from raysweep.config.knobs import Choice
    from raysweep.config.sections import SearchConfig
    from raysweep.config.trial import TrialFactory

    factory = TrialFactory(SearchConfig(per_gpu_batch_size=Choice[int](choice=[768, 8192, 97])), TrainConfig(),
                           ModelConfig(), ScalingConfig(num_workers=3), IMAGE)
    for per_gpu, cap, micro in [(8192, 3000, 2048), (768, 500, 384), (768, 200, 192), (97, 50, 1)]:
        t = factory.trial({"per_gpu_batch_size": per_gpu}, USERS, batch_cap=cap)
        assert (t.micro_batch_size, t.micro_batch_size * t.micro_splits) == (micro, per_gpu)
    t = _trial(768)
    shifts = [t.micro_batch_size]
    while t.can_downshift:
        t = t.downshifted()
        shifts.append(t.micro_batch_size)
        assert t.micro_batch_size * t.micro_splits == 768
    assert shifts[:4] == [768, 384, 192, 96] and shifts[-1] == 1
    sizes, steps, sums = _one_rank_epoch(_trial(96, accum=1, n=600, splits=3), rank=0)
    assert sizes == [32] * (steps * 3) and sums.samples == steps * 96  # 3 micro-batches of 32 = the per-GPU 96


def test_a_batch_larger_than_a_ranks_share_is_refused_in_one_line():
    from raysweep.config.knobs import Choice
    from raysweep.config.sections import SearchConfig
    from raysweep.config.trial import TrialFactory

    factory = TrialFactory(SearchConfig(per_gpu_batch_size=Choice[int](choice=[64, 400])), TrainConfig(),
                           ModelConfig(), ScalingConfig(num_workers=3), IMAGE)
    with pytest.raises(UserError, match=r"spec.yaml: search.per_gpu_batch_size: 400 × 1 accumulation step\(s\) is "
                                        r"more than a rank's share .* the largest per-GPU batch this data runs is 333"):
        factory.check_data_fits(1000, source="spec.yaml")
    factory.check_data_fits(1200)  # a share of 400: one whole step of 400


def _ddp_epoch(rank, world, per_gpu):
    """One epoch of a 3-rank DDP trial (gloo), as a worker runs it: its reduced metrics, its worker params and the
    micro-batch sizes its model was given."""
    from torch.nn.parallel import DistributedDataParallel

    from raysweep.worker.run import TrainingRun

    trial = _trial(per_gpu)
    data = CaptchaData(_arrays(USERS), _arrays(30), "random")
    run = TrainingRun.build(trial, data, rank, world, torch.device("cpu"), wrap=DistributedDataParallel)
    sizes = []
    run.net.model.register_forward_pre_hook(lambda module, args: sizes.append(args[0].shape[0]))
    metrics = run.epoch(1)
    return metrics.samples_seen, run.worker_params(), sizes


@pytest.mark.timeout(180)
def test_three_ddp_ranks_at_per_gpu_8192_report_what_they_ran():
    """The reported samples (and with them samples/s and the noise scale's big batch, samples ÷ steps) are the
    steps' whole batches on every rank: 2 steps of 3 × 8,192 (it reported 3 steps of 3 × 5,555)."""
    results = run_ranks(_ddp_epoch, world=3, per_gpu=8192)
    for samples_seen, params, sizes in results:
        assert samples_seen == 2 * 3 * 8192
        assert sizes == [8192, 8192]
        assert params.micro_batch_size * params.accumulation_steps == 8192
