"""One rank's model, built the same way for training and for the probe: the CNN on the device (CPU kernels
or the plain ops CUDA compiles), compiled or not, wrapped in DDP where there are several ranks, its
optimizer, precision and fp16 scaler."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from raysweep.config import TrialConfig
from raysweep.model import build_model
from raysweep.optim import build_optimizer
from raysweep.worker import compile_cache
from raysweep.worker.device import resolve_compile, resolve_precision
from raysweep.worker.noise_meter import GradNoiseMeter

log = logging.getLogger(__name__)


@dataclass
class CompileClock:
    """Seconds a rank spends compiling its step: first calls at a shape, CUDA graph captures. The model and its
    steps share one clock: a step holds the clock, not the model, so no reference cycle keeps a trial alive."""

    device: torch.device
    seconds: float = 0.0

    def time(self, fn):
        """Run `fn()` and count its wall time: a compiling first call (the step it also runs is milliseconds of
        it) or a CUDA graph's capture."""
        t0 = time.perf_counter()
        try:
            return fn()
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.seconds += time.perf_counter() - t0


@dataclass
class RankModel:
    """`model` runs the training step (DDP over `step_core` where there are several ranks); `step_core` is the
    module the step compiles (`core` itself when not compiled), run alone by the probe step; `core` is the plain
    module, for evaluation and checkpoints.

    Nothing here points back at the RankModel (the step holds the parts it runs, not the model): a trial a warm
    slot drops is freed at once, by reference counting, not at some later garbage collection."""

    model: nn.Module
    core: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    precision: str
    device: torch.device
    noise: GradNoiseMeter | None = None  # the gradient noise scale's measurements (None: not measured)
    step_core: nn.Module | None = None  # None: `core`
    compiled: bool = False
    eager_fallback: bool = False  # a compiled call of this trial ran eagerly: Dynamo hit a recompile limit
    limit_hits_at_build: int = 0  # compile_cache.recompile_limit_hits() when the model was built
    clock: CompileClock | None = None  # None: a clock of its own
    _compiled_shapes: set = field(default_factory=set)  # micro-batch sizes the compiled step has met
    train_step: object = None  # step.TrainStep for the current shard and shape (its buffers, its CUDA graph)

    def __post_init__(self):
        if self.step_core is None:
            self.step_core = self.core
        if self.clock is None:
            self.clock = CompileClock(self.device)

    @property
    def compile_s(self) -> float:
        """Seconds spent compiling the step (first call at each shape, CUDA graph captures)."""
        return self.clock.seconds

    @classmethod
    def build(cls, trial: TrialConfig, device: torch.device, wrap=None, compile: bool | str | None = None,
              measure_noise: bool = True, path: str | None = None) -> RankModel:
        """`wrap`: `ray.train.torch.prepare_model` on a worker (to the device; DDP when world size > 1).
        `compile`: None → trial.train.compile (auto: CUDA yes, CPU no).
        `measure_noise=False`: no GradNoiseMeter (benchmarks/noise_cost.py measures what it costs).
        `path`: the model's path (model.CaptchaCNN), None → by device; tests run CUDA's ("plain") on the CPU."""
        torch.manual_seed(trial.train.seed)  # identical init on every rank (DDP also broadcasts rank 0's weights)
        core = build_model(trial.image, trial.model.dropout, path).to(device)
        compiled = resolve_compile(trial.train.compile if compile is None else compile, device)
        # static shapes: every micro-batch of a trial has one size (shard.epoch_plan); DDP wraps the compiled
        # module, so the probe step can run the very kernels training runs without DDP's collectives. Dynamo's
        # cache is shared with the process's earlier trials: sized so that they leave this one room
        # (compile_cache.compile_model)
        if compiled:
            compile_cache.recover_from_fallback()
            step_core = compile_cache.compile_model(core)
        else:
            step_core = core
        model = wrap(step_core) if wrap is not None else step_core
        noise = GradNoiseMeter.attach(model, device) if measure_noise else None
        precision = resolve_precision(trial.train.precision, device)
        # a capturable optimizer keeps its step count and LR on the device, so a CUDA graph can replay its step
        capturable = device.type == "cuda" and trial.train.cuda_graphs is not False and precision != "fp16"
        optimizer = build_optimizer(core, trial.peak_lr, trial.knobs.weight_decay, device.type, capturable)
        scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
        return cls(model, core, optimizer, scaler, precision, device, noise, step_core, compiled,
                   limit_hits_at_build=compile_cache.recompile_limit_hits())

    def call_step(self, micro_batch: int, fn):
        """`fn()`, a call of the step's module at `micro_batch`; the compiled step's first call there compiles
        (static shapes: the probe step and training share it), and its time counts as compile time."""
        if not self.compiled or micro_batch in self._compiled_shapes:
            return fn()
        self._compiled_shapes.add(micro_batch)
        try:
            return self.count_compile(fn)
        finally:
            self.check_compiled()

    def count_compile(self, fn):
        """Run `fn()` and count its wall time as compile time (CompileClock.time)."""
        return self.clock.time(fn)

    def check_compiled(self) -> bool:
        """Whether a compiled call of this trial has run eagerly: Dynamo hit a recompile limit since the model was
        built (it then runs that code eagerly, with a warning in this log only). The first time: a warning naming
        the trial's consequence, and `eager_fallback` set for the rank's report."""
        if self.compiled and not self.eager_fallback \
                and compile_cache.recompile_limit_hits() > self.limit_hits_at_build:
            self.eager_fallback = True
            log.warning("the compiled step fell back to eager: Dynamo hit its recompile limit (see torch._dynamo's "
                        "warning above); this trial's speed is not the compiled step's")
        return self.eager_fallback
