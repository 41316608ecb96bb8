"""The gradient noise scale's measurements on a rank (raysweep/noise.py has the estimator): two squared
gradient norms per optimizer step, summed on the device."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

NOISE_EVERY = 4  # one rank, one micro-batch: every 4th step is measured (each adds half a backward)


class GradNoiseMeter:
    """The measurements behind the gradient noise scale (noise.py has the estimator), summed on the device.

    Each optimizer step needs the squared norm of a small-batch gradient |G_b|² and of the big-batch one
    |G_B|² (the pre-clip norm the loop computes anyway, squared):
    - several ranks (DDP): a communication hook squares-and-sums every gradient bucket *before* the
      all-reduce (the rank's own gradient over micro-batch × accumulation samples: b), then all-reduces it
      averaged, exactly as DDP's default hook does. With `no_sync()` accumulation the hook runs once per
      step, on the accumulated buffer. No host sync, no extra collective: the sums join the epoch's
      all-reduce in `reduce_metrics`.
    - one rank with ≥ 2 micro-batches per step: each micro-batch's backward writes its own gradient
      (b = the micro-batch), squared-summed and then added to the step's sum by hand, as autograd would.
    - one rank, one micro-batch: every `every`-th step also runs a backward of the first half of its micro-batch
      alone (b = half the batch), out of the step's way (TrainStep.measure_half: its gradient stashed, BatchNorm's
      statistics and the RNG put back), so the step trains exactly as an unmeasured one. Halves that *replace*
      the whole backward would be cheaper but train differently: BatchNorm normalizes each half by its own
      statistics. So only those steps pay the extra half a backward (14 % of the step time over an epoch on a
      CPU: benchmarks/noise_cost.py).
    fp16: the buffers hold GradScaler-scaled gradients; `step_done` divides by the scale², on the device.
    """

    def __init__(self, device: torch.device, ddp: bool, every: int | None = None):
        self.ddp, self.every = ddp, every or NOISE_EVERY
        zero = torch.zeros((), dtype=torch.float64, device=device)
        self.step_small = zero.clone()  # this step's Σ |G_b|² (DDP: over buckets; one rank: mean over micro-batches)
        self.small_sum, self.big_sum, self.steps = zero.clone(), zero.clone(), zero.clone()
        self._sum: list[torch.Tensor] | None = None  # one rank: the step's gradient so far (micro-batches before this)

    @classmethod
    def attach(cls, model: nn.Module, device: torch.device) -> GradNoiseMeter:
        ddp = isinstance(model, nn.parallel.DistributedDataParallel)
        meter = cls(device, ddp)
        if ddp:
            model.register_comm_hook(meter, _noise_hook)
        return meter

    def split(self, accum: int) -> int:
        """b_big / b_small for a step: the world size (DDP), the micro-batches (one rank), 2 (one rank: a half)."""
        if self.ddp:
            return dist.get_world_size()
        return accum if accum > 1 else 2

    def needs_half(self, accum: int) -> bool:
        """One rank without accumulation: the small batch is a half of the micro-batch, with a backward of its own."""
        return not self.ddp and accum == 1

    def measures(self, step: int, accum: int) -> bool:
        """Whether optimizer step `step` (1-based) is measured: every step where the pair comes free (DDP, micro-
        batches), every `every`-th (1, 1 + every, …) where it costs the half's extra backward."""
        return not self.needs_half(accum) or (step - 1) % self.every == 0

    def add_half(self, grads: list[torch.Tensor]) -> None:
        """The half's gradient (its loss unweighted: a mean over the half): its |G_b|² is the step's."""
        self.step_small += torch.stack(torch._foreach_norm(grads)).double().square().sum()

    def before_backward(self, params: list[torch.Tensor], micro: int, accum: int) -> None:
        """One rank: let this micro-batch's backward write its gradient alone (the step's sum so far is kept)."""
        if not self.ddp and accum > 1 and micro > 0:
            for p in params:
                p.grad = None

    def after_backward(self, params: list[torch.Tensor], micro: int, accum: int) -> None:
        """One rank: add this micro-batch's |gradient|², then its gradient to the step's sum (which is what
        autograd's accumulation would have done: one extra read of the gradients per micro-batch)."""
        if self.ddp or accum < 2:
            return
        grads = [p.grad for p in params]
        # the backward saw loss / accum: |g_k|² = accum² |grad|², averaged over the step's accum micro-batches
        self.step_small += torch.stack(torch._foreach_norm(grads)).double().square().sum() * accum
        if micro == 0:
            self._sum = grads
        else:
            torch._foreach_add_(self._sum, grads)
        if micro == accum - 1:
            for p, g in zip(params, self._sum):
                p.grad = g
            self._sum = None

    def step_done(self, norm: torch.Tensor, inv_scale: torch.Tensor | float = 1.0) -> None:
        """After the step's backward(s): `norm` = the pre-clip norm of the (all-reduced, unscaled) gradient."""
        small = self.step_small * (inv_scale * inv_scale)
        ok = torch.isfinite(norm) & torch.isfinite(small)  # fp16 overflow steps are skipped, as the scaler skips them
        self.small_sum += torch.where(ok, small, 0.0)
        self.big_sum += torch.where(ok, norm.double().square(), 0.0)
        self.steps += ok
        self.step_small.zero_()

    def take(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The epoch's sums (Σ|G_b|², Σ|G_B|², steps), and start over."""
        sums = self.small_sum.clone(), self.big_sum.clone(), self.steps.clone()
        for t in (self.small_sum, self.big_sum, self.steps, self.step_small):
            t.zero_()
        self._sum = None
        return sums


def _noise_hook(meter: GradNoiseMeter, bucket):
    """DDP communication hook: the bucket's squared sum before the all-reduce, then DDP's default all-reduce.

    (dist.GradBucket) → torch.futures.Future[torch.Tensor]; unannotated: DDP compares annotations as
    objects, and this module's are strings (`from __future__ import annotations`)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    buffer = bucket.buffer()
    norm = torch.linalg.vector_norm(buffer, dtype=torch.promote_types(buffer.dtype, torch.float32))  # fp16 buckets too
    meter.step_small += norm.double().square()
    return allreduce_hook(None, bucket)
