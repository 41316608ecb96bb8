"""`gpu_suite.sh --cpu-smoke` only: makes the top-level packages named in RAYSWEEP_BLOCK_IMPORTS unimportable,
as they are on a lent GPU machine (no Ray, MLflow or captcha there), so the smoke proves the suite needs none."""

import importlib.abc
import os
import sys

_BLOCKED = {name.strip() for name in os.environ.get("RAYSWEEP_BLOCK_IMPORTS", "").split(",") if name.strip()}


class _Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in _BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by gpu_suite.sh --cpu-smoke: the GPU "
                                      f"machine has no {name.partition('.')[0]})", name=name)
        return None


if _BLOCKED:
    sys.meta_path.insert(0, _Blocker())
