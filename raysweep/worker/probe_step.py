"""The OOM probe step: one full training step at a micro-batch on random data, every rank agreeing on the
outcome, with everything training continues from left as it was (weights, optimizer moments, the fp16 scale,
the RNG streams). Training's start-up and the `probe` command use it."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from raysweep.config import TrialConfig
from raysweep.worker import faults
from raysweep.worker.device import GiB, autocast, device_memory, own_host_blocks, release_host_memory
from raysweep.worker.net import RankModel
from raysweep.worker.reduce import all_reduce_named
from raysweep.worker.shard import model_input
from raysweep.worker.step import LOSS_FN


@dataclass(frozen=True)
class ProbeStep:
    """One probe step at one micro-batch, agreed across ranks (max of each figure; OOM anywhere is OOM)."""

    per_gpu_batch_size: int
    fits: bool
    peak_mem_allocated_gb: float  # CUDA allocator peaks (0 on CPU)
    peak_mem_reserved_gb: float
    peak_rss_gb: float  # process resident memory: the figure on CPU
    step_time_s: float
    device_memory_gb: float  # the device memory this rank may use (its share of a shared GPU; CPU: the machine's)
    images_per_s: float = 0.0  # global, when it fits (set by the probe command)


def probe_step(net: RankModel, trial: TrialConfig, micro_batch: int) -> ProbeStep:
    """One full step (forward, backward, optimizer) at `micro_batch` on random data; the training state left
    as it was (`KeptState`: a restored trial continues from its checkpoint's moments, scale and RNG). Every
    rank agrees on the outcome: OOM anywhere is OOM everywhere.

    Runs the step's module without DDP (`step_core`: compiled where training is, so its memory is training's),
    so the step issues no collective that an OOM could leave half-joined; the only collective is the all-reduce
    of the outcome, which every rank reaches. Its first call at a micro-batch compiles: counted as compile time.
    """
    import psutil

    model, optimizer, scaler, device = net.step_core, net.optimizer, net.scaler, net.device
    img = trial.image
    cuda = device.type == "cuda"
    kept = KeptState.of(net)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    else:  # a CPU worker's heap keeps what an earlier, larger step freed (device.keep_host_memory): its resident
        release_host_memory()  # memory would read as this step's, and the probe's bisection as all OOM
    rss = RssSampler() if not cuda else None

    def step() -> None:
        faults.FAULTS.check_oom(micro_batch)
        stored = (micro_batch, img.height, img.width) + ((img.channels,) if img.channels > 1 else ())
        x = model_input(torch.randint(0, 256, stored, dtype=torch.uint8, device=device), net.channels_last)
        labels = torch.randint(0, img.num_classes, (micro_batch, img.length), device=device)
        y = nn.functional.one_hot(labels, img.num_classes).flatten(1).float()
        model.train()
        with autocast(device, net.precision):
            logits = model(x)
        scaler.scale(LOSS_FN(logits.float().flatten(1), y)).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), trial.train.grad_clip or math.inf)
        scaler.step(optimizer)
        scaler.update()
        if cuda:
            torch.cuda.synchronize(device)

    oom = False
    t0 = time.perf_counter()
    try:  # the step's tensors are gone when it returns or raises: nothing of it is held below
        with own_host_blocks(device):
            net.call_step(micro_batch, step)
    except torch.OutOfMemoryError:
        oom = True
    finally:
        optimizer.zero_grad(set_to_none=True)
    step_time_s = time.perf_counter() - t0
    peak_rss = rss.stop() if rss else psutil.Process().memory_info().rss
    kept.restore(net)
    if cuda:
        alloc, reserved = torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
        total = device_memory(device)  # a rank sharing its GPU (scaling.workers_per_gpu): its share
        torch.cuda.empty_cache()
    else:
        alloc = reserved = 0
        total = psutil.virtual_memory().total
    agreed = all_reduce_named({"oom": float(oom), "alloc": alloc / GiB, "reserved": reserved / GiB,
                               "rss": peak_rss / GiB, "step_time_s": step_time_s, "total": total / GiB},
                              dist.ReduceOp.MAX, device)
    return ProbeStep(micro_batch, not agreed["oom"], agreed["alloc"], agreed["reserved"], agreed["rss"],
                     agreed["step_time_s"], agreed["total"])


@dataclass
class KeptState:
    """What a step changes and training continues from: weights and BatchNorm statistics, the optimizer's
    per-parameter state (Adam's moments, step counts), the fp16 loss scale, the RNG streams. Taken before the
    probe step and put back after it, tensors in place (a CUDA graph captured later addresses them)."""

    model: dict
    optimizer: dict  # parameter → {name: value}; empty for an optimizer that has not stepped
    scaler: dict
    cpu_rng: torch.Tensor
    cuda_rng: torch.Tensor | None

    @classmethod
    def of(cls, net: RankModel) -> KeptState:
        def copy(v):
            return v.detach().clone() if isinstance(v, torch.Tensor) else v

        cuda = net.device.type == "cuda"
        return cls({k: copy(v) for k, v in net.core.state_dict().items()},
                   {p: {k: copy(v) for k, v in s.items()} for p, s in net.optimizer.state.items()},
                   net.scaler.state_dict(), torch.get_rng_state(),
                   torch.cuda.get_rng_state(net.device) if cuda else None)

    def restore(self, net: RankModel) -> None:
        net.core.load_state_dict(self.model)
        state = net.optimizer.state
        for p in [p for p in state if p not in self.optimizer]:  # moments the probe created: not training's
            del state[p]
        for p, saved in self.optimizer.items():
            for k, v in saved.items():
                now = state[p].get(k)
                if isinstance(v, torch.Tensor) and isinstance(now, torch.Tensor) and now.shape == v.shape \
                        and now.dtype == v.dtype and now.device == v.device:
                    now.copy_(v)
                else:
                    state[p][k] = v
        if net.scaler.is_enabled():
            net.scaler.load_state_dict(self.scaler)
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state(self.cuda_rng, net.device)


class RssSampler:
    """Peak resident memory of this process while it runs (CPU has no allocator peak to read)."""

    def __init__(self, interval_s: float = 0.005):
        import threading

        import psutil

        self.process, self.peak, self.interval_s = psutil.Process(), 0, interval_s
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.done.is_set():
            self.peak = max(self.peak, self.process.memory_info().rss)
            self.done.wait(self.interval_s)

    def stop(self) -> int:
        self.done.set()
        self.thread.join()
        return max(self.peak, self.process.memory_info().rss)
