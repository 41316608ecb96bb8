"""The OOM probe step: one full training step at a micro-batch on random data, every rank agreeing on the
outcome, with the model and optimizer left as they were. Training's start-up and the `probe` command use it."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from raysweep.config import TrialConfig
from raysweep.worker import faults
from raysweep.worker.device import GiB, autocast
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
    device_memory_gb: float  # the device's total memory (on CPU: the machine's)
    images_per_s: float = 0.0  # global, when it fits (set by the probe command)


def probe_step(net: RankModel, trial: TrialConfig, micro_batch: int) -> ProbeStep:
    """One full step (forward, backward, optimizer) at `micro_batch` on random data; model and
    optimizer left as they were. Every rank agrees on the outcome: OOM anywhere is OOM everywhere.

    Runs the step's module without DDP (`step_core`: compiled where training is, so its memory is training's),
    so the step issues no collective that an OOM could leave half-joined; the only collective is the all-reduce
    of the outcome, which every rank reaches. Its first call at a micro-batch compiles: counted as compile time.
    """
    import psutil

    model, optimizer, scaler, device = net.step_core, net.optimizer, net.scaler, net.device
    img = trial.image
    cuda = device.type == "cuda"
    snapshot = {k: v.detach().clone() for k, v in net.core.state_dict().items()}  # BN buffers too
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    rss = RssSampler() if not cuda else None

    def step() -> None:
        faults.FAULTS.check_oom(micro_batch)
        x = model_input(torch.randint(0, 256, (micro_batch, img.height, img.width), dtype=torch.uint8, device=device))
        labels = torch.randint(0, img.num_classes, (micro_batch, img.length), device=device)
        y = nn.functional.one_hot(labels, img.num_classes).flatten(1).float()
        model.train()
        with autocast(device, net.precision):
            logits = model(x)
        scaler.scale(LOSS_FN(logits.float(), y)).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), trial.train.grad_clip or math.inf)
        scaler.step(optimizer)
        scaler.update()
        if cuda:
            torch.cuda.synchronize(device)

    oom = False
    t0 = time.perf_counter()
    try:  # the step's tensors are gone when it returns or raises: nothing of it is held below
        net.call_step(micro_batch, step)
    except torch.OutOfMemoryError:
        oom = True
    finally:
        optimizer.zero_grad(set_to_none=True)
    step_time_s = time.perf_counter() - t0
    peak_rss = rss.stop() if rss else psutil.Process().memory_info().rss
    net.core.load_state_dict(snapshot)
    optimizer.state.clear()  # the probe's moments must not leak into training
    if cuda:
        alloc, reserved = torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.empty_cache()
    else:
        alloc = reserved = 0
        total = psutil.virtual_memory().total
    agreed = all_reduce_named({"oom": float(oom), "alloc": alloc / GiB, "reserved": reserved / GiB,
                               "rss": peak_rss / GiB, "step_time_s": step_time_s, "total": total / GiB},
                              dist.ReduceOp.MAX, device)
    return ProbeStep(micro_batch, not agreed["oom"], agreed["alloc"], agreed["reserved"], agreed["rss"],
                     agreed["step_time_s"], agreed["total"])


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
