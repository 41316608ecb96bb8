"""Inductor's caches for a sweep, so that a sweep compiles once, not once per trial.

On a path (one machine, or NFS shared by all): Inductor's cache directory is a folder of the sweep, set in
every worker's environment (`cache_env`), so every trial of the sweep finds the kernels, graphs and autotuning
results an earlier one compiled. On object storage (s3://): each node keeps Inductor's default local cache, and
the sweep's folder holds torch's portable cache artifacts: a worker loads them before it compiles, and a rank 0
that compiled something new saves its own there.
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
