"""One-off CPU check behind `train.compile: auto` being off on CPU workers (benchmarks/RESULTS.md): one rank's
fit_in_memory and two epochs of raysweep's step at batch 32, fp32, 160×60 images, with the model's CPU path,
eager or compiled. Prints images/s and compile_s per epoch.

    python benchmarks/explore/cpu_compile.py 0     # eager
    python benchmarks/explore/cpu_compile.py 1     # compiled
"""
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT)), sys.path.insert(0, str(ROOT / "benchmarks"))
from gpu_throughput import one_gpu_trial  # noqa: E402
from raysweep.data import CaptchaArrays, CaptchaData  # noqa: E402
from raysweep.worker.run import TrainingRun  # noqa: E402

compiled = sys.argv[1:] == ["1"]
torch.manual_seed(0)
trial = one_gpu_trial(32, "fp32", 60, 160, 512, "on" if compiled else "off")
rng = np.random.default_rng(0)


def arrays(n):
    return CaptchaArrays(rng.integers(0, 256, (n, 60, 160), dtype=np.uint8), rng.integers(0, 36, (n, 4), dtype=np.uint8))


run = TrainingRun.build(trial, CaptchaData(arrays(512), arrays(128), "random"), 0, 1, torch.device("cpu"))
t = time.perf_counter()
run.fit_in_memory()
print(f"compiled={compiled}: fit_in_memory {time.perf_counter() - t:.1f} s")
for epoch in (1, 2):
    m = run.epoch(epoch)
    print(f"compiled={compiled} epoch {epoch}: {m.samples_per_s:.1f} images/s, compile_s {m.compile_s:.1f}")
