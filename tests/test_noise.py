"""The gradient noise scale against a problem whose answer is known in closed form.

Linear least squares, loss ½(x·w − y)² per example, x ~ N(0, I_d), y = x·w* + ε, ε ~ N(0, σ²). At a fixed
w with δ = w − w*, the per-example gradient g = x xᵀδ − x ε has mean G = δ and (Isserlis) covariance
Σ = (|δ|² + σ²) I + δδᵀ, so |G|² = |δ|², tr(Σ) = d(|δ|² + σ²) + |δ|², B_noise = tr(Σ) / |G|².

The measurement runs through the production path: `GradNoiseMeter` (its DDP communication hook on 2 gloo
ranks, or its per-micro-batch differences on one rank), the training loop's order (backward(s), unscale,
pre-clip norm, `step_done`) and `reduce_metrics` for the per-epoch means and the estimate.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from torch import nn

from raysweep.noise import estimate, recommend
from raysweep.worker.evaluate import EvalSums
from raysweep.worker.noise_meter import GradNoiseMeter
from raysweep.worker.reduce import reduce_metrics
from raysweep.worker.step import TrainSums

from ranks import run_ranks

D, DELTA_SQ, SIGMA_SQ = 8, 1.0, 1.0
TRUE_TRACE = D * (DELTA_SQ + SIGMA_SQ) + DELTA_SQ  # 17
TRUE_NOISE_SCALE = TRUE_TRACE / DELTA_SQ
TOLERANCE = 0.10  # relative, for 4,000 seeded steps (measured: B_noise 17.07, 16.70, 16.73 against 17)


def _measure(rank: int, world: int, micro: int, accum: int, steps: int, scale: float, wrong_split=None,
             every: int | None = None) -> dict:
    """One rank's part: `steps` optimizer steps at a fixed w; returns the reduced estimate (every rank), and
    with `wrong_split` the same sums read as if b_small were b_big / wrong_split (under "wrong")."""
    torch.manual_seed(0)
    model = nn.Linear(D, 1, bias=False).double()
    w_star = torch.zeros(D, dtype=torch.float64)
    with torch.no_grad():
        model.weight.copy_(w_star + torch.full((D,), math.sqrt(DELTA_SQ / D), dtype=torch.float64))
    if world > 1:
        model = nn.parallel.DistributedDataParallel(model)
    meter = GradNoiseMeter.attach(model, torch.device("cpu"))
    meter.every = every or meter.every  # one rank, one micro-batch: which steps add the half's backward
    params = list(model.parameters())
    gen = torch.Generator().manual_seed(1000 + rank)
    for step in range(1, steps + 1):
        measure = meter.measures(step, accum)
        for k in range(accum):
            x = torch.randn(micro, D, generator=gen, dtype=torch.float64)
            y = x @ w_star + math.sqrt(SIGMA_SQ) * torch.randn(micro, generator=gen, dtype=torch.float64)
            sync = k == accum - 1 or world == 1
            meter.before_backward(params, k, accum)
            with contextlib.nullcontext() if sync else model.no_sync():
                loss = 0.5 * ((model(x).squeeze(1) - y) ** 2).mean()
                (loss * scale / accum).backward()  # `scale`: what GradScaler multiplies by under fp16
            meter.after_backward(params, k, accum)
        if measure and meter.needs_half(accum):  # TrainStep.measure_half: the first half's gradient alone
            whole = [p.grad for p in params]
            for p in params:
                p.grad = None
            half = micro // 2
            (0.5 * ((model(x[:half]).squeeze(1) - y[:half]) ** 2).mean() * scale).backward()
            meter.add_half([p.grad for p in params])
            for p, g in zip(params, whole):
                p.grad = g
        for p in params:
            p.grad /= scale  # GradScaler.unscale_
        norm = torch.nn.utils.clip_grad_norm_(params, math.inf)
        if measure:
            meter.step_done(norm, torch.tensor(1.0 / scale, dtype=torch.float64))
        for p in params:
            p.grad = None
    small, big, measured = meter.take()

    def read(split: int) -> dict:
        zero = torch.zeros((), dtype=torch.float64)
        sums = TrainSums(zero, micro * accum * steps, zero, zero.float(), zero, steps, small, big, measured, split)
        m = reduce_metrics(sums, EvalSums(zero, 1, zero, zero, 1), train_time_s=1.0, epoch_time_s=1.0, epoch=1,
                           samples_before=0, lr=0.0, device=torch.device("cpu"))
        return {"grad_noise_scale": m.grad_noise_scale, "grad_sq_norm": m.grad_sq_norm,
                "grad_trace_cov": m.grad_trace_cov}

    result = read(meter.split(accum))
    if wrong_split is not None:
        result["wrong"] = read(wrong_split)
    return result


def _two_ranks(**kwargs) -> dict:
    return run_ranks(_measure, 2, **kwargs)[0]


def _assert_close(result: dict) -> None:
    assert result["grad_sq_norm"] == pytest.approx(DELTA_SQ, rel=TOLERANCE)
    assert result["grad_trace_cov"] == pytest.approx(TRUE_TRACE, rel=TOLERANCE)
    assert result["grad_noise_scale"] == pytest.approx(TRUE_NOISE_SCALE, rel=TOLERANCE)


def test_estimator_inverts_the_model_exactly():
    """|G_b|² = |G|² + tr(Σ)/b in expectation: fed exact expectations, the estimator returns the truth."""
    b, big = 8, 24
    e = estimate(DELTA_SQ + TRUE_TRACE / b, DELTA_SQ + TRUE_TRACE / big, b, big)
    assert (e.grad_sq_norm, e.grad_trace_cov) == (pytest.approx(DELTA_SQ), pytest.approx(TRUE_TRACE))
    assert estimate(1.0, 1.0, 8, 8) is None  # no pair
    assert estimate(3.0, 1.0, 8, 16).grad_noise_scale is None  # |G|² estimated ≤ 0: no ratio, not a number
    assert estimate(1.0, 1.5, 8, 16).grad_noise_scale is None  # tr(Σ) < 0


@pytest.mark.timeout(120)
def test_ddp_hook_on_two_gloo_ranks_recovers_the_known_noise_scale():
    result = _two_ranks(micro=8, accum=1, steps=4000, scale=1.0, wrong_split=4)
    _assert_close(result)
    # the same sums read with b_small = B/4 instead of B/2 (a world-size mix-up) land far from the truth
    assert result["wrong"]["grad_noise_scale"] != pytest.approx(TRUE_NOISE_SCALE, rel=TOLERANCE)
    assert result["wrong"]["grad_trace_cov"] != pytest.approx(TRUE_TRACE, rel=TOLERANCE)


@pytest.mark.timeout(120)
def test_ddp_hook_with_no_sync_accumulation_and_a_loss_scale():
    """b = micro × accum = 8 per rank; the fp16-style scale (2¹⁰) is divided back out on the device."""
    _assert_close(_two_ranks(micro=4, accum=2, steps=4000, scale=1024.0))


def test_one_rank_estimates_from_its_micro_batches():
    _assert_close(_measure(0, 1, micro=4, accum=4, steps=4000, scale=1.0))


def test_one_rank_without_accumulation_estimates_from_a_half_of_its_micro_batch():
    """One GPU, one micro-batch: a measured step adds a backward of half its micro-batch (b = 8 of B = 16): a known
    answer too, with a loss scale; the same sums read as if b_small were B give nothing. (Every step measured
    here, for the test's time; the every-4th cadence is checked on the captcha model below.)"""
    result = _measure(0, 1, micro=16, accum=1, steps=4000, scale=1024.0, wrong_split=1, every=1)
    _assert_close(result)
    assert result["wrong"] == {"grad_noise_scale": None, "grad_sq_norm": None, "grad_trace_cov": None}


def test_recommendation_follows_the_tradeoff():
    """T(B) ∝ (1 + B/B_noise) / throughput(B): throughput nearly flat past 256 makes 256 the fastest."""
    rec = recommend(100.0, {64: 300.0, 128: 500.0, 256: 1000.0, 512: 1100.0, 1024: 1150.0})
    assert rec.fastest.global_batch == 256
    by_batch = {c.global_batch: c for c in rec.candidates}
    assert by_batch[1024].samples == pytest.approx(1 + 1024 / 100)
    assert by_batch[64].steps == pytest.approx(1 + 100 / 64)
    assert by_batch[512].time == pytest.approx(((1 + 512 / 100) / 1100) / ((1 + 256 / 100) / 1000))
    assert min(c.time for c in rec.candidates) == 1.0
    assert recommend(float("nan"), {64: 1.0}) is None and recommend(100.0, {}) is None


def test_a_noise_scale_below_ten_samples_is_printed_with_two_digits_not_as_zero(capsys):
    """A network still learning its output's bias measured B_noise ≈ 0.3 samples (a lazy-layer CNN's quickstart
    sweep): the console said "B_noise ≈ 0 samples", a meter that measured nothing. Whole samples from 10 up."""
    from raysweep.answer.console import print_recommendation
    from raysweep.console import epoch_line
    from raysweep.metrics import names as M

    print_recommendation(recommend(0.3127, {32: 479.0, 64: 489.0}, "best trial t1, epoch 6"))
    out = capsys.readouterr().out
    assert "B_noise ≈ 0.31 samples (best trial t1, epoch 6)" in out and "near B ≈ B_noise ≈ 0.31:" in out, out
    epoch = {M.epoch: 1, M.train_loss: 0.5, M.val_loss: 0.5, M.val_exact_acc: 0.0, M.val_char_acc: 0.1, M.lr: 1e-3,
             M.samples_per_s: 479.0, M.rss_gb: 1.0, M.grad_noise_scale: 0.3127}
    assert "  B_noise 0.31  " in epoch_line(epoch, 6) + "  "
    from raysweep.noise import in_samples

    assert [in_samples(v) for v in (0.3127, 3.456, 9.96, 10.4, 1207.4)] == ["0.31", "3.5", "10", "10", "1,207"]


@pytest.mark.parametrize("accum", [2, 1])
def test_one_rank_meter_leaves_training_unchanged_and_reports_the_estimate(accum):
    """The meter's hand accumulation (each micro-batch's backward alone, summed), and without accumulation its
    extra half-batch backward on every 4th step (BatchNorm's statistics and dropout's RNG put back), train the
    captcha model to the same weights as an unmeasured run, and the epoch's metrics carry B_noise (fp32, one rank)."""
    import numpy as np
    from test_loop_pieces import _net, _trial

    from raysweep.data import CaptchaArrays
    from raysweep.model import CaptchaCNN
    from raysweep.optim import build_scheduler
    from raysweep.worker.evaluate import evaluate
    from raysweep.worker.shard import Shard
    from raysweep.worker.step import train_one_epoch

    rng = np.random.default_rng(0)
    arrays = CaptchaArrays(rng.integers(0, 255, (96, 24, 64), dtype=np.uint8),
                           rng.integers(0, 36, (96, 4), dtype=np.uint8))
    shard = Shard.build(arrays, 36, torch.device("cpu"))
    trial = _trial(batch=16, accum=accum)
    weights, metrics = {}, None
    for measured in (False, True):
        torch.manual_seed(0)
        net = _net(CaptchaCNN(24, 64, 4, 36, dropout=0.0 if accum > 1 else 0.5), trial.peak_lr)
        if measured:
            net.noise = GradNoiseMeter.attach(net.model, torch.device("cpu"))
        sched = build_scheduler(net.optimizer, trial.peak_lr, 1e-6, 0, trial.total_steps)
        sums = train_one_epoch(net, shard, sched, trial, 1, 0)
        weights[measured] = torch.cat([t.detach().flatten().double() for t in net.core.state_dict().values()])  # BN too
        metrics = reduce_metrics(sums, evaluate(net.core, shard, trial), train_time_s=1.0, epoch_time_s=1.0, epoch=1,
                                 samples_before=0, lr=0.0, device=torch.device("cpu"))
    torch.testing.assert_close(weights[True], weights[False], rtol=1e-5, atol=1e-6)
    assert float(sums.noise_steps) == (trial.steps_per_epoch if accum > 1 else 2)  # no accumulation: steps 1 and 5
    assert metrics.grad_sq_norm is not None and metrics.grad_trace_cov is not None
    assert metrics.grad_noise_scale is None or metrics.grad_noise_scale > 0
