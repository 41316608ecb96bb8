"""A warm slot runs trial after trial in one process: what a finished trial built (model, optimizer, step, graphs)
must go when the slot drops it, by reference counting alone, so that the next trial starts as on a fresh group.

The checks run with the cyclic garbage collector off: a reference cycle would keep a trial alive until some later
collection (seconds or trials later), and a collection during the check would hide it.
"""

from __future__ import annotations

import contextlib
import gc
import weakref

import pytest
import torch
import torch._dynamo  # before any trial, as device.setup_device in a worker: its import pins its caller's frames

from raysweep.protocol import Task
from raysweep.worker.device import release_trial_memory
from raysweep.worker.run import TrainingRun
from raysweep.worker.shard import Shard

from test_gpu import FULL, NEEDS_CUDA, SMALL, _data, _trial

pytestmark = pytest.mark.timeout(120)


@contextlib.contextmanager
def no_cycle_collection():
    """Only reference counting frees objects inside: what a cycle holds stays."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _trained_run(device: torch.device, shards: tuple[Shard, Shard], factory: str | None = None,
                 **trial) -> TrainingRun:
    """A trial as a warm slot runs it: built on the group's shards, probed, one epoch. `factory`: a user's model
    (tests/user_models.py) instead of the built-in CNN."""
    config = _trial(**{"n": len(shards[0]), "epochs": 1, **trial})
    if factory is not None:
        from raysweep.config import ModelConfig

        config = config.model_copy(update={"model": ModelConfig(factory=factory)})
    run = TrainingRun.build(config, None, 0, 1, device, shards=shards)
    run.fit_in_memory()
    run.epoch(1)
    return run


def _shards(device: torch.device, size=SMALL, n: int = 64) -> tuple[Shard, Shard]:
    data = _data(n, size)
    return Shard.build(data.train, 36, device), Shard.build(data.val, 36, device)


def _held(run: TrainingRun) -> dict[str, weakref.ref]:
    """Weak references to what a trial builds and a slot must not keep."""
    net = run.net
    return {"model": weakref.ref(net.core), "optimizer": weakref.ref(net.optimizer),
            "step": weakref.ref(net.train_step), "scheduler": weakref.ref(run.scheduler),
            "rank model": weakref.ref(net)}


@pytest.mark.parametrize("accum, compile, factory", [
    pytest.param(1, False, None, id="half-batch"),  # one rank, no accumulation: the noise meter's half-batch backward
    pytest.param(2, False, None, id="micro-batch-pairs"),
    # Dynamo's cache outlives the trial and must not hold it; micro-batch 8, as test_compile_limits.py compiles
    # it (Inductor's cache serves the one from the other)
    pytest.param(2, True, None, id="compiled"),
    # a user's model, compiled, and one whose compile fails (EagerOnFailure keeps the compiler's wrapper, never the
    # trial)
    pytest.param(2, True, "user_models:tiny", id="user-model-compiled"),
    pytest.param(2, True, "user_models:uncompilable", id="user-model-compile-failed"),
])
def test_a_finished_trial_is_freed_by_reference_counting_alone(accum, compile, factory):
    device = torch.device("cpu")
    gc.collect()  # what earlier tests left in cycles is not this test's
    with no_cycle_collection():
        run = _trained_run(device, _shards(device), factory, batch=16, accum=accum, compile=compile)
        held = _held(run)
        del run
        alive = sorted(name for name, ref in held.items() if ref() is not None)
    assert not alive, f"kept alive after `del run` (a reference cycle): {alive}"


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=NEEDS_CUDA)])
def test_a_released_trial_gives_the_gpu_back_to_the_groups_baseline(device):
    """A CUDA trial at the users' image size (one rank: its steps replayed as a CUDA graph, with a private memory
    pool; 36 MiB of weights, twice that in AdamW's moments): after `del run` and release_trial_memory, the
    allocator holds what the group held before it (its shards), to within a few small blocks."""
    device = torch.device(device)
    shards = _shards(device, FULL, n=128)  # the group's, on the device for every trial; 4 steps: 2 warm-ups, capture
    torch.cuda.synchronize(device)
    allocated, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
    run = _trained_run(device, shards, batch=32, size=FULL)
    assert run.net.train_step.graph is not None  # the graph's pool is part of what must go
    assert torch.cuda.memory_allocated(device) > allocated + 100 * 2**20  # the trial did hold memory
    held = _held(run)
    del run
    release_trial_memory(device)
    assert all(ref() is None for ref in held.values())
    leftover = torch.cuda.memory_allocated(device) - allocated
    assert leftover <= 4 * 2**20, f"{leftover / 2**20:.1f} MiB still allocated after the trial"
    cached = torch.cuda.memory_reserved(device) - reserved
    assert cached <= 32 * 2**20, f"{cached / 2**20:.1f} MiB more reserved than before the trial"


class _Broker:
    """Stand-in for the broker's handle: what the slot's rank 0 tells it (SlotRank.ask just makes the call here)."""

    def __init__(self):
        self.finished: list = []  # (seq, failures.Failure or None)
        self.finish = self  # broker.finish.remote(seq, outcome)

    def remote(self, seq, outcome):
        self.finished.append((seq, outcome))


def test_a_slots_failed_trial_goes_back_as_data_and_is_freed_by_reference_counting_alone(monkeypatch, tmp_path):
    """SlotRank.run_trial, on one CPU rank with no Ray: a trial that fails (an OOM past the downshifts) reaches the
    broker as data, and what it built goes when its run ends. The failure's traceback holds train_epochs' frame,
    which holds the run and links back to the frame that kept the failure: kept there, a reference cycle."""
    import ray.train.torch

    from raysweep.worker import entry, faults

    monkeypatch.setattr(ray.train.torch, "prepare_model", lambda model: model)  # no Ray Train session here
    monkeypatch.setattr(faults, "FAULTS", faults.FaultInjection(oom_above=0))  # every micro-batch runs out of memory
    held: dict[str, weakref.ref] = {}
    build = entry.TrainingRun.build

    def build_and_watch(*args, **kwargs):
        run = build(*args, **kwargs)  # its step is built by the probe, later
        held.update(run=weakref.ref(run), model=weakref.ref(run.net.core), optimizer=weakref.ref(run.net.optimizer),
                    scheduler=weakref.ref(run.scheduler))
        return run

    monkeypatch.setattr(entry.TrainingRun, "build", build_and_watch)
    device, broker = torch.device("cpu"), _Broker()
    config = {"broker": broker, "slot": 0, "decision_wait_s": 1.0, "store_wait_s": 1.0}
    slot = entry.SlotRank(config, entry.Rank(0, 1, device, _data(64), "n1"), group_started=0.0)
    slot.ask = lambda call, wait_s=0.0, again=False: call()
    trial = _trial(n=64, batch=16, epochs=1).to_dict()
    gc.collect()  # what earlier tests left in cycles is not this test's
    with no_cycle_collection():
        slot.run_trial(Task(1, "a", trial, str(tmp_path)), fresh=True)
        alive = sorted(name for name, ref in held.items() if ref() is not None)
    assert held and not alive, f"kept alive after the trial ended (a reference cycle): {alive}"
    ((seq, outcome),) = broker.finished
    assert seq == 1 and outcome.kind == "oom" and "downshifts" in outcome.message
