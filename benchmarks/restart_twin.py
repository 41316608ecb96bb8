"""A restart against its uninterrupted twin, at the rank level: 2 gloo ranks on this CPU, 4 epochs, one run
checkpointed after epoch 2, rebuilt from that checkpoint (start-up probe step included) and continued.
Prints each run's per-epoch train loss, their difference and the largest final weight difference.

    python benchmarks/restart_twin.py      # the rank code of tests/test_resilience.py's twin test

To see the bug this guards against, run it with `git show e484a5c:raysweep/worker/probe_step.py` in place
of raysweep/worker/probe_step.py (the probe step that cleared AdamW's state).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def main() -> int:
    from ranks import run_ranks
    from test_resilience import _run_with_a_restart

    with tempfile.TemporaryDirectory() as d:
        twin = run_ranks(_run_with_a_restart, 2, device_type="cpu", restart_after=None, folder=d)[0]
        restarted = run_ranks(_run_with_a_restart, 2, device_type="cpu", restart_after=2, folder=d)[0]
        a, b = np.load(twin["weights"]), np.load(restarted["weights"])
        weight_diff = max(float(np.max(np.abs(a[k].astype(np.float64) - b[k].astype(np.float64)))) for k in a)
    epochs = sorted(twin["losses"])
    print("uninterrupted train_loss:", ", ".join(f"{twin['losses'][e]:.6f}" for e in epochs))
    print("restarted     train_loss:", ", ".join(f"{restarted['losses'][e]:.6f}" for e in epochs))
    diffs = [abs(restarted["losses"][e] - twin["losses"][e]) for e in epochs]
    print("difference per epoch:    ", ", ".join(f"{x:.4g}" for x in diffs))
    print(f"RESULT restart_twin max_loss_diff={max(diffs):.4g} max_weight_diff={weight_diff:.4g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
