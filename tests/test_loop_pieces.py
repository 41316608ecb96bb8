"""The loop's pure pieces, without Ray: batch plans and one epoch on one CPU process."""

import numpy as np
import pytest
import torch

from raysweep.config import ImageSpec, Knobs, ModelConfig, ScalingConfig, TrainConfig, TrialConfig
from raysweep.data import CaptchaArrays
from raysweep.model import CaptchaCNN
from raysweep.optim import build_optimizer, build_scheduler
from raysweep.worker.evaluate import evaluate
from raysweep.worker.net import RankModel
from raysweep.worker.shard import Shard, epoch_plan
from raysweep.worker.step import train_one_epoch


def _net(model, lr, precision="fp32"):
    """A one-process RankModel around `model` (what RankModel.build makes on a worker)."""
    opt = build_optimizer(model, lr, 0.0, "cpu")
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    return RankModel(model, model, opt, scaler, precision, torch.device("cpu"))


@pytest.mark.parametrize("n, world, micro", [(512, 2, 32), (500, 3, 27), (50_000, 3, 980), (7, 2, 1)])
def test_plans_are_equal_micro_batches_using_each_sample_at_most_once_per_epoch(n, world, micro):
    """One micro-batch size on every rank (one shape to compile and replay); in an epoch the ranks' shares are
    disjoint, and what is left over (n mod world, and each share's remainder past its whole micro-batches) is a
    different part of the set every epoch, so no sample is left out for good."""
    share = n // world
    batches = share // micro
    used_over_epochs = set()
    for epoch in range(1, 9):
        flats = []
        for rank in range(world):
            plan = epoch_plan(n, batches, micro, seed=0, epoch=epoch, rank=rank, world_size=world)
            assert plan.shape == (batches, micro)  # same count on every rank, one size
            flats += plan.ravel().tolist()
        assert len(set(flats)) == len(flats) and set(flats) <= set(range(n))  # at most once per epoch, all ranks
        assert n - len(flats) < micro * world + world
        used_over_epochs.update(flats)
    assert used_over_epochs == set(range(n))


def test_plans_reshuffle_each_epoch_across_ranks_and_replay_exactly():
    a = epoch_plan(300, 4, 25, seed=0, epoch=1, rank=0, world_size=3)
    assert np.array_equal(a, epoch_plan(300, 4, 25, seed=0, epoch=1, rank=0, world_size=3))
    b = epoch_plan(300, 4, 25, seed=0, epoch=2, rank=0, world_size=3)
    # epoch 2 deals rank 0 a new share from the whole set: about a third of it is what rank 0 had in epoch 1
    assert 0.15 < len(set(a.ravel()) & set(b.ravel())) / a.size < 0.55
    assert not np.array_equal(a, epoch_plan(300, 4, 25, seed=1, epoch=1, rank=0, world_size=3))


def test_too_small_share_is_a_clear_error():
    with pytest.raises(ValueError, match="cannot fill 8 micro-batches of 1"):
        epoch_plan(15, 8, 1, 0, 1, 0, 3)
    with pytest.raises(ValueError, match="cannot fill 1 micro-batches of 6"):
        epoch_plan(15, 1, 6, 0, 1, 0, 3)


def _trial(batch=16, accum=1, n=96):
    return TrialConfig(
        knobs=Knobs(per_gpu_batch_size=batch, base_lr=3e-3, warmup_epochs=0, weight_decay=0.0, grad_accum_steps=accum,
                    lr_rule="none"),
        train=TrainConfig(epochs=3), model=ModelConfig(dropout=0.0), scaling=ScalingConfig(num_workers=1),
        image=ImageSpec(width=64, height=24, length=4, num_classes=36), train_size=n,
    )


def _random_arrays(n):
    """`n` random 24×64 images with random 4-character labels, the same every call."""
    rng = np.random.default_rng(0)
    return CaptchaArrays(rng.integers(0, 255, (n, 24, 64), dtype=np.uint8), rng.integers(0, 36, (n, 4), dtype=np.uint8))


def test_one_process_epochs_lower_the_loss_and_count_steps():
    arrays = _random_arrays(96)
    trial = _trial()
    shard = Shard.build(arrays, 36, torch.device("cpu"))
    torch.manual_seed(0)
    net = _net(CaptchaCNN(24, 64, 4, 36, dropout=0.0), trial.peak_lr)
    sched = build_scheduler(net.optimizer, trial.peak_lr, 1e-6, 0, trial.total_steps)
    losses = []
    for epoch in (1, 2, 3):
        sums = train_one_epoch(net, shard, sched, trial, epoch, 0)
        losses.append(float(sums.loss_sum) / sums.samples)
        assert sums.samples == 96 and sums.optimizer_steps == 6
    assert losses[-1] < losses[0]
    assert sched.last_epoch == 18
    val = evaluate(net.core, shard, trial)
    assert val.samples == 96 and val.char_total == 384
    assert 0 <= float(val.exact) <= float(val.chars) <= 384


class _FixedLogits(torch.nn.Module):
    """Answers image i with logits[i]; i is written in the image's first pixel (so any batch order works)."""

    def __init__(self, logits):
        super().__init__()
        self.logits = logits

    def forward(self, x):
        return self.logits[(x[:, 0, 0, 0] * 255).round().long()]


def test_evaluate_counts_exact_and_character_matches():
    n, length, classes = 10, 4, 36
    rng = np.random.default_rng(1)
    labels = rng.integers(0, classes, (n, length))
    # captcha i gets its first `right[i]` characters right and the rest wrong
    right = [4, 4, 4, 3, 3, 2, 1, 0, 0, 4]  # 4 fully right, 25 of 40 characters right
    logits = torch.full((n, length, classes), -5.0)
    for i in range(n):
        for j in range(length):
            guess = labels[i, j] if j < right[i] else (labels[i, j] + 1) % classes
            logits[i, j, guess] = 5.0
    images = np.zeros((n, 24, 64), dtype=np.uint8)
    images[:, 0, 0] = np.arange(n)
    shard = Shard.build(CaptchaArrays(images, labels.astype(np.uint8)), classes, torch.device("cpu"))
    val = evaluate(_FixedLogits(logits.view(n, -1)), shard, _trial(batch=3, n=n))  # batches of 3, 3, 3, 1
    assert (float(val.exact), float(val.chars), val.samples, val.char_total) == (4, 25, n, n * length)


def test_accumulation_keeps_global_batch_and_step_count():
    one, two = _trial(batch=32, accum=1), _trial(batch=16, accum=2)
    assert one.global_batch_size == two.global_batch_size == 32
    assert one.steps_per_epoch == two.steps_per_epoch == 3
    assert one.peak_lr == two.peak_lr


def test_fast_loop_and_seed_loop_compute_the_same_loss_on_the_same_batch(tmp_path):
    from raysweep.data import read_folder, write_captcha_folder

    from seed_loop import PngCaptchas, copy_weights, seed_model, train_steps

    charset = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    write_captcha_folder(tmp_path, 32, charset, 4, 64, 24)
    trial = TrialConfig(
        knobs=Knobs(per_gpu_batch_size=32, base_lr=1e-3, warmup_epochs=0, weight_decay=1e-4, grad_accum_steps=1,
                    lr_rule="none"),
        train=TrainConfig(epochs=1, min_lr=1e-3), model=ModelConfig(dropout=0.0), scaling=ScalingConfig(num_workers=1),
        image=ImageSpec(width=64, height=24, length=4, num_classes=36), train_size=32,
    )
    torch.manual_seed(0)
    ours = CaptchaCNN(24, 64, 4, 36, dropout=0.0)
    seed = seed_model(24, 64, 4, 36, dropout=0.0)
    copy_weights(ours, seed)
    ours = ours.to(memory_format=torch.channels_last)

    loader = torch.utils.data.DataLoader(PngCaptchas(tmp_path, charset), batch_size=32)
    seed_loss = train_steps(seed, loader, steps=1)[0]  # PIL per sample, fp32, .item() per step

    shard = Shard.build(read_folder(tmp_path, charset, 4, 64, 24), 36, torch.device("cpu"))
    net = _net(ours, 1e-3)
    sums = train_one_epoch(net, shard, build_scheduler(net.optimizer, 1e-3, 1e-3, 0, 1), trial, epoch=1, rank=0)
    # one batch of all 32 images (order differs, the mean and BatchNorm's statistics do not)
    assert float(sums.loss_sum) / 32 == pytest.approx(seed_loss, rel=1e-5)


def test_auto_precision_on_cpu_follows_the_cpus_bf16_instructions():
    """bf16 autocast ran 2× faster than fp32 with AVX512-BF16 and 3× slower without (benchmarks/RESULTS.md)."""
    from pathlib import Path

    from raysweep.worker.device import resolve_precision

    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        pytest.skip("no /proc/cpuinfo to check against")
    flags = set(next(ln for ln in cpuinfo.read_text().splitlines() if ln.startswith("flags")).split(":")[1].split())
    native = bool(flags & {"avx512_bf16", "amx_tile"})  # the kernel's word, independent of torch's probe
    assert resolve_precision("auto", torch.device("cpu")) == ("bf16" if native else "fp32")
    assert resolve_precision("fp16", torch.device("cpu")) == "fp16"  # explicit choices pass through


def test_bf16_autocast_trains_on_cpu_like_fp32():
    arrays = _random_arrays(96)
    shard = Shard.build(arrays, 36, torch.device("cpu"))
    trial = _trial()
    losses = {}
    for precision in ("fp32", "bf16"):
        torch.manual_seed(0)
        model = CaptchaCNN(24, 64, 4, 36, dropout=0.0).to(memory_format=torch.channels_last)
        net = _net(model, trial.peak_lr, precision)
        sched = build_scheduler(net.optimizer, trial.peak_lr, 1e-6, 0, trial.total_steps)
        losses[precision] = [float(train_one_epoch(net, shard, sched, trial, epoch, 0).loss_sum) / 96
                             for epoch in (1, 2, 3)]
    assert losses["bf16"][0] == pytest.approx(losses["fp32"][0], rel=0.02)  # same weights, same batches
    assert losses["bf16"][-1] < losses["bf16"][0]


def _run_with(trial, epoch_seconds):
    """A one-process TrainingRun of `trial` whose epochs report `epoch_seconds` of training each (the pace is
    given, not measured: what resolve_epochs does with a pace is what is tested)."""
    import dataclasses

    from raysweep.metrics import EpochMetrics
    from raysweep.worker.run import TrainingRun

    torch.manual_seed(0)
    net = _net(CaptchaCNN(24, 64, 4, 36, dropout=0.0), trial.peak_lr)
    sched = build_scheduler(net.optimizer, trial.peak_lr, 1e-6, trial.warmup_steps, trial.total_steps)
    run = TrainingRun(trial, net, sched, None, None, 0, epochs=trial.train.epochs,
                      resolved=trial.train.time_budget_s is None)
    base = EpochMetrics(**{f.name: 0.0 for f in dataclasses.fields(EpochMetrics) if f.default is dataclasses.MISSING})
    reports, clock = [], 0.0
    for epoch, (seconds, value) in enumerate(epoch_seconds, start=1):
        clock += seconds
        m = dataclasses.replace(base, epoch=epoch, train_seconds=clock, samples_seen=epoch * trial.train_size,
                                val_exact_acc=value)
        run.resolve_epochs(m, seconds)
        run.train_seconds = clock
        reports.append(run.watch_target(m))
    return run, reports


def test_a_time_budget_fixes_the_epochs_and_the_cosine_when_warmup_ends():
    """train.time_budget_s 10, warmup 2 epochs: after epoch 1 (2 s) the estimate is 1 + 8/2 = 5 epochs but still
    open (epoch 2 is all warmup); epoch 2 (1 s, steadier) fixes 2 + 7/1 = 9 epochs and the cosine's end; later
    epochs change nothing. A faster pace gets more epochs, capped at train.epochs; the checkpoint keeps them."""
    from raysweep.config import TargetConfig

    trial = _trial().model_copy(update={
        "knobs": Knobs(per_gpu_batch_size=16, base_lr=3e-3, warmup_epochs=2, weight_decay=0.0, grad_accum_steps=1,
                       lr_rule="none"),
        "train": TrainConfig(epochs=20, time_budget_s=10.0), "target": TargetConfig(metric="val_exact_acc", value=0.7)})
    assert trial.steps_per_epoch == 6 and trial.warmup_steps == 12
    run, _ = _run_with(trial, [(2.0, 0.0)])
    assert (run.epochs, run.resolved) == (5, False)
    run, reports = _run_with(trial, [(2.0, 0.1), (1.0, 0.5), (3.0, 0.9), (1.0, 0.95)])
    assert (run.epochs, run.resolved) == (9, True)
    assert {s.total_steps for s in run.scheduler.lr_lambdas} == {9 * 6}
    fast, _ = _run_with(trial, [(0.5, 0.0), (0.25, 0.0)])
    assert fast.epochs == 20  # 2 + 9.25 / 0.25 = 39, capped at train.epochs
    # the target (0.7) lies between epoch 2 (0.5 at 3 s) and epoch 3 (0.9 at 6 s): halfway, in every later report
    assert [r.time_to_target_s for r in reports] == [None, None, pytest.approx(4.5), pytest.approx(4.5)]
    assert reports[2].epochs_to_target == pytest.approx(2.5)
    assert reports[2].samples_to_target == pytest.approx(2.5 * trial.train_size)
    state = run.state(4, {})
    restored, _ = _run_with(trial, [])
    assert restored.restore(state) == 5
    assert (restored.epochs, restored.resolved, restored.to_target) == (9, True, run.to_target)
    assert {s.total_steps for s in restored.scheduler.lr_lambdas} == {9 * 6}
    # without a budget nothing moves
    plain, _ = _run_with(_trial(), [(100.0, 0.0)])
    assert (plain.epochs, plain.resolved) == (3, True)
