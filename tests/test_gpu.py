"""raysweep's GPU paths, on the CPU in CI and on CUDA where there is one.

Tests that take `device` run twice: on the CPU (always: CUDA's model path, the "plain" ops, forced there, and the
same step, shard, probe and DDP code) and on cuda:0 (marked `gpu`, skipped without a CUDA device). What only CUDA
has (a real allocator OOM, the host-sync detector, CUDA graphs) is in tests marked `gpu` alone.
`benchmarks/gpu_suite.sh` runs the `gpu` ones on a lent GPU machine, which has PyTorch but not Ray, MLflow or
captcha: they drive the rank code (raysweep/worker) in a plain process, as a Ray Train worker would.

The multi-rank cases run the project's shape, a trial of three ranks, as three processes: on the CPU, and on one
GPU shared by the three. NCCL refuses two ranks on the same device, so they run gloo with CUDA tensors: the same
DDP, communication hook and all-reduces of CUDA tensors, over another transport (gloo stages them through host
memory). NCCL itself is not exercised here.
"""

from __future__ import annotations

import dataclasses
import gc
import math

import numpy as np
import pytest
import torch
from torch import nn

from raysweep.config import ImageSpec, Knobs, ModelConfig, ScalingConfig, TrainConfig, TrialConfig
from raysweep.data import CaptchaArrays, CaptchaData
from raysweep.optim import build_scheduler, lr_at
from raysweep.worker import faults
from raysweep.worker.device import release_trial_memory, resolve_precision, setup_device
from raysweep.worker.faults import FaultInjection, TrialFailure
from raysweep.worker.net import RankModel
from raysweep.worker.probe_step import probe_step
from raysweep.worker.run import TrainingRun
from raysweep.worker.shard import Shard
from raysweep.worker.step import train_one_epoch

from ranks import run_ranks

HAS_CUDA = torch.cuda.is_available()
NEEDS_CUDA = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device (none here)")]
pytestmark = pytest.mark.timeout(240)
gpu_only = pytest.mark.parametrize("device", [pytest.param("cuda", marks=NEEDS_CUDA)], indirect=True)

GiB = 2**30
SMALL = (24, 64)  # (height, width): seconds per test
FULL = (60, 160)  # the users' captchas: what memory figures are about
CPU = torch.device("cpu")


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=NEEDS_CUDA)])
def device(request) -> torch.device:
    return torch.device("cuda:0") if request.param == "cuda" else CPU


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles its own models: dynamo's per-function cache (8 entries) must not fill up across tests."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _trial(batch=32, accum=1, n=256, precision="fp32", size=SMALL, dropout=0.0, epochs=2, compile=False, world=1,
           graphs="auto", warmup=0):
    height, width = size
    return TrialConfig(
        knobs=Knobs(per_gpu_batch_size=batch, base_lr=2e-3, warmup_epochs=warmup, weight_decay=1e-4,
                    grad_accum_steps=accum, lr_rule="none"),
        train=TrainConfig(epochs=epochs, precision=precision, compile=compile, cuda_graphs=graphs),
        model=ModelConfig(dropout=dropout), scaling=ScalingConfig(num_workers=world),
        image=ImageSpec(width=width, height=height, length=4, num_classes=36), train_size=n,
    )


def _arrays(n: int, size=SMALL, seed: int = 0) -> CaptchaArrays:
    rng = np.random.default_rng(seed)
    return CaptchaArrays(rng.integers(0, 256, (n, *size), dtype=np.uint8), rng.integers(0, 36, (n, 4), dtype=np.uint8))


def _data(n: int, size=SMALL, val: int = 64) -> CaptchaData:
    return CaptchaData(_arrays(n, size), _arrays(val, size, seed=1), "random")


def _parts(trial: TrialConfig, device: torch.device, arrays: CaptchaArrays, path="plain", **build):
    """A rank's model (CUDA's model path unless told otherwise, also on the CPU), schedule and shard."""
    net = RankModel.build(trial, device, path=path, **build)
    scheduler = build_scheduler(net.optimizer, trial.peak_lr, trial.train.min_lr, trial.warmup_steps, trial.total_steps)
    return net, scheduler, Shard.build(arrays, trial.image.num_classes, device)


def _losses(trial: TrialConfig, device: torch.device, arrays: CaptchaArrays, path="plain"):
    """Mean training loss of each epoch of raysweep's loop, in-process on `device`."""
    net, scheduler, shard = _parts(trial, device, arrays, path)
    losses = []
    for epoch in range(1, trial.train.epochs + 1):
        sums = train_one_epoch(net, shard, scheduler, trial, epoch, 0)
        losses.append(float(sums.loss_sum) / sums.samples)
    return net, scheduler, losses


def _only_step(net: RankModel):
    return net.train_step


def _segments(device: torch.device) -> str:
    """The caching allocator's segments on `device`, for a failure message: which pool holds how much."""
    rows = [f"{seg['total_size'] / 2**20:.0f} MiB (in use {seg['active_size'] / 2**20:.1f}) "
            f"pool {seg['segment_pool_id']} stream {seg['stream']}"
            for seg in torch.cuda.memory_snapshot() if seg["device"] == device.index]
    return "; ".join(rows) or "none"


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
    cuda = torch.device("cuda:0")
    total = torch.cuda.get_device_properties(cuda).total_memory

    def cap(nbytes: float) -> None:
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(min(1.0, nbytes / total), cuda)

    yield cap
    torch.cuda.set_per_process_memory_fraction(1.0, cuda)
    torch.cuda.empty_cache()


@pytest.fixture
def inject(monkeypatch):
    """`inject(**switches)`: the test-only fault switches (faults.FaultInjection) for this test."""
    def set_faults(**switches):
        monkeypatch.setattr(faults, "FAULTS", FaultInjection(**switches))

    return set_faults


# ---------------------------------------------------------------------------------------------
# The loop on the device


# the reference is the CPU's own kernels in fp32. CPU fp32 against CPU bf16 / fp16 on this setup differed by
# ≤ 0.06 % (2026-11-22); the GPU's kernels add their own rounding, hence the margins. bf16 on the CPU:
# test_loop_pieces.py (emulated on most CPUs, so slow here)
@pytest.mark.parametrize("precision, rel", [("fp32", 2e-3), pytest.param("bf16", 2e-2, marks=NEEDS_CUDA),
                                            ("fp16", 1e-2)])
def test_loop_computes_the_cpu_kernels_loss(device, exact_fp32, precision, rel):
    arrays = _arrays(256)
    _, _, reference = _losses(_trial(precision="fp32"), CPU, arrays, path="cpu")
    net, _, losses = _losses(_trial(precision=precision), device, arrays)
    assert net.precision == precision and net.scaler.is_enabled() == (precision == "fp16")
    assert next(net.core.parameters()).device.type == device.type
    assert losses == pytest.approx(reference, rel=rel)  # same initial weights, same batches, 2 epochs of 8 steps
    assert losses[1] < losses[0]


def test_auto_precision_is_bf16_where_the_device_computes_it(device):
    native = torch.cuda.is_bf16_supported() if device.type == "cuda" else resolve_precision("auto", CPU) == "bf16"
    assert RankModel.build(_trial(precision="auto"), device).precision == ("bf16" if native else "fp32")


def test_shard_lives_on_the_device_in_equal_micro_batches_each_sample_at_most_once(device, monkeypatch):
    arrays = _arrays(250)
    trial = _trial(batch=16, accum=2, n=250, graphs=False)  # 7 whole steps × 2 micro-batches of 16 (26 sit out)
    net, scheduler, shard = _parts(trial, device, arrays)
    assert {t.device.type for t in (shard.images, shard.labels, shard.targets)} == {device.type}
    assert shard.images.dtype == torch.uint8  # the set stays uint8 on the device; floats are made per batch
    assert torch.equal(shard.images.cpu(), torch.from_numpy(arrays.images))
    x, _ = shard.batch(torch.arange(4, device=device))
    assert x.is_contiguous(memory_format=torch.channels_last) and x.stride()[1] == 1  # NHWC strides, one channel
    seen, batch = [], Shard.batch

    def recording(self, idx, channels_last=True):
        assert idx.device.type == device.type and channels_last  # the built-in CNN runs NHWC
        seen.append(idx)
        return batch(self, idx, channels_last)

    monkeypatch.setattr(Shard, "batch", recording)
    orders = []
    for epoch in (1, 2):
        seen.clear()
        sums = train_one_epoch(net, shard, scheduler, trial, epoch, 0)
        assert len(seen) == trial.micro_batches_per_epoch == 14 and {len(i) for i in seen} == {16}
        order = torch.cat(seen).cpu()
        assert len(set(order.tolist())) == len(order) == sums.samples == 224  # each at most once
        orders.append(order)
    assert not torch.equal(orders[0], orders[1])  # reshuffled each epoch


@pytest.mark.parametrize("precision, nan_at", [("fp32", 3), ("fp16", 3), ("bf16", 8)])
def test_divergence_is_caught_at_once_on_a_cpu_and_one_step_late_on_a_gpu(device, inject, precision, nan_at):
    """A GPU reads the flag of step k after step k+1 is queued (or at the epoch's end, for the last step), so it
    never waits on the host: step k's optimizer step was taken. A CPU checks before step k's update."""
    inject(nan_at_step=nan_at)
    trial = _trial(precision=precision, epochs=1)  # 8 steps
    net, scheduler, shard = _parts(trial, device, _arrays(256))
    with pytest.raises(TrialFailure, match=rf"at epoch 1, step {nan_at}$") as failure:
        train_one_epoch(net, shard, scheduler, trial, 1, 0)
    assert failure.value.kind == "diverged"
    assert scheduler.last_epoch == (nan_at if device.type == "cuda" else nan_at - 1)
    if precision == "fp16":  # the scaler skipped the non-finite step: the weights are untouched by it
        assert all(torch.isfinite(p).all() for p in net.core.parameters())


# ---------------------------------------------------------------------------------------------
# Memory: the probe step and the start-up downshift (a real OOM on CUDA, an injected one on the CPU)


def test_probe_step_hits_an_oom_and_gives_everything_back(device, request, inject):
    trial = _trial(precision="bf16" if device.type == "cuda" else "fp32", size=FULL if device.type == "cuda" else SMALL)
    net = RankModel.build(trial, device, measure_noise=False, path="plain")
    weights = {k: v.clone() for k, v in net.core.state_dict().items()}
    small = probe_step(net, trial, 64)
    assert small.fits and small.step_time_s > 0
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    if device.type == "cuda":
        assert 0 < small.peak_mem_allocated_gb <= small.peak_mem_reserved_gb
        # batch 64 fits twice over; 8192 needs 128× its activations: a real OutOfMemoryError from the allocator
        request.getfixturevalue("memory_cap")(2 * small.peak_mem_reserved_gb * GiB)
        big = probe_step(net, trial, 8192)
        assert torch.cuda.memory_allocated(device) - base < 16 * 2**20  # nothing of the failed step is held
    else:
        assert small.peak_rss_gb > 0 and small.peak_mem_allocated_gb == 0
        inject(oom_above=100)
        big = probe_step(net, trial, 128)
    assert not big.fits and big.per_gpu_batch_size in (128, 8192)
    assert not net.optimizer.state and all(p.grad is None for p in net.core.parameters())
    assert all(torch.equal(v, weights[k]) for k, v in net.core.state_dict().items())
    assert probe_step(net, trial, 64).fits  # recovered, under the same cap


def test_training_downshifts_on_an_oom_and_trains_under_it(device, request, inject):
    n = 2048
    cuda = device.type == "cuda"
    size = FULL if cuda else SMALL
    trial = _trial(batch=1024, n=n, precision="bf16" if cuda else "fp32", size=size, epochs=1)
    cap = None
    if cuda:  # what a step costs, uncapped: fixed + per image; then a cap that 512 fits under and 1024 does not
        sizing = RankModel.build(trial, device, measure_noise=False)
        at_128, at_256 = (probe_step(sizing, trial, b).peak_mem_reserved_gb * GiB for b in (128, 256))
        per_image = (at_256 - at_128) / 128
        fixed = at_256 - 256 * per_image
        del sizing
        gc.collect()
        # 512 fits with 40 % of its activations (at least 128 MiB) to spare: the shards, the noise meter's sum
        cap = fixed + 512 * per_image + max(0.4 * 512 * per_image, 128 * 2**20)
        request.getfixturevalue("memory_cap")(cap)
    else:
        inject(oom_above=512)
    run = TrainingRun.build(trial, _data(n, size, val=256), 0, 1, device, path="plain")
    run.fit_in_memory()  # an OOM at 1024: halve the micro-batch, double accumulation
    assert run.downshifts == 1 and run.worker_params().oom_downshifts == 1
    assert (run.trial.micro_batch_size, run.trial.accumulation_steps, run.trial.global_batch_size) == (512, 2, 1024)
    assert run.worker_params().micro_batch_size == run.micro_batch == 512
    metrics = run.epoch(1)
    assert metrics.samples_seen == n and math.isfinite(metrics.train_loss)
    if cap is not None:
        assert metrics.peak_mem_reserved_gb * GiB <= cap * 1.001


def test_epochs_report_the_memory_they_used(device):
    peaks = {}
    size = FULL if device.type == "cuda" else SMALL  # the users' images on a GPU; seconds on a CPU
    for batch in (64, 256):
        run = TrainingRun.build(_trial(batch=batch, n=4 * batch, precision="bf16" if device.type == "cuda" else "fp32",
                                       size=size, epochs=1), _data(4 * batch, size), 0, 1, device)
        metrics = run.epoch(1)
        assert metrics.rss_gb > 0
        if device.type == "cuda":
            assert 0 < metrics.peak_mem_allocated_gb <= metrics.peak_mem_reserved_gb
            peak_gb = torch.cuda.max_memory_allocated(device) / GiB
            assert metrics.peak_mem_allocated_gb == pytest.approx(peak_gb, rel=1e-3)
            assert run.worker_params().device_name == torch.cuda.get_device_name(device)
        else:
            assert metrics.peak_mem_allocated_gb == metrics.peak_mem_reserved_gb == 0
            assert run.worker_params().device_name.startswith("cpu (")
        peaks[batch] = metrics.peak_mem_allocated_gb
        del run
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if device.type == "cuda":
        assert peaks[256] > 1.3 * peaks[64]  # reset each epoch: the peak follows the batch's activations


# ---------------------------------------------------------------------------------------------
# Compiled


def test_compiled_step_trains_like_eager_and_counts_its_compile_time(device, exact_fp32):
    arrays = _arrays(256)
    eager_net, _, eager = _losses(_trial(graphs=False), device, arrays)
    net, _, compiled = _losses(_trial(compile=True, graphs=False), device, arrays)
    assert not eager_net.compiled and eager_net.compile_s == 0
    assert net.compiled and isinstance(net.step_core.compiled, torch._dynamo.eval_frame.OptimizedModule)
    assert compiled == pytest.approx(eager, rel=2e-3)
    assert net.compile_s > 0  # the first call compiled
    before = net.compile_s
    probe_step(net, _trial(compile=True, graphs=False), 32)  # the same shape: no second compile
    assert net.compile_s == before
    # with dropout: the one-bit masks inside the compiled step (bf16 on a GPU)
    precision = "bf16" if device.type == "cuda" else "fp32"
    _, _, dropped = _losses(_trial(compile=True, dropout=0.5, precision=precision, epochs=3), device, arrays)
    assert all(map(math.isfinite, dropped)) and dropped[-1] < dropped[0]


# ---------------------------------------------------------------------------------------------
# CUDA only: no host sync in the step, CUDA graphs


@gpu_only
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_training_steps_never_make_the_host_wait(device, precision):
    """torch raises at any host↔device synchronization inside an epoch's steps (sync debug mode "error").
    The divergence check's wait is on the step before the one just queued, which torch does not count."""
    trial = _trial(batch=32, accum=2, n=512, precision=precision, epochs=2)
    net, scheduler, shard = _parts(trial, device, _arrays(512))
    train_one_epoch(net, shard, scheduler, trial, 1, 0)  # warm-up: cuDNN/cuBLAS handles, the graph's capture
    assert (_only_step(net).graph is not None) == (precision != "fp16")  # fp16: GradScaler reads the host
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        sums = train_one_epoch(net, shard, scheduler, trial, 2, 0)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert math.isfinite(float(sums.loss_sum))


@gpu_only
@pytest.mark.parametrize("compile", [False, True])
def test_cuda_graph_steps_train_like_eager_ones_and_follow_the_schedule(device, exact_fp32, compile):
    arrays = _arrays(256)
    trials = {graphs: _trial(graphs=graphs, compile=compile, warmup=1, epochs=3) for graphs in (False, True)}
    runs = {graphs: _losses(trial, device, arrays) for graphs, trial in trials.items()}
    (eager_net, _, eager), (net, sched, graphed) = runs[False], runs[True]
    assert _only_step(eager_net).graph is None and _only_step(net).graph is not None
    assert graphed == pytest.approx(eager, rel=1e-4)  # the same kernels, replayed
    trial = trials[True]
    expected = lr_at(sched.last_epoch, trial.peak_lr, trial.train.min_lr, trial.warmup_steps, trial.total_steps)
    assert float(net.optimizer.param_groups[0]["lr"]) == pytest.approx(expected, rel=1e-6)  # the LR the graph read
    assert float(net.optimizer.param_groups[0]["lr"]) == pytest.approx(float(eager_net.optimizer.param_groups[0]["lr"]))
    assert net.compile_s > 0  # the capture counts


@gpu_only
def test_dropout_masks_are_drawn_anew_on_every_replay_and_follow_the_seed(device):
    """A captured step's random numbers come from the generator's state at each replay, not from the capture:
    every step gets new masks, and an epoch-derived `torch.manual_seed` (resume) replays them exactly."""
    trial = _trial(dropout=0.5, precision="bf16", compile=True)
    net = RankModel.build(trial, device, measure_noise=False)
    x = torch.rand(32, 1, *SMALL, device=device)
    net.core.train()
    with torch.autocast("cuda", torch.bfloat16):
        net.step_core(x)  # compile outside the capture
        graph, out = torch.cuda.CUDAGraph(), None
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            net.step_core(x)
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            out = net.step_core(x)
    replays = []
    for seed in (1, None, 1):
        if seed is not None:
            torch.manual_seed(seed)
        graph.replay()
        replays.append(out.clone())
    assert not torch.equal(replays[0], replays[1]) and torch.equal(replays[0], replays[2])


@gpu_only
def test_the_noise_meter_measures_inside_a_graph(device, exact_fp32):
    """One rank with two micro-batches per step: the pair of gradients the noise scale needs, in a graph too."""
    arrays = _arrays(256)
    sums = {}
    for graphs in (False, True):
        trial = _trial(batch=16, accum=2, graphs=graphs, epochs=1)
        net, scheduler, shard = _parts(trial, device, arrays)
        sums[graphs] = train_one_epoch(net, shard, scheduler, trial, 1, 0)
        assert (_only_step(net).graph is not None) == graphs
    for name in ("noise_small", "noise_big", "noise_steps"):
        assert float(getattr(sums[True], name)) == pytest.approx(float(getattr(sums[False], name)), rel=1e-4)
    assert float(sums[True].noise_steps) == 8 and sums[True].noise_split == 2


@gpu_only
def test_one_rank_measures_the_noise_scale_by_halves_between_graph_replays(device, exact_fp32):
    """One rank, one micro-batch, CUDA graphs: every 4th step runs eagerly with the meter's half-batch backward
    (steps 1, 5, 9, 13 of 16), the others replay the graph; the sums and the weights match an eager epoch (the CPU
    runs this path eagerly in tests/test_noise.py)."""
    arrays = _arrays(256)
    sums, weights = {}, {}
    for graphs in (False, True):
        trial = _trial(batch=16, accum=1, graphs=graphs, epochs=1)
        net, scheduler, shard = _parts(trial, device, arrays)
        sums[graphs] = train_one_epoch(net, shard, scheduler, trial, 1, 0)
        weights[graphs] = torch.cat([t.detach().flatten().double() for t in net.core.state_dict().values()])
        assert (_only_step(net).graph is not None) == graphs
    for name in ("noise_small", "noise_big", "noise_steps"):
        assert float(getattr(sums[True], name)) == pytest.approx(float(getattr(sums[False], name)), rel=1e-4)
    assert float(sums[True].noise_steps) == 4 and sums[True].noise_split == 2
    # AdamW divides each gradient by its own running scale: a weight whose gradient is ~0 takes a step of up to the
    # LR of either sign on a rounding difference (a replay may run other cuBLAS kernels than the eager call). On an
    # H200, 253 and then 311 of 1.78 M weights differed, by at most 0.0030 (LR 0.002); a replay that trained
    # anything else (a stale input, LR or gradient) moves most weights
    diff = (weights[True] - weights[False]).abs()
    differ = int((diff > 1e-5).sum())
    print(f"graphs vs eager: {differ} of {diff.numel()} weights differ, by at most {float(diff.max()):.2e}")
    assert float(diff.max()) <= 4 * trial.peak_lr
    assert differ < 1e-3 * diff.numel()


# ---------------------------------------------------------------------------------------------
# Three ranks (gloo), a trial's shape: CPU tensors on the CPU, CUDA tensors on one GPU that the three share

WORLD = 3


def _rank_cases(rank: int, world: int, device_type: str) -> dict:
    cuda = device_type == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    device = torch.device("cuda:0" if cuda else "cpu")
    setup_device(device, share=1 / world if cuda else 1.0)  # as a rank of scaling.workers_per_gpu: 3 sets itself up

    def wrap(model):
        return nn.parallel.DistributedDataParallel(model.to(device))

    out = {}
    # an epoch of DDP with no_sync accumulation, its noise-scale hook and the two metric all-reduces
    trial = _trial(batch=16, accum=2, n=512, precision="bf16" if cuda else "fp32", epochs=1, world=world)
    run = TrainingRun.build(trial, _data(512), rank, world, device, wrap=wrap, path="plain")
    out["metrics"] = dataclasses.asdict(run.epoch(1))
    out["weights"] = [float(p.detach().double().sum()) for p in run.net.core.parameters()]
    # the probe: rank 1 alone runs out of memory (its share of the GPU capped; on the CPU, injected); every rank
    # must call it OOM (the outcome is all-reduced: a MAX over three, where two of them fit)
    big = 8192 if cuda else 256
    ok = probe_step(run.net, trial, 64)
    if cuda:  # what the probe counts as this rank's memory: its third of the device
        out["share"] = ok.device_memory_gb * GiB / torch.cuda.get_device_properties(device).total_memory
    if rank == 1:
        if cuda:
            torch.cuda.empty_cache()
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(2 * ok.peak_mem_reserved_gb * GiB / total, device)
        else:
            faults.FAULTS = FaultInjection(oom_above=128)
    big = probe_step(run.net, trial, big)
    again = probe_step(run.net, trial, 64)
    if cuda:
        torch.cuda.set_per_process_memory_fraction(1 / world, device)
    out["probe"] = (ok.fits, big.fits, again.fits)
    # fp16: a NaN loss on rank 1 alone; the ranks agree through an all-reduce of the flag and stop together
    faults.FAULTS = FaultInjection(nan_at_step=3 if rank == 1 else None)
    trial = _trial(batch=16, n=512, precision="fp16", epochs=1, world=world)
    run = TrainingRun.build(trial, _data(512), rank, world, device, wrap=wrap, path="plain")
    try:
        run.epoch(1)
        out["diverged"] = None
    except TrialFailure as failure:
        out["diverged"] = (failure.kind, str(failure), run.scheduler.last_epoch)
    return out


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=NEEDS_CUDA)])
def ranks(request):
    return request.param, run_ranks(_rank_cases, WORLD, device_type=request.param)


def test_three_ranks_train_in_lockstep_and_measure_the_noise_scale(ranks):
    device_type, results = ranks
    assert len(results) == WORLD
    first = results[0]
    for other in results[1:]:
        assert other["metrics"] == first["metrics"]  # every figure is all-reduced
        assert other["weights"] == first["weights"]  # DDP: identical steps
    metrics = first["metrics"]
    # each rank's equal share of the 512, in whole steps of its per-rank batch 16: 3 × 10 × 16
    assert metrics["samples_seen"] == WORLD * (512 // WORLD // 16) * 16 == 480
    assert math.isfinite(metrics["train_loss"])
    assert metrics["grad_sq_norm"] is not None and metrics["grad_trace_cov"] is not None  # the hook's pair
    assert (metrics["peak_mem_allocated_gb"] > 0) == (device_type == "cuda")


def test_three_ranks_agree_on_an_oom_that_only_one_of_them_hit(ranks):
    assert [r["probe"] for r in ranks[1]] == [(True, False, True)] * WORLD
    if ranks[0] == "cuda":  # each rank's allocator capped to its third (setup_device), and the probe counting that
        assert [r["share"] for r in ranks[1]] == [pytest.approx(1 / WORLD, rel=1e-3)] * WORLD


def test_three_ranks_stop_together_on_a_nan_that_only_one_of_them_saw(ranks):
    device_type, results = ranks
    step = 3 if device_type == "cuda" else 2  # one step late on a GPU, at once on a CPU
    for r in results:
        kind, message, last_step = r["diverged"]
        assert (kind, last_step) == ("diverged", step) and message.endswith("at epoch 1, step 3")


# ---------------------------------------------------------------------------------------------
# A user's model (tests/user_models.py) on the same paths: compiled where it can be, eager where not, and said


def _user(trial: TrialConfig, factory: str) -> TrialConfig:
    return trial.model_copy(update={"model": ModelConfig(factory=f"user_models:{factory}")})


def test_a_user_model_that_cannot_be_compiled_trains_eager_and_says_why(device):
    """A custom op with no fake implementation: torch.compile raises at the first call (Dynamo cannot trace it).
    The trial runs that model eagerly, with the same losses as a trial that never compiled, and the fallback is
    recorded (metrics.COMPILE_FAILED), not a failed trial."""
    from raysweep.metrics import COMPILE_FAILED

    trial = _user(_trial(compile=True, graphs=False), "uncompilable")
    net, _, compiled_losses = _losses(trial, device, _arrays(256), path=None)
    assert net.compiled and net.eager_fallback == COMPILE_FAILED and net.step_core.compiled is None
    _, _, eager_losses = _losses(_user(_trial(compile=False, graphs=False), "uncompilable"), device, _arrays(256),
                                 path=None)
    assert all(math.isfinite(v) for v in compiled_losses)
    np.testing.assert_allclose(compiled_losses, eager_losses, rtol=1e-5 if device.type == "cuda" else 0)


def test_a_user_model_compiles_and_trains_as_eager_does(device):
    """A user model that compiles: its compiled step trains as its eager one (no fallback)."""
    trial = _user(_trial(compile=True, graphs=False), "tiny")
    net, _, compiled = _losses(trial, device, _arrays(256), path=None)
    assert net.compiled and not net.eager_fallback and net.compile_s > 0
    _, _, eager = _losses(_user(_trial(compile=False, graphs=False), "tiny"), device, _arrays(256), path=None)
    np.testing.assert_allclose(compiled, eager, rtol=1e-3)


@gpu_only
def test_a_user_model_that_cannot_be_captured_runs_its_steps_eager_and_says_why(device):
    """A forward that reads a value back to the host (`.item()`) cannot be captured as a CUDA graph: the capture
    raises, the trial's steps run eagerly from there on (metrics.CAPTURE_FAILED), and it trains every epoch."""
    from raysweep.metrics import CAPTURE_FAILED

    trial = _user(_trial(compile=False, graphs=True, epochs=3), "host_syncing")
    net, scheduler, losses = _losses(trial, device, _arrays(256), path=None)
    assert net.eager_fallback == CAPTURE_FAILED and not net.train_step.graphs
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
    # the process goes on as a warm slot's does: the next trial's random ops (dropout, the probe's random batch)
    # run; a failed capture once left the device's RNG in capture mode, and they all raised
    # and what the failed capture held goes back to the allocator: the next trial's graph and memory are its own.
    # A trial is dropped whole: its scheduler holds the optimizer, and with it the weights, gradients and moments
    # (kept by a name here, they left 42 MiB reserved on an H200, over the bound)
    del net, scheduler
    release_trial_memory(device)
    reserved = torch.cuda.memory_reserved(device)
    after = _trial(dropout=0.5, graphs=True)
    next_net, next_scheduler, next_losses = _losses(after, device, _arrays(256))
    assert all(math.isfinite(v) for v in next_losses) and next_net.train_step.graphs
    assert probe_step(next_net, after, 32).fits
    del next_net, next_scheduler
    release_trial_memory(device)
    grown = torch.cuda.memory_reserved(device) - reserved
    assert grown <= 32 * 2**20, f"{grown / 2**20:.1f} MiB more reserved: {_segments(device)}"
    # a later trial of the same model in this process does not try to capture it again
    again, _, _ = _losses(trial, device, _arrays(256), path=None)
    assert again.eager_fallback == CAPTURE_FAILED and not again.train_step.graphs
