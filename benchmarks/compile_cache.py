"""What a sweep's compile cache saves: the same trial's start-up in fresh processes, one after another, sharing
the sweep's Inductor cache directory (as every trial of a sweep on one machine does: worker/compile_cache.py),
then one in a process with an empty cache that loads the portable artifacts the first one saved (how trials on
other nodes share it through object storage).

Each process builds the rank exactly as a worker does (TrainingRun.build, fit_in_memory: the probe step
compiles) and trains one epoch (a CUDA graph's capture where one applies), then prints its `compile_s` and
Inductor's cache hits. No Ray, no MLflow. The model runs CUDA's path (the one compiled by default) on the CPU too.

    python benchmarks/compile_cache.py                # cuda:0, batch 1024, bf16, 160×60
    python benchmarks/compile_cache.py --batches 1024,64
    python benchmarks/compile_cache.py --quick        # CPU allowed, small images (CI)
Last line: RESULT compile_cache ratio=<first trial's compile_s ÷ the second's> (with --trials 1, the second is the
one that loaded the artifacts).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, os, sys, time
t0 = time.perf_counter()
import numpy as np, torch
sys.path.insert(0, os.environ["RAYSWEEP_ROOT"])
sys.path.insert(0, os.path.join(os.environ["RAYSWEEP_ROOT"], "benchmarks"))
from gpu_throughput import one_gpu_trial
from raysweep.data import CaptchaArrays, CaptchaData
from raysweep.worker import compile_cache
from raysweep.worker.device import setup_device
from raysweep.worker.run import TrainingRun
args = json.loads(sys.argv[1])
device = torch.device(args["device"])
setup_device(device)
torch.zeros(1, device=device)  # the device's context: not compile time
t_ready = time.perf_counter()
loaded = compile_cache.load_artifacts(args.get("artifacts"))
out = {"import_and_device_s": t_ready - t0, "artifacts_loaded": loaded, "trials": []}
for batch in args["batches"]:
    torch._dynamo.reset()
    trial = one_gpu_trial(batch, args["precision"], args["height"], args["width"], train_size=batch * 4)
    trial = trial.model_copy(update={"train": trial.train.model_copy(update={"compile": True, "epochs": 1})})
    rng = np.random.default_rng(0)
    arrays = lambda n: CaptchaArrays(rng.integers(0, 256, (n, args["height"], args["width"]), dtype=np.uint8),
                                     rng.integers(0, 36, (n, 4), dtype=np.uint8))
    t = time.perf_counter()
    run = TrainingRun.build(trial, CaptchaData(arrays(batch * 4), arrays(batch), "random"), 0, 1, device, path="plain")
    run.fit_in_memory()
    run.epoch(1)
    out["trials"].append({"batch": batch, "compile_s": run.net.compile_s,
                          "startup_and_epoch_s": time.perf_counter() - t})
if args.get("save"):
    out["artifacts_saved"] = compile_cache.save_artifacts(args["save"])
from torch._dynamo.utils import counters
out["inductor_counters"] = {k: v for k, v in counters["inductor"].items() if "cache" in k}
out["aot_autograd_counters"] = {k: v for k, v in counters["aot_autograd"].items() if "cache" in k}
print("CHILD " + json.dumps(out), flush=True)
"""


def child(args: dict, cache_dir: str) -> dict:
    env = dict(os.environ, RAYSWEEP_ROOT=str(ROOT), TORCHINDUCTOR_CACHE_DIR=cache_dir)
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", CHILD, json.dumps(args)], env=env, capture_output=True, text=True,
                       timeout=600)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("CHILD ")), None)
    if r.returncode != 0 or line is None:
        raise SystemExit(f"compile_cache: a trial process failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
    return {**json.loads(line[6:]), "process_s": time.perf_counter() - t}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small images on the CPU when there is no GPU (CI)")
    p.add_argument("--trials", type=int, default=2, help="processes sharing the sweep's cache directory")
    p.add_argument("--batches", default="1024", help="per-GPU batches each process compiles, in turn")
    p.add_argument("--json", default=None)
    a = p.parse_args()

    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not a.quick:
        print("compile_cache: no CUDA device; run with --quick to check the code path on CPU", file=sys.stderr)
        return 2
    args = {"device": "cuda:0" if cuda else "cpu", "precision": "bf16" if cuda else "fp32",
            "height": 60 if not a.quick else 24, "width": 160 if not a.quick else 64,
            "batches": [int(b) for b in a.batches.split(",")] if not a.quick else [16]}
    work = Path(tempfile.mkdtemp(prefix="raysweep-compile-cache-"))
    # the artifacts' folder: a path here, handed over as a file:// URI so that it takes the object-storage route
    artifacts = f"file://{work / 'artifacts'}"
    (work / "artifacts").mkdir()
    print(f"compile_cache on {torch.cuda.get_device_name(0) if cuda else 'CPU'}, torch {torch.__version__}: "
          f"batches {args['batches']} {args['precision']} {args['width']}×{args['height']}, fresh processes",
          flush=True)
    results = []
    for i in range(a.trials):
        r = child({**args, "save": artifacts if i == 0 else None}, str(work / "sweep_cache"))
        results.append({"trial": i + 1, "cache": "cold" if i == 0 else "the sweep's", **r})
    r = child({**args, "artifacts": artifacts}, str(work / "empty_cache"))
    results.append({"trial": a.trials + 1, "cache": "empty + artifacts", **r})
    for r in results:
        per = ", ".join(f"batch {t['batch']}: compile_s {t['compile_s']:.1f}" for t in r["trials"])
        print(f"trial {r['trial']} ({r['cache']}): {per}; process {r['process_s']:.1f} s (import + device "
              f"{r['import_and_device_s']:.1f} s); Inductor {r['inductor_counters']}, AOTAutograd "
              f"{r['aot_autograd_counters']}", flush=True)
    first = sum(t["compile_s"] for t in results[0]["trials"])
    second = sum(t["compile_s"] for t in results[1]["trials"])
    if a.json:
        Path(a.json).write_text(json.dumps({"args": args, "results": results}, indent=1))
    print(f"RESULT compile_cache ratio={first / max(second, 1e-9):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
