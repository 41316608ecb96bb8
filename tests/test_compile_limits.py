"""A warm slot's trials share Dynamo's cache (one per code object: CaptchaCNN.forward), so its recompile limit
counts every trial's shapes: every trial still compiles (compile_cache.recompile_limit), and one that runs eagerly
says so (RankModel.eager_fallback, a warning on the rank).

On the CPU, through the real path (TrainingRun, RankModel.build, Inductor), with torch._dynamo.config.recompile_limit
lowered to 1 so that a second shape passes it. Two graphs are compiled in all (micro-batches 8 and 4; Inductor's
cache serves every later compile of them): 10 s on 2 cores with Inductor's cache warm; cold, a minute (35 s of
it the process's first Inductor compile, which any compiling test pays).
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch._dynamo
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from torch._dynamo.utils import counters

from raysweep.model import CaptchaCNN
from raysweep.worker import compile_cache
from raysweep.worker.run import TrainingRun
from raysweep.worker.shard import Shard

from test_gpu import _data, _trial

pytestmark = pytest.mark.timeout(240)
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Dynamo's caches and counters as in a fresh process, before and after: the limits are about what one
    process has compiled."""
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
    counters.clear()


@pytest.fixture(scope="module")
def shards() -> tuple[Shard, Shard]:
    """The warm group's data, on the device once for all its trials."""
    data = _data(64)
    return Shard.build(data.train, 36, CPU), Shard.build(data.val, 36, CPU)


@pytest.fixture(params=["this torch", "torch 2.11's compile"])
def compile_signature(request, monkeypatch) -> str:
    """torch.compile as installed (it takes `recompile_limit`), or with torch 2.11's signature, which lacks it:
    the same compiler behind a function without that argument (compile_cache.compile_model then raises
    Dynamo's global limit instead)."""
    if request.param != "this torch":
        real = torch.compile

        def compile_without_recompile_limit(model=None, *, fullgraph=False, dynamic=None, backend="inductor",
                                            mode=None, options=None, disable=False):
            return real(model, fullgraph=fullgraph, dynamic=dynamic, backend=backend, mode=mode, options=options,
                        disable=disable)

        monkeypatch.setattr(torch, "compile", compile_without_recompile_limit)
    return request.param


def _trial_run(shards, batch: int, accum: int) -> TrainingRun:
    """One trial of a slot, compiled: built on the group's shards, probed (the compile), one epoch."""
    run = TrainingRun.build(_trial(batch=batch, accum=accum, n=64, epochs=1, compile=True), None, 0, 1, CPU,
                            shards=shards)
    run.fit_in_memory()
    run.epoch(1)
    return run


def _entries() -> int:
    """Dynamo's compiled entries for the model's forward: one per specialization (here, per micro-batch)."""
    return len(_debug_get_cache_entry_list(CaptchaCNN.forward.__code__))


def test_a_slots_trials_compile_every_micro_batch_past_dynamos_recompile_limit(monkeypatch, shards, caplog,
                                                                               compile_signature):
    """Two trials, micro-batches 8 and 4 (accumulation 2: no half batch), against a recompile limit of 1: both
    compile; a plain torch.compile of the same model at a third shape is then refused (the limit was really
    passed: without the sized limit, the second trial would have run eagerly)."""
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 1)
    caplog.set_level(logging.WARNING, logger="raysweep")
    for batch in (16, 8):
        run = _trial_run(shards, batch, accum=2)
        assert run.net.compiled and run.net.compile_s > 0 and not run.net.eager_fallback, batch
        del run
    assert _entries() == 2 and compile_cache.recompile_limit_hits() == 0
    assert "fell back to eager" not in caplog.text
    plain = torch.compile(CaptchaCNN(24, 64, 4, 36, dropout=0.0), dynamic=False)
    plain(torch.zeros(2, 1, 24, 64))
    assert compile_cache.recompile_limit_hits() == 1 and _entries() == 2


def test_a_trial_that_recompiles_past_the_limit_says_so_and_the_next_trial_compiles(monkeypatch, shards, caplog):
    """Accumulation 1 on one rank: the noise meter's half batch (4) is the trial's second shape, past a limit
    of 1: it runs eagerly, the run says so (flag and warning); the slot's next trial starts from fresh caches
    (compile_cache.recover_from_fallback) and compiles."""
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 1)
    caplog.set_level(logging.WARNING, logger="raysweep")
    run = _trial_run(shards, 8, accum=1)
    assert run.net.eager_fallback and compile_cache.recompile_limit_hits() == 1
    assert "the compiled step fell back to eager: Dynamo hit its recompile limit" in caplog.text
    del run
    caplog.clear()
    run = _trial_run(shards, 16, accum=2)  # micro-batch 8 again
    assert not run.net.eager_fallback and _entries() == 1
    assert "fell back to eager" not in caplog.text
