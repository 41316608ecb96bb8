"""One rank's model, built the same way for training and for the probe: the spec's model (raysweep/models.py: the
built-in CNN with its CPU kernels or the plain ops CUDA compiles, or a user's) on the device, compiled or not
(eager where it cannot be: `EagerOnFailure`), wrapped in DDP where there are several ranks, its optimizer,
precision and fp16 scaler."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from raysweep import models
from raysweep.config import TrialConfig
from raysweep.metrics import COMPILE_FAILED, RECOMPILE_LIMIT
from raysweep.optim import build_optimizer
from raysweep.worker import compile_cache
from raysweep.worker.device import resolve_compile, resolve_precision
from raysweep.worker.noise_meter import GradNoiseMeter
from raysweep.worker.shard import wants_channels_last

log = logging.getLogger(__name__)


@dataclass
class CompileClock:
    """Seconds a rank spends compiling its step: first calls at a shape, CUDA graph captures. The model and its
    steps share one clock: a step holds the clock, not the model, so no reference cycle keeps a trial alive."""

    device: torch.device
    seconds: float = 0.0
    eager: int = 0  # why a compiled path of this trial ran eager (metrics.EAGER_REASONS); 0: none did

    def fell_back(self, reason: int, what: str) -> None:
        """A compiled path runs eager from now on (`reason`: metrics.EAGER_REASONS): said once in the rank's log;
        the rank's reports carry it (entry.train_epochs)."""
        if not self.eager:
            self.eager = reason
            log.warning("%s; this trial runs eager from here on: slower than its compiled peers", what)

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
    limit_hits_at_build: int = 0  # compile_cache.recompile_limit_hits() when the model was built
    clock: CompileClock | None = None  # None: a clock of its own
    channels_last: bool = True  # batches laid out NHWC, the model's own layout (shard.wants_channels_last)
    _compiled_shapes: set = field(default_factory=set)  # micro-batch sizes the compiled step has met
    train_step: object = None  # step.TrainStep for the current shard and shape (its buffers, its CUDA graph)

    def __post_init__(self):
        if self.step_core is None:
            self.step_core = self.core
        if self.clock is None:
            self.clock = CompileClock(self.device)

    @property
    def eager_fallback(self) -> int:
        """Why a compiled path of this trial ran eager (metrics.EAGER_REASONS; 0, false: none did)."""
        return self.clock.eager

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
        `path`: the built-in CNN's path (model.CaptchaCNN), None → by device; tests run CUDA's ("plain") on the CPU.
        The model is the spec's (models.build: the built-in CNN or a user's factory), built anew for every trial."""
        torch.manual_seed(trial.train.seed)  # identical init on every rank (DDP also broadcasts rank 0's weights)
        core = models.build(trial.model, trial.image, path).to(device)
        clock = CompileClock(device)
        compiled = resolve_compile(trial.train.compile if compile is None else compile, device)
        # static shapes: every micro-batch of a trial has one size (shard.epoch_plan); DDP wraps the compiled
        # module, so the probe step can run the very kernels training runs without DDP's collectives. Dynamo's
        # cache is shared with the process's earlier trials: sized so that they leave this one room
        # (compile_cache.compile_model)
        if compiled:
            compile_cache.recover_from_fallback()
            step_core = EagerOnFailure(core, compile_cache.compile_model(core), clock)
        else:
            step_core = core
        if wrap is not None and trial.model.find_unused_parameters:  # model.find_unused_parameters: DDP's own
            model = wrap(step_core, parallel_strategy_kwargs={"find_unused_parameters": True})
        else:
            model = wrap(step_core) if wrap is not None else step_core
        noise = GradNoiseMeter.attach(model, device) if measure_noise else None
        precision = resolve_precision(trial.train.precision, device)
        # a capturable optimizer keeps its step count and LR on the device, so a CUDA graph can replay its step
        capturable = device.type == "cuda" and trial.train.cuda_graphs is not False and precision != "fp16"
        optimizer = build_optimizer(core, trial.peak_lr, trial.knobs.weight_decay, device.type, capturable)
        scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
        return cls(model, core, optimizer, scaler, precision, device, noise, step_core, compiled,
                   limit_hits_at_build=compile_cache.recompile_limit_hits(), clock=clock,
                   channels_last=wants_channels_last(core))

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

    def check_compiled(self) -> int:
        """Whether a compiled call of this trial has run eagerly (metrics.EAGER_REASONS; 0: none has): its compile
        raised (EagerOnFailure), a CUDA graph could not be captured (step.TrainStep), or Dynamo hit a recompile limit
        since the model was built (it then runs that code eagerly, with a warning in this log only). The first
        time: a warning naming the trial's consequence, and `eager_fallback` set for the rank's report."""
        if self.compiled and not self.eager_fallback \
                and compile_cache.recompile_limit_hits() > self.limit_hits_at_build:
            self.clock.fell_back(RECOMPILE_LIMIT, "the compiled step fell back to eager: Dynamo hit its recompile "
                                                  "limit (see torch._dynamo's warning above)")
        return self.eager_fallback


class EagerOnFailure(nn.Module):
    """The compiled module, or, once compiling it raised, the module itself, eagerly, for the rest of the trial.

    A user's model may hold what Inductor cannot lower or Dynamo cannot trace into one graph without error (a graph
    break is no error: Dynamo runs that part eagerly by itself). Its trial then runs eager, recorded as such
    (metrics.COMPILE_FAILED), instead of failing. `core` is the one registered submodule: parameters, buffers and
    checkpoints are the model's, under its own names; the compiled wrapper shares them. A forward that raises
    eagerly too raises as it would without compile: the error is the model's, not the compiler's."""

    def __init__(self, core: nn.Module, compiled, clock: CompileClock):
        super().__init__()
        self.core = core
        self._compiled = [compiled]  # not a submodule: its parameters are core's
        self._clock = clock

    @property
    def compiled(self):
        """The compiled module (None once it failed)."""
        return self._compiled[0] if self._compiled else None

    def forward(self, *args, **kwargs):
        if self._compiled:
            try:
                return self._compiled[0](*args, **kwargs)
            except torch.OutOfMemoryError:
                raise
            except Exception as e:  # Dynamo's and Inductor's errors have no common base a user's code never raises
                self._compiled.clear()
                text = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
                self._clock.fell_back(COMPILE_FAILED, f"torch.compile of the model failed: {type(e).__name__}: {text}")
                _drop_frames(e)
        return self.core(*args, **kwargs)


def _drop_frames(error: BaseException) -> None:
    """Unlink the tracebacks of `error` and of the errors it chains: Dynamo's frames hold the module, its inputs and
    the exception itself, a reference cycle that kept a finished trial's model, optimizer and step alive until the
    cyclic collector ran (tests/test_slot_memory.py). With the links gone the frames go by reference counting.
    Unlinking, not `traceback.clear_frames`: clearing runs code the frames' owners did not ask for (a suspended
    generator's frame is finalized, closing the generator) on frames Dynamo's C code evaluated
    (torch/csrc/dynamo/eval_frame.c); the one test that cleared them died twice in CI's long-lived test process
    (std::bad_alloc, then a crash), never here, and unlinking frees the same objects."""
    seen, chained = set(), [error]
    while chained:
        error = chained.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        error.__traceback__ = None
        chained += [error.__cause__, error.__context__]
