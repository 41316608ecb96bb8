"""Several ranks in fresh processes (spawn), joined by a gloo process group on loopback: how the tests of
collectives run raysweep's rank code without Ray (tests/test_noise.py, tests/test_gpu.py)."""

from __future__ import annotations

import faulthandler
import gc
import os
import socket

import torch
import torch.distributed as dist


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, fn, kwargs: dict, out) -> None:
    faulthandler.enable(all_threads=True)  # a rank that aborts (SIGABRT from C++) prints where each thread was
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        out.put((rank, fn(rank, world, **kwargs)))
    finally:
        # `fn`'s DDP models hold the process group (and gloo's threads) past destroy_process_group when a reference
        # cycle keeps them (hooks): collected here, not while the interpreter is torn down, where gloo's work objects
        # abort the process ("terminate called without an active exception": pytorch/pytorch#190489, #179291)
        gc.collect()
        dist.destroy_process_group()
    # the result is on its way (the queue's feeder thread flushed): leave without the interpreter's teardown
    out.close()
    out.join_thread()
    os._exit(0)


def run_ranks(fn, world: int = 2, **kwargs) -> list:
    """`fn(rank, world, **kwargs)` on every rank (a module-level function: it is pickled by name); returns
    what each rank returned, by rank. A rank's exception fails the call with that rank's traceback."""
    ctx = torch.multiprocessing.get_context("spawn")
    out = ctx.Queue()
    torch.multiprocessing.start_processes(_rank_main, args=(world, _free_port(), fn, kwargs, out), nprocs=world,
                                          start_method="spawn")
    results = dict(out.get(timeout=5) for _ in range(world))
    return [results[rank] for rank in range(world)]
