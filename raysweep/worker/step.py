"""The training step and one epoch of it: accumulation, clipping, the optimizer, the divergence check.

A step runs eagerly or, where `device.resolve_graphs` says so, as a CUDA graph: the same code, captured once
(after two eager warm-up steps that initialize the optimizer's state and cuDNN's choices) and then replayed
with each step's micro-batch indices copied into its input buffer. Every figure the epoch reports accumulates
on the device in buffers the graph writes in place; nothing in a step waits for the host.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from raysweep.config import TrialConfig
from raysweep.metrics import CAPTURE_FAILED
from raysweep.worker import faults
from raysweep.worker.device import autocast, distributed, resolve_graphs
from raysweep.worker.faults import TrialFailure
from raysweep.worker.net import RankModel
from raysweep.worker.shard import Shard, epoch_plan, plan_to_device

log = logging.getLogger(__name__)

LOSS_FN = nn.MultiLabelSoftMarginLoss()  # mean over batch and classes, on one-hot targets
GRAPH_WARMUP_STEPS = 2  # eager steps before the capture: AdamW's state, cuDNN's algorithms, autograd's streams
UNCAPTURABLE: set[str] = set()  # models (name and kwargs) whose step failed to capture in this process: run eager


def _undo_capture(pool, generator, rng_before, device: torch.device) -> None:
    """What a capture that failed midway leaves in the process, undone. The device's RNG stays in capture mode:
    every later random op (the next trial's dropout, the probe's random batch) raised "Offset increment outside
    graph capture encountered unexpectedly" (seen on an H200): its state from before the capture goes back. The
    caching allocator keeps the capture in its `captures_underway` and keeps the graph's private pool (torch's
    CUDAGraph::capture_end, aten/src/ATen/cuda/CUDAGraph.cpp, ends both only after cudaStreamEndCapture succeeds).
    While a capture is listed as underway, the allocator defers every freed block that another stream used
    (c10/cuda/CUDACachingAllocator.cpp, `needs_events_deferred_until_no_capture`) and empty_cache cannot give it
    back: on an H200 every later trial of the process left 208-798 MiB reserved. Both are ended here by `pool`,
    the id the capture was given (CUDAGraph::pool() refuses a capture that did not end), where this torch has the
    calls (2.8 and later)."""
    generator.graphsafe_set_state(rng_before)
    index = device.index if device.index is not None else 0
    end, release = getattr(torch._C, "_cuda_endAllocateToPool", None), getattr(torch._C, "_cuda_releasePool", None)
    if end is not None and release is not None:
        try:
            end(index, pool)
            release(index, pool)
        except Exception as e:  # noqa: BLE001 - a capture that failed before it had a pool
            log.debug("releasing a failed capture's memory pool: %s", e)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()


@dataclass
class TrainSums:
    """One rank's epoch, as sums on the device (no host sync until `reduce_metrics`)."""

    loss_sum: torch.Tensor  # Σ loss × micro-batch size
    samples: int
    grad_norm_sum: torch.Tensor  # Σ pre-clip global norm over optimizer steps
    grad_norm_max: torch.Tensor
    clipped_steps: torch.Tensor
    optimizer_steps: int
    noise_small: torch.Tensor | float = 0.0  # Σ over steps of |G_b|² (GradNoiseMeter), this rank
    noise_big: torch.Tensor | float = 0.0  # Σ over the same steps of |G_B|²
    noise_steps: torch.Tensor | float = 0.0  # steps measured
    noise_split: int = 1  # b_big / b_small (1: no pair, no estimate)
    graph_peak_bytes: int = 0  # a CUDA graph's step: the allocator's peak at its capture (replays allocate nothing)


class TrainStep:
    """One optimizer step of one rank at a fixed micro-batch size and accumulation, eager or a CUDA graph.

    It holds the parts of `net` it runs (model, optimizer, scaler, compile clock), never `net` itself: `net` holds
    the step (RankModel.train_step), and a back-reference would make a cycle that keeps a finished trial's model,
    optimizer and graph alive until the garbage collector happens to run."""

    def __init__(self, net: RankModel, shard: Shard, trial: TrialConfig, micro_batch: int):
        device = net.device
        self.model, self.optimizer, self.scaler, self.clock = net.model, net.optimizer, net.scaler, net.clock
        self.device, self.precision = device, net.precision
        self.shard, self.micro_batch, self.channels_last = shard, micro_batch, net.channels_last
        self.accum = trial.accumulation_steps
        self.max_norm = trial.train.grad_clip if trial.train.grad_clip is not None else math.inf
        self.params = [p for p in net.model.parameters() if p.requires_grad]
        self.distributed = distributed()
        self.graphs = resolve_graphs(trial.train.cuda_graphs, device, net.precision,
                                     dist.get_world_size() if self.distributed else 1, micro_batch)
        self.model_key = f"{trial.model.name} {json.dumps(trial.model.factory_kwargs(), sort_keys=True)}"
        if self.graphs and self.model_key in UNCAPTURABLE:  # this process already failed to capture this model
            self.graphs = False
            self.clock.fell_back(CAPTURE_FAILED, f"{trial.model.name}'s step could not be captured as a CUDA graph in "
                                                 f"an earlier trial of this process")
        self.noise = net.noise if net.noise is not None and net.noise.split(self.accum) > 1 else None
        # a CUDA graph holds the step as captured: with the meter where its pair comes free (DDP, micro-batches);
        # one rank's half-batch measurement runs eagerly on the steps it measures, between replays
        self.captured_measures = self.noise is not None and not self.noise.needs_half(self.accum)
        # the epoch's sums, written in place by every step (a graph's outputs must live at fixed addresses)
        zero = torch.zeros((), device=device, dtype=torch.float64)
        self.loss_sum, self.grad_norm_sum, self.clipped = zero.clone(), zero.clone(), zero.clone()
        self.grad_norm_max = torch.zeros((), device=device, dtype=torch.float32)
        self.bad = torch.zeros((), device=device, dtype=torch.bool)
        # a NaN injected at one step (tests): a factor on the loss, filled before each step, only when switched on
        self.fault = torch.ones((), device=device) if faults.FAULTS.nan_at_step is not None else None
        self.idx = torch.zeros((self.accum, micro_batch), dtype=torch.int64, device=device)  # the graph's input
        self.graph: torch.cuda.CUDAGraph | None = None
        self.graph_peak_bytes = 0  # the allocator's peak during the capture: what the graph's pool holds
        self.eager_steps = 0

    def runs(self, shard: Shard, micro_batch: int, accum: int) -> bool:
        """Whether this step's buffers (and graph) fit an epoch of `shard` at this shape."""
        return self.shard is shard and self.micro_batch == micro_batch and self.accum == accum

    def begin_epoch(self) -> None:
        for t in (self.loss_sum, self.grad_norm_sum, self.clipped, self.grad_norm_max, self.bad):
            t.zero_()
        if self.noise is not None:
            self.noise.take()  # a fresh epoch (a failed epoch might have left sums)

    def __call__(self, idx: torch.Tensor, step: int, watch: DivergenceWatch, epoch: int) -> None:
        """Optimizer step `step` (1-based, for the divergence message and the fault switch) on micro-batches
        `idx` (accum, micro_batch) of shard indices on the device."""
        if self.fault is not None:
            self.fault.fill_(faults.FAULTS.loss_factor(step))
        measure = self.noise is not None and self.noise.measures(step, self.accum)
        if not self.graphs:
            self.gradients(idx, measure)
            watch.check(self.bad, epoch, step)  # before the update: on a CPU a bad step is never applied
            self.update()
            return
        self.idx.copy_(idx)
        if self.graph is None and self.eager_steps < GRAPH_WARMUP_STEPS:
            self._warm_up(measure)
        elif measure and not self.captured_measures:  # the half: this step eagerly, the graph's buffers untouched
            self.gradients(self.idx, True)
            self.update()
        elif self.graph is None and not self._capture():  # the model cannot be captured: this step and the rest eager
            self.gradients(self.idx, measure)
            self.update()
        else:
            self.graph.replay()
        watch.check(self.bad, epoch, step)

    def gradients(self, idx: torch.Tensor, measure: bool = False) -> None:
        """Forward and backward over the step's micro-batches, clip; the step's figures into the epoch's sums.
        `measure`: the noise meter measures this step."""
        accum, model, scaler, device = self.accum, self.model, self.scaler, self.device
        noise = self.noise if measure else None
        fp16 = scaler.is_enabled()
        step_loss = torch.zeros((), device=device) if fp16 else None
        for micro in range(accum):
            x, y = self.shard.batch(idx[micro], self.channels_last)
            # DDP all-reduces gradients in backward; skip it on all but the last micro-step
            sync = micro == accum - 1 or not hasattr(model, "no_sync")
            if noise is not None:
                noise.before_backward(self.params, micro, accum)
            with contextlib.nullcontext() if sync else model.no_sync():
                with autocast(device, self.precision):
                    logits = model(x)
                loss = LOSS_FN(logits.float().flatten(1), y)  # (N, length, classes) or flat: one row per image
                if self.fault is not None:
                    loss = loss * self.fault
                scaler.scale(loss / accum).backward()
            if noise is not None:
                noise.after_backward(self.params, micro, accum)
            self.loss_sum += loss.detach() * self.micro_batch
            if fp16:
                step_loss += loss.detach()
        if noise is not None and noise.needs_half(accum):
            self.measure_half(x, y)
        scaler.unscale_(self.optimizer)  # clip and log the true norm, not the fp16-scaled one
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_norm)
        if noise is not None:  # the scale the gradients were multiplied by, read on the device (no sync)
            noise.step_done(norm, 1.0 / scaler._get_scale_async().double() if fp16 else 1.0)
        # the norm is of the all-reduced gradients: every rank sees the same value and stops together
        bad = ~torch.isfinite(norm)
        if fp16:  # the scaler skips overflowing steps by design: there, a non-finite loss is divergence
            bad = ~torch.isfinite(step_loss)
            if self.distributed:  # losses are per rank: agree (read a step late on GPUs, like the rest)
                bad = bad.float()
                dist.all_reduce(bad, op=dist.ReduceOp.MAX)
                bad = bad > 0
        self.bad.copy_(bad)
        self.grad_norm_sum += norm
        torch.maximum(self.grad_norm_max, norm.float(), out=self.grad_norm_max)
        self.clipped += norm > self.max_norm

    def measure_half(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """One rank, one micro-batch: the gradient of the micro-batch's first half alone, for the noise meter, out of
        the step's way: the step's gradient is stashed and put back, BatchNorm's running statistics and the RNG
        (dropout) are as they were, so the step trains exactly as an unmeasured one."""
        model, device = self.model, self.device
        half = x.shape[0] // 2
        grads = [p.grad for p in self.params]
        buffers = [b.clone() for b in model.buffers()]
        for p in self.params:
            p.grad = None
        # the CPU generator is always forked; a GPU's only when named. device_type stays "cuda" on a CPU too (no
        # CUDA device is named, none is touched): torch 2.11's fork_rng refuses None (torch/random.py)
        cuda = device.type == "cuda"
        with torch.random.fork_rng(devices=[device] if cuda else [], device_type="cuda"):
            with autocast(device, self.precision):
                logits = model(x[:half])
            self.scaler.scale(LOSS_FN(logits.float().flatten(1), y[:half])).backward()
        self.noise.add_half([p.grad for p in self.params if p.grad is not None])
        for p, g in zip(self.params, grads):
            p.grad = g
        with torch.no_grad():
            for b, saved in zip(model.buffers(), buffers):
                b.copy_(saved)

    def update(self) -> None:
        scaler, optimizer = self.scaler, self.optimizer
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

    def _warm_up(self, measure: bool) -> None:
        """An eager step on a side stream, as capturing requires: it allocates what the graph will not."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self.gradients(self.idx, measure)
            self.update()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        self.eager_steps += 1

    def _capture(self) -> bool:
        """Record one whole step (gradients and update) as a CUDA graph; its time counts as compile time. False:
        the step cannot be captured (a model that syncs with the host in its forward, `.item()`, a shape read from a
        tensor, ...): the trial's steps run eagerly from now on, recorded (metrics.CAPTURE_FAILED), and this
        process captures that model no more (UNCAPTURABLE). The failed capture wrote nothing the eager steps read:
        gradients are zeroed before every step, and the update reads the gradients only after a completed
        backward."""
        graph = torch.cuda.CUDAGraph()
        pool = torch.cuda.graph_pool_handle()  # named here: a failed capture has no graph.pool() to ask

        def capture():
            with torch.cuda.graph(graph, pool=pool):
                self.gradients(self.idx, self.captured_measures)
                self.update()

        generator = torch.cuda.default_generators[self.device.index if self.device.index is not None else 0]
        rng_before = generator.clone_state()
        try:
            self.clock.time(capture)
        except Exception as e:  # CUDA's capture errors are RuntimeErrors like any other
            _undo_capture(pool, generator, rng_before, self.device)
            if isinstance(e, torch.OutOfMemoryError):
                raise
            self.graphs = False
            UNCAPTURABLE.add(self.model_key)
            self.optimizer.zero_grad(set_to_none=True)
            text = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
            self.clock.fell_back(CAPTURE_FAILED, f"the step could not be captured as a CUDA graph: "
                                                 f"{type(e).__name__}: {text}")
            return False
        self.graph = graph
        self.graph_peak_bytes = torch.cuda.max_memory_allocated(self.device)
        return True

    def sums(self, samples: int, steps: int) -> TrainSums:
        """The epoch's sums, copied out of the buffers the next epoch overwrites."""
        out = TrainSums(self.loss_sum.clone(), samples, self.grad_norm_sum.clone(), self.grad_norm_max.clone(),
                        self.clipped.clone(), steps, graph_peak_bytes=self.graph_peak_bytes)
        if self.noise is not None:
            small, big, measured = self.noise.take()
            out = dataclasses.replace(out, noise_small=small, noise_big=big, noise_steps=measured,
                                      noise_split=self.noise.split(self.accum))
        return out


def train_one_epoch(net: RankModel, shard: Shard, scheduler, trial: TrialConfig, epoch: int, rank: int) -> TrainSums:
    """One pass over the rank's share of the training set (`shard`: all of it, shard.epoch_plan deals the shares);
    returns on-device sums (no host sync inside, but the graph's capture)."""
    num_batches, micro_batch, accum = trial.micro_batches_per_epoch, trial.micro_batch_size, trial.accumulation_steps
    if len(shard) != trial.train_size:
        raise ValueError(f"a training set of {len(shard)} samples, where the trial was planned for train_size "
                         f"{trial.train_size}: its steps per epoch and schedule would not describe this data")
    plan = plan_to_device(epoch_plan(len(shard), num_batches, micro_batch, trial.train.seed, epoch, rank,
                                     trial.world_size), net.device)
    faults.FAULTS.check_oom(micro_batch)  # what runs, as the probe step checks it
    train_step = net.train_step
    if train_step is None or not train_step.runs(shard, micro_batch, accum):
        net.train_step = None  # a downshift or a new shard: the old step's graph and buffers go first
        net.train_step = train_step = TrainStep(net, shard, trial, micro_batch)
    train_step.begin_epoch()
    watch = DivergenceWatch(net.device)
    net.model.train()
    for step in range(trial.steps_per_epoch):
        batches = plan[step * accum:(step + 1) * accum]
        if step == 0:  # may be the compiled step's first call at this shape (where the probe step was not)
            # call_step calls the lambda before returning (this iteration); the default binds this step's batches
            net.call_step(micro_batch,
                          lambda batches=batches: train_step(batches, scheduler.last_epoch + 1, watch, epoch))
        else:
            train_step(batches, scheduler.last_epoch + 1, watch, epoch)
        scheduler.step()
    watch.finish(epoch)
    net.check_compiled()  # a shape first met after step 0 (the noise meter's half batch) compiles inside the epoch
    return train_step.sums(num_batches * micro_batch, trial.steps_per_epoch)


class DivergenceWatch:
    """Ends the trial on a non-finite step (gradient norm; loss under fp16) without a host sync per step on a GPU.

    CPU: the value is already on the host, checked at once. CUDA: each step's flag is copied to
    pinned memory behind the step and read one step later (after the next step is queued), so the
    GPU never idles; a divergence is caught at most one step late, identically on every rank.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.pending = None  # (host flag, event, epoch, step) of the previous step (CUDA)
        if self.cuda:
            self.host = torch.zeros((), dtype=torch.bool).pin_memory()

    def check(self, bad: torch.Tensor, epoch: int, step: int) -> None:
        """`bad`: a bool tensor, identical on every rank."""
        if not self.cuda:
            if bad:
                raise TrialFailure("diverged",
                                   f"diverged: non-finite loss or gradient norm at epoch {epoch}, step {step}")
            return
        self.finish(epoch)
        self.host.copy_(bad, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self.pending = (event, epoch, step)

    def finish(self, epoch: int) -> None:
        if self.cuda and self.pending is not None:
            event, at_epoch, step = self.pending
            event.synchronize()
            self.pending = None
            if bool(self.host):
                raise TrialFailure("diverged",
                                   f"diverged: non-finite loss or gradient norm at epoch {at_epoch}, step {step}")
