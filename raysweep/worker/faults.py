"""Agreed failures (the trial ends, no retry) and the test-only fault switches.

The switches are read once per process, from the environment `trainer.worker_env()` passes on. They stay off
the hot loop: an injected OOM is raised once per epoch (the micro-batch is the same for every step), and an
injected NaN is a device-side factor the step multiplies its loss by only when the switch is set.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from raysweep.failures import TrialFailure  # noqa: F401  (raised by the step and the probe: agreed by every rank)


@dataclass(frozen=True)
class FaultInjection:
    """Test-only switches (CPU has no allocator limit, and NaNs are hard to provoke on purpose).

    RAYSWEEP_TEST_OOM_ABOVE=N: the training step raises torch.OutOfMemoryError when the per-GPU
    micro-batch exceeds N. RAYSWEEP_TEST_NAN_AT_STEP=K: the loss is NaN at optimizer step K (1-based).
    RAYSWEEP_TEST_SETUP_FAILS=1: a warm group's set-up raises on every rank, every time (a node's broken GPU).
    Everything else on the path is the real one. They reach workers through `trainer.worker_env()`.
    """

    oom_above: int | None = None
    nan_at_step: int | None = None
    setup_fails: bool = False

    @classmethod
    def from_env(cls) -> FaultInjection:
        def read(name):
            value = os.environ.get(name)
            return int(value) if value else None

        return cls(read("RAYSWEEP_TEST_OOM_ABOVE"), read("RAYSWEEP_TEST_NAN_AT_STEP"),
                   bool(read("RAYSWEEP_TEST_SETUP_FAILS")))

    def check_setup(self) -> None:
        if self.setup_fails:
            raise RuntimeError("RAYSWEEP_TEST_SETUP_FAILS=1: this rank's device set-up failed")

    def check_oom(self, micro_batch: int) -> None:
        if self.oom_above is not None and micro_batch > self.oom_above:
            raise torch.OutOfMemoryError(f"RAYSWEEP_TEST_OOM_ABOVE={self.oom_above}: micro-batch {micro_batch}")

    def loss_factor(self, step: int) -> float:
        """What the loss of optimizer step `step` (1-based) is multiplied by: NaN at the injected step."""
        return float("nan") if step == self.nan_at_step else 1.0


FAULTS = FaultInjection.from_env()
