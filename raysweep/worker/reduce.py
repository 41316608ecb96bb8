"""The collectives of an epoch and of start-up: one all-reduce per kind of figure, and the metrics they make."""

from __future__ import annotations

import torch
import torch.distributed as dist

from raysweep.metrics import EpochMetrics
from raysweep.noise import estimate
from raysweep.worker.device import GiB, distributed
from raysweep.worker.evaluate import EvalSums
from raysweep.worker.step import TrainSums


def all_reduce_named(values: dict[str, object], op, device: torch.device) -> dict[str, float]:
    """All-reduce named scalars in one collective; returns them by name on the host (a sync)."""
    t = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device) for v in values.values()])
    if distributed():
        dist.all_reduce(t, op=op)
    return dict(zip(values, t.tolist()))


def reduce_metrics(train: TrainSums, val: EvalSums, *, train_time_s: float, epoch_time_s: float, epoch: int,
                   samples_before: int, lr: float | torch.Tensor, device: torch.device,
                   compile_s: float = 0.0, seconds_before: float = 0.0,
                   work_time_s: float | None = None) -> EpochMetrics:
    """Two collectives per epoch (a SUM and a MAX); the epoch's host syncs are here. `work_time_s`: the epoch's
    seconds but the compiling inside it (default: epoch_time_s), added to `seconds_before` for train_seconds."""
    import psutil

    cuda = device.type == "cuda"
    # a CUDA graph's replays allocate nothing: its step's memory is the peak seen when it was captured
    allocated = max(torch.cuda.max_memory_allocated(device), train.graph_peak_bytes) if cuda else 0
    s = all_reduce_named({
        "train_loss": train.loss_sum, "train_samples": train.samples, "val_loss": val.loss_sum,
        "val_samples": val.samples, "val_exact": val.exact, "val_chars": val.chars, "val_char_total": val.char_total,
        "grad_norm": train.grad_norm_sum, "clipped_steps": train.clipped_steps,
        "optimizer_steps": train.optimizer_steps,
        "noise_small": train.noise_small, "noise_big": train.noise_big, "noise_steps": train.noise_steps,
    }, dist.ReduceOp.SUM, device)
    m = all_reduce_named({
        "grad_norm_max": train.grad_norm_max,
        "peak_mem_allocated_gb": allocated / GiB,
        "peak_mem_reserved_gb": torch.cuda.max_memory_reserved(device) / GiB if cuda else 0.0,
        "rss_gb": psutil.Process().memory_info().rss / GiB,
        "train_time_s": train_time_s,
        "epoch_time_s": epoch_time_s,
        "compile_s": compile_s,
        "work_time_s": epoch_time_s if work_time_s is None else work_time_s,
    }, dist.ReduceOp.MAX, device)
    steps = s["optimizer_steps"]  # every rank counted the same optimizer steps, and saw the same norms
    n, vn = s["train_samples"], max(s["val_samples"], 1)
    noise = None
    if s["noise_steps"] > 0:  # per-step means over the epoch and the ranks first (the sums are of both), then the ratio
        world = dist.get_world_size() if distributed() else 1
        b_big = n * world / steps  # the global batch: samples ÷ one rank's optimizer steps
        noise = estimate(s["noise_small"] / s["noise_steps"], s["noise_big"] / s["noise_steps"],
                         b_big / train.noise_split, b_big)
    return EpochMetrics(
        epoch=epoch,
        samples_seen=samples_before + int(n),
        train_loss=s["train_loss"] / max(n, 1),
        val_loss=s["val_loss"] / vn,
        val_exact_acc=s["val_exact"] / vn,
        val_char_acc=s["val_chars"] / max(s["val_char_total"], 1),
        lr=float(lr),  # a capturable optimizer's LR is a device tensor
        grad_norm=s["grad_norm"] / max(steps, 1),
        grad_norm_max=m["grad_norm_max"],
        clip_fraction=s["clipped_steps"] / max(steps, 1),
        epoch_time_s=m["epoch_time_s"],
        samples_per_s=n / max(m["train_time_s"], 1e-9),
        peak_mem_allocated_gb=m["peak_mem_allocated_gb"],
        peak_mem_reserved_gb=m["peak_mem_reserved_gb"],
        rss_gb=m["rss_gb"],
        compile_s=m["compile_s"],
        train_seconds=seconds_before + max(m["work_time_s"], 0.0),
        grad_noise_scale=noise.grad_noise_scale if noise else None,
        grad_sq_norm=noise.grad_sq_norm if noise else None,
        grad_trace_cov=noise.grad_trace_cov if noise else None,
    )


def gather_strings(value: str) -> str:
    """Every rank's `value`, by rank, comma-separated (one collective, at start-up only)."""
    if not distributed():
        return value
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return ",".join(values)


def broadcast_object(value, device: torch.device | None = None):
    """Rank 0's `value` on every rank (pickled; for the few decisions a warm group takes between trials)."""
    if not distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, device=device if device is not None and device.type == "cuda" else None)
    return box[0]


def agree(go: bool, device: torch.device) -> bool:
    """Rank 0's decision to go on (the others pass True), on every rank: one all-reduce (MIN)."""
    return bool(all_reduce_named({"go": float(go)}, dist.ReduceOp.MIN, device)["go"])
