"""The compile caches a sweep's trials share: Inductor's, so that a sweep compiles once, not once per trial; and
Dynamo's, within its limits, so that every trial of a warm slot's process compiles.

On a path (one machine, or NFS shared by all): Inductor's cache directory is a folder of the sweep, set in
every worker's environment (`cache_env`), so every trial of the sweep finds the kernels, graphs and autotuning
results an earlier one compiled. On object storage (s3://): each node keeps Inductor's default local cache, and
the sweep's folder holds torch's portable cache artifacts: a worker loads them before it compiles, and a rank 0
that compiled something new saves its own there.

Dynamo's cache lives in the process, per code object (`recompile_limit`).
"""

from __future__ import annotations

import hashlib
import logging

from raysweep import storage

log = logging.getLogger(__name__)

ENV = "TORCHINDUCTOR_CACHE_DIR"


def cache_env(location: str | None) -> dict[str, str]:
    """Worker environment for the sweep's compile cache at `location` (nothing for object storage)."""
    if location is None or storage.is_uri(location):
        return {}
    return {ENV: location}


def load_artifacts(location: str | None) -> int:
    """Object storage: hand every saved artifact file under `location` to torch; returns how many were loaded."""
    import torch

    if location is None or not storage.is_uri(location) or not hasattr(torch.compiler, "load_cache_artifacts"):
        return 0
    loaded = 0
    for name in storage.list_names(location):
        data = storage.read_bytes(storage.join(location, name))
        if data:
            torch.compiler.load_cache_artifacts(data)
            loaded += 1
    return loaded


def save_artifacts(location: str | None) -> str | None:
    """Object storage: what this process compiled, as one artifact file named by its content (trials that
    compiled the same write the same file once). Returns its location, or None when there was nothing to save."""
    import torch

    if location is None or not storage.is_uri(location) or not hasattr(torch.compiler, "save_cache_artifacts"):
        return None
    saved = torch.compiler.save_cache_artifacts()
    if not saved or not saved[0]:
        return None
    target = storage.join(location, hashlib.sha1(saved[0]).hexdigest()[:16] + ".bin")
    if not storage.exists(target):
        storage.write_bytes(target, saved[0])
    return target


# ---------------------------------------------------------------------------------------------
# Dynamo's cache: one per code object, shared by every trial of a process

# the first line of the graph break Dynamo records when a frame passes a recompile limit (torch/_dynamo/
# convert_frame.py; gb0039 in the graph-break registry): one count per refused compile, in counters["unimplemented"]
RECOMPILE_LIMIT_BREAK = "Dynamo recompile limit exceeded"
_hits_at_reset = 0  # recompile_limit_hits() when recover_from_fallback last reset Dynamo (or at start)
_raised: tuple[int, int] | None = None  # (the global limit compile_model set on an older torch, the one it replaced)


def recompile_limit() -> int:
    """The `recompile_limit` for a model compiled now (torch.compile's argument): the frames this process has
    compiled so far, plus torch._dynamo.config.recompile_limit for what the new model compiles. Also raises
    torch._dynamo.config.accumulated_recompile_limit (a cap per code object, global) to the same reach.

    Dynamo keeps compiled code per code object (`CaptchaCNN.forward` and any helper frame it calls), not per
    module: every trial of a warm slot adds its specializations to the same list (each micro-batch, the noise
    meter's half batch, and whatever else is guarded: dropout p, precision, image size). Past the limit, Dynamo
    runs that code eagerly for the rest of the process (it marks the code object run-only; raising the limit later
    does not undo it), with one warning in the worker's log. The frames compiled so far
    (torch._dynamo.utils.counters["frames"]["ok"]) bound the entries of any one code object, so no earlier trial's
    entries count against a new one, while a trial that keeps recompiling still falls back after the configured
    number, as Dynamo intends (and says so: RankModel.check_compiled). Sized from Dynamo's own count rather than
    from the micro-batches seen here, because Dynamo also specializes on what this module cannot see; and
    not a reset per trial or per shape (torch._dynamo.reset()), which would recompile every shape of every trial,
    the cost a warm slot exists to avoid (Inductor's cache makes it cheaper, not free: about 1 s a shape on a CPU
    with the cache warm, 12 s cold)."""
    from torch._dynamo import config
    from torch._dynamo.utils import counters

    base = _configured_limit()
    frames = counters["frames"]
    # accumulated_recompile_limit also counts a code object's compile attempts (refused ones too): "total"
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, frames["total"] + base)
    return frames["ok"] + base


def _configured_limit() -> int:
    """torch._dynamo.config.recompile_limit as configured: the value compile_model replaced while it holds its own."""
    from torch._dynamo import config

    return _raised[1] if _raised is not None and config.recompile_limit == _raised[0] else config.recompile_limit


def compile_model(module):
    """`torch.compile(module, dynamic=False)` with this process's recompile limit (`recompile_limit`). Where
    torch.compile has no `recompile_limit` argument (torch 2.11 lacks it; 2.13 has it), the process-wide
    torch._dynamo.config.recompile_limit is raised to the same value instead: a slot's process trains one model
    at a time, so the global limit is this model's."""
    global _raised
    import inspect

    import torch
    from torch._dynamo import config

    limit = recompile_limit()
    if "recompile_limit" in inspect.signature(torch.compile).parameters:
        return torch.compile(module, dynamic=False, recompile_limit=limit)
    _raised = (limit, _configured_limit())
    config.recompile_limit = limit
    return torch.compile(module, dynamic=False)


def recompile_limit_hits() -> int:
    """How many compiles Dynamo has refused in this process for a recompile limit (each ran its frame eagerly)."""
    from torch._dynamo.utils import counters

    return sum(n for msg, n in counters["unimplemented"].items() if msg.startswith(RECOMPILE_LIMIT_BREAK))


def recover_from_fallback() -> bool:
    """Before a model is compiled: if a recompile limit was hit since the last check, reset Dynamo
    (torch._dynamo.reset()), because the code object that hit it runs eagerly for the rest of the process: an
    earlier trial's fallback must not silently become every later trial's. Its shapes then compile again (from
    Inductor's cache). Returns whether it reset."""
    global _hits_at_reset
    hits = recompile_limit_hits()
    if hits == _hits_at_reset:
        return False
    import torch

    log.info("Dynamo hit a recompile limit in an earlier trial of this process: its caches are reset")
    torch._dynamo.reset()
    _hits_at_reset = hits
    return True
