"""raysweep's CUDA paths on a real GPU: marked `gpu`, skipped where there is no CUDA device.

`benchmarks/gpu_suite.sh` runs them on a lent GPU machine, which has PyTorch but not Ray, MLflow or captcha:
they drive the rank code (train_loop) in a plain process, as a Ray Train worker would, on random images.

Two ranks on one GPU cannot use NCCL (it refuses two ranks on the same device), so the multi-rank cases run
gloo with CUDA tensors: the same DDP, communication hook and all-reduces of CUDA tensors, over another
transport (gloo stages them through host memory). NCCL itself is not exercised here.
"""

from __future__ import annotations

import dataclasses
import gc
import math

import numpy as np
import pytest
import torch
from torch import nn

from raysweep import train_loop
from raysweep.config import ImageSpec, Knobs, ModelConfig, ScalingConfig, TrainConfig, TrialConfig
from raysweep.data import CaptchaArrays, CaptchaData
from raysweep.optim import build_scheduler
from raysweep.train_loop import FaultInjection, RankModel, Shard, TrainingRun, TrialFailure, probe_step, train_one_epoch
from ranks import run_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none here)"),
    pytest.mark.timeout(150),
]

DEVICE = torch.device("cuda:0")
GiB = 2**30
SMALL = (24, 64)  # (height, width): seconds per test
FULL = (60, 160)  # the users' captchas: what memory figures are about


def _trial(batch=32, accum=1, n=256, precision="fp32", size=SMALL, dropout=0.0, epochs=2, compile=False, world=1):
    height, width = size
    return TrialConfig(
        knobs=Knobs(per_gpu_batch_size=batch, base_lr=2e-3, warmup_epochs=0, weight_decay=1e-4, grad_accum_steps=accum,
                    lr_rule="none"),
        train=TrainConfig(epochs=epochs, precision=precision, compile=compile),
        model=ModelConfig(dropout=dropout), scaling=ScalingConfig(num_workers=world),
        image=ImageSpec(width=width, height=height, length=4, num_classes=36), train_size=n,
    )


def _arrays(n: int, size=SMALL, seed: int = 0) -> CaptchaArrays:
    rng = np.random.default_rng(seed)
    return CaptchaArrays(rng.integers(0, 256, (n, *size), dtype=np.uint8), rng.integers(0, 36, (n, 4), dtype=np.uint8))


def _data(n: int, size=SMALL, val: int = 64) -> CaptchaData:
    return CaptchaData(_arrays(n, size), _arrays(val, size, seed=1), "random")


def _parts(trial: TrialConfig, device: torch.device, arrays: CaptchaArrays, **build):
    net = RankModel.build(trial, device, compile=trial.train.compile, **build)
    scheduler = build_scheduler(net.optimizer, trial.peak_lr, trial.train.min_lr, trial.warmup_steps, trial.total_steps)
    return net, scheduler, Shard.build(arrays, 0, 1, trial.image.num_classes, device)


def _losses(trial: TrialConfig, device: torch.device, arrays: CaptchaArrays) -> tuple[RankModel, list[float]]:
    """Mean training loss of each epoch of raysweep's loop, in-process on `device`."""
    net, scheduler, shard = _parts(trial, device, arrays)
    return net, [float(train_one_epoch(net, shard, scheduler, trial, epoch, 0).loss_sum) / len(shard)
                 for epoch in range(1, trial.train.epochs + 1)]


@pytest.fixture
def exact_fp32():
    """fp32 on the GPU as fp32 on the CPU: no TF32 in convolutions or matmuls while the test runs."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.fixture
def memory_cap():
    """`cap(nbytes)`: what this process's caching allocator may hold on the GPU from now on; lifted afterwards."""
    total = torch.cuda.get_device_properties(DEVICE).total_memory

    def cap(nbytes: float) -> None:
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(min(1.0, nbytes / total), DEVICE)

    yield cap
    torch.cuda.set_per_process_memory_fraction(1.0, DEVICE)
    torch.cuda.empty_cache()


# CPU fp32 against CPU bf16 / fp16 on this setup differed by ≤ 0.06 % (2026-11-22); the GPU's kernels add their
# own rounding, hence the margins
@pytest.mark.parametrize("precision, rel", [("fp32", 2e-3), ("bf16", 2e-2), ("fp16", 1e-2)])
def test_loop_on_cuda_computes_the_cpu_loss(exact_fp32, precision, rel):
    arrays = _arrays(256)
    _, cpu = _losses(_trial(precision="fp32"), torch.device("cpu"), arrays)
    net, gpu = _losses(_trial(precision=precision), DEVICE, arrays)
    assert net.precision == precision and net.scaler.is_enabled() == (precision == "fp16")
    assert next(net.core.parameters()).device.type == "cuda"
    assert gpu == pytest.approx(cpu, rel=rel)  # same initial weights, same batches, 2 epochs of 8 steps
    assert gpu[1] < gpu[0]


def test_auto_precision_is_bf16_on_a_gpu_that_has_it():
    expected = "bf16" if torch.cuda.is_bf16_supported() else "fp32"
    assert RankModel.build(_trial(precision="auto"), DEVICE).precision == expected


def test_shard_lives_on_the_gpu_and_every_sample_is_used_once_per_epoch(monkeypatch):
    arrays = _arrays(250)
    trial = _trial(batch=16, accum=2, n=250)  # 8 steps × 2 micro-batches of 15-16
    net, scheduler, shard = _parts(trial, DEVICE, arrays)
    assert {t.device.type for t in (shard.images, shard.labels, shard.targets)} == {"cuda"}
    assert shard.images.dtype == torch.uint8  # the set stays uint8 on the device; floats are made per batch
    assert torch.equal(shard.images.cpu(), torch.from_numpy(arrays.images))
    seen, batch = [], Shard.batch

    def recording(self, idx):
        assert idx.device.type == "cuda"
        seen.append(idx)
        return batch(self, idx)

    monkeypatch.setattr(Shard, "batch", recording)
    orders = []
    for epoch in (1, 2):
        seen.clear()
        train_one_epoch(net, shard, scheduler, trial, epoch, 0)
        assert len(seen) == trial.micro_batches_per_epoch == 16
        order = torch.cat(seen).cpu()
        assert torch.equal(order.sort().values, torch.arange(250))
        orders.append(order)
    assert not torch.equal(orders[0], orders[1])  # reshuffled each epoch


@pytest.mark.parametrize("precision, nan_at", [("fp32", 3), ("fp16", 3), ("bf16", 8)])
def test_divergence_is_caught_one_step_late(monkeypatch, precision, nan_at):
    """The flag of step k is read after step k+1 is queued (or at the epoch's end, for the last step), so the
    GPU never waits on the host; on a CPU it would be caught at step k itself (scheduler at k − 1)."""
    monkeypatch.setattr(train_loop, "FAULTS", FaultInjection(nan_at_step=nan_at))
    trial = _trial(precision=precision, epochs=1)  # 8 steps
    net, scheduler, shard = _parts(trial, DEVICE, _arrays(256))
    with pytest.raises(TrialFailure, match=rf"at epoch 1, step {nan_at}$") as failure:
        train_one_epoch(net, shard, scheduler, trial, 1, 0)
    assert failure.value.kind == "diverged"
    assert scheduler.last_epoch == nan_at  # step k's optimizer step was taken; step k+1's was not
    if precision == "fp16":  # the scaler skipped the non-finite step: the weights are untouched by it
        assert all(torch.isfinite(p).all() for p in net.core.parameters())


def test_probe_step_hits_a_real_oom_and_gives_the_memory_back(memory_cap):
    trial = _trial(precision="bf16", size=FULL)
    net = RankModel.build(trial, DEVICE, measure_noise=False)
    weights = {k: v.clone() for k, v in net.core.state_dict().items()}
    small = probe_step(net, trial, 64)
    assert small.fits and 0 < small.peak_mem_allocated_gb <= small.peak_mem_reserved_gb
    base = torch.cuda.memory_allocated(DEVICE)
    memory_cap(2 * small.peak_mem_reserved_gb * GiB)  # batch 64 fits twice over; 8192 needs 128× its activations
    big = probe_step(net, trial, 8192)  # a real torch.OutOfMemoryError inside, from the caching allocator
    assert not big.fits
    assert torch.cuda.memory_allocated(DEVICE) - base < 16 * 2**20  # nothing of the failed step is held
    assert not net.optimizer.state and all(p.grad is None for p in net.core.parameters())
    assert all(torch.equal(v, weights[k]) for k, v in net.core.state_dict().items())
    assert probe_step(net, trial, 64).fits  # recovered, under the same cap


def test_training_downshifts_on_a_real_oom_and_trains_under_the_cap(memory_cap):
    n = 2048
    trial = _trial(batch=1024, n=n, precision="bf16", size=FULL, epochs=1)
    sizing = RankModel.build(trial, DEVICE, measure_noise=False)  # what a step costs, uncapped: fixed + per image
    at_128, at_256 = (probe_step(sizing, trial, b).peak_mem_reserved_gb * GiB for b in (128, 256))
    per_image = (at_256 - at_128) / 128
    fixed = at_256 - 256 * per_image
    del sizing
    gc.collect()
    # 512 fits with 40 % of its activations (at least 128 MiB) to spare: the shards, the noise meter's sum;
    # 1024 needs 512 more images' worth, more than that spare
    cap = fixed + 512 * per_image + max(0.4 * 512 * per_image, 128 * 2**20)
    memory_cap(cap)
    run = TrainingRun.build(trial, _data(n, FULL, val=256), 0, 1, DEVICE)
    run.fit_in_memory()  # a real OOM at 1024: halve the micro-batch, double accumulation
    assert run.downshifts == 1 and run.worker_params().downshifts == 1
    assert (run.trial.micro_batch_size, run.trial.accumulation_steps, run.trial.global_batch_size) == (512, 2, 1024)
    metrics = run.epoch(1)
    assert metrics.samples_seen == n and math.isfinite(metrics.train_loss)
    assert metrics.peak_mem_reserved_gb * GiB <= cap * 1.001


def test_epochs_report_the_allocator_peaks():
    peaks = {}
    for batch in (64, 256):
        run = TrainingRun.build(_trial(batch=batch, n=4 * batch, precision="bf16", size=FULL, epochs=1),
                                _data(4 * batch, FULL), 0, 1, DEVICE)
        metrics = run.epoch(1)
        assert 0 < metrics.peak_mem_allocated_gb <= metrics.peak_mem_reserved_gb
        assert metrics.peak_mem_allocated_gb == pytest.approx(torch.cuda.max_memory_allocated(DEVICE) / GiB, rel=1e-3)
        assert run.worker_params().device_name == torch.cuda.get_device_name(DEVICE)
        peaks[batch] = metrics.peak_mem_allocated_gb
        del run
        torch.cuda.empty_cache()
    assert peaks[256] > 1.3 * peaks[64]  # reset each epoch: the peak follows the batch's activations


def test_compile_on_cuda_trains_like_eager(exact_fp32):
    arrays = _arrays(256)
    _, eager = _losses(_trial(), DEVICE, arrays)
    net, compiled = _losses(_trial(compile=True), DEVICE, arrays)
    assert isinstance(net.model, torch._dynamo.eval_frame.OptimizedModule)
    assert compiled == pytest.approx(eager, rel=2e-3)
    # with dropout: the masked-ReLU autograd function and its random bits inside the compiled step, in bf16
    _, dropped = _losses(_trial(compile=True, dropout=0.5, precision="bf16", epochs=3), DEVICE, arrays)
    assert all(map(math.isfinite, dropped)) and dropped[-1] < dropped[0]


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_training_steps_never_make_the_host_wait(precision):
    """torch raises at any host↔device synchronization inside an epoch's steps (sync debug mode "error").
    The divergence check's wait is on the step before the one just queued, which torch does not count."""
    trial = _trial(batch=32, accum=2, n=512, precision=precision, epochs=2)
    net, scheduler, shard = _parts(trial, DEVICE, _arrays(512))
    train_one_epoch(net, shard, scheduler, trial, 1, 0)  # warm-up: cuDNN/cuBLAS handles, the dropout bit table
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        sums = train_one_epoch(net, shard, scheduler, trial, 2, 0)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert math.isfinite(float(sums.loss_sum))


# ---------------------------------------------------------------------------------------------
# Two ranks on one GPU, gloo with CUDA tensors


def _two_rank_cases(rank: int, world: int) -> dict:
    torch.cuda.set_device(0)
    device = torch.device("cuda:0")

    def wrap(model):
        return nn.parallel.DistributedDataParallel(model.to(device))

    out = {}
    # an epoch of DDP with no_sync accumulation, its noise-scale hook and the two metric all-reduces
    trial = _trial(batch=16, accum=2, n=512, precision="bf16", epochs=1, world=world)
    run = TrainingRun.build(trial, _data(512), rank, world, device, wrap=wrap)
    out["metrics"] = dataclasses.asdict(run.epoch(1))
    out["weights"] = [float(p.detach().double().sum()) for p in run.net.core.parameters()]
    # the probe: rank 1 alone runs out of memory (its share capped); every rank must call it OOM
    ok = probe_step(run.net, trial, 64)
    if rank == 1:
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(2 * ok.peak_mem_reserved_gb * GiB / total, device)
    big = probe_step(run.net, trial, 8192)
    again = probe_step(run.net, trial, 64)
    torch.cuda.set_per_process_memory_fraction(1.0, device)
    out["probe"] = (ok.fits, big.fits, again.fits)
    # fp16: a NaN loss on rank 1 alone; the ranks agree through an all-reduce of the flag and stop together
    train_loop.FAULTS = FaultInjection(nan_at_step=3 if rank == 1 else None)
    trial = _trial(batch=16, n=512, precision="fp16", epochs=1, world=world)
    run = TrainingRun.build(trial, _data(512), rank, world, device, wrap=wrap)
    try:
        run.epoch(1)
        out["diverged"] = None
    except TrialFailure as failure:
        out["diverged"] = (failure.kind, str(failure), run.scheduler.last_epoch)
    return out


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(_two_rank_cases, 2)


def test_two_ranks_train_in_lockstep_and_measure_the_noise_scale(two_ranks):
    first, second = two_ranks
    assert first["metrics"] == second["metrics"]  # every figure is all-reduced
    assert first["weights"] == second["weights"]  # DDP: identical steps
    metrics = first["metrics"]
    assert metrics["samples_seen"] == 512 and math.isfinite(metrics["train_loss"])
    assert metrics["grad_sq_norm"] is not None and metrics["grad_trace_cov"] is not None  # the hook's pair
    assert metrics["peak_mem_allocated_gb"] > 0


def test_two_ranks_agree_on_an_oom_that_only_one_of_them_hit(two_ranks):
    assert [r["probe"] for r in two_ranks] == [(True, False, True)] * 2


def test_two_ranks_stop_together_on_a_nan_that_only_one_of_them_saw(two_ranks):
    for r in two_ranks:
        kind, message, last_step = r["diverged"]
        assert (kind, last_step) == ("diverged", 3) and message.endswith("at epoch 1, step 3")
