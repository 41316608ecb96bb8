"""The largest per-GPU batch that fits on this GPU, in bf16 and fp32, with the memory each image costs.

The `probe` command's own search (doubling, then bisecting: `probe.largest_fitting`) and step
(`worker.probe_step.probe_step`: one full training step, a real `torch.OutOfMemoryError` caught), on one GPU in a
plain process: no Ray, no MLflow. Memory per image is the slope of the allocator's peak between the two
largest batches that fit; what is left at batch 0 is the model, its gradients and AdamW's moments.

    python benchmarks/gpu_probe.py                    # cuda:0, 160×60 images, bf16 then fp32
    python benchmarks/gpu_probe.py --quick            # CPU allowed: checks the code path (CI)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MARGIN = 0.1  # the probe command's default: recommend a batch whose reserved peak leaves 10 % of the GPU free


def probe_precision(device, precision: str, start: int, max_batch: int, height: int, width: int) -> dict:
    import torch

    from raysweep.probe import largest_fitting
    from raysweep.worker.net import RankModel
    from raysweep.worker.probe_step import probe_step

    from gpu_throughput import one_gpu_trial

    trial = one_gpu_trial(1, precision, height, width, train_size=1)
    net = RankModel.build(trial, device, measure_noise=False, compile=False)  # eager, as the probe command
    rows = []

    def fits(batch: int) -> bool:
        try:
            r = probe_step(net, trial, batch)
        except RuntimeError as e:  # not an OOM (e.g. a kernel's size limit): that batch does not run either
            rows.append({"batch": batch, "fits": False, "error": str(e).splitlines()[0][:160]})
            if device.type == "cuda":
                torch.cuda.empty_cache()
            return False
        rows.append({"batch": batch, "fits": r.fits, "alloc_gib": r.peak_mem_allocated_gb,
                     "reserved_gib": r.peak_mem_reserved_gb, "step_s": r.step_time_s, "total_gib": r.device_memory_gb})
        return r.fits

    largest = largest_fitting(fits, start, max_batch)
    rows.sort(key=lambda r: r["batch"])
    ok = [r for r in rows if r["fits"]]
    total = ok[0]["total_gib"] if ok else None
    safe = [r["batch"] for r in ok if r["reserved_gib"] <= (1 - MARGIN) * total]
    per_image = fixed = None
    if len(ok) >= 2:
        lo, hi = ok[-2], ok[-1]
        per_image = (hi["alloc_gib"] - lo["alloc_gib"]) / (hi["batch"] - lo["batch"])
        fixed = lo["alloc_gib"] - per_image * lo["batch"]
    return {"precision": net.precision, "largest": largest, "recommended": max(safe) if safe else None,
            "gib_per_image": per_image, "fixed_gib": fixed, "device_gib": total, "rows": rows}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small images and batches; runs on CPU when no GPU (CI)")
    p.add_argument("--precisions", default="bf16,fp32")
    p.add_argument("--start", type=int, default=64)
    p.add_argument("--max-batch", type=int, default=131072)
    p.add_argument("--json", default=None)
    a = p.parse_args()

    import torch

    from gpu_throughput import training_device

    device = training_device("gpu_probe", a.quick)
    if device is None:
        return 2
    cuda = device.type == "cuda"
    height, width, start, max_batch = 60, 160, a.start, a.max_batch
    if a.quick:
        height, width, start, max_batch = 24, 64, 8, 256
    name = torch.cuda.get_device_name(device) if cuda else "CPU"
    print(f"gpu_probe on {name}, torch {torch.__version__}; images {width}×{height}; one full training step per "
          f"batch, doubling from {start} then bisecting (up to {max_batch})", flush=True)
    results = []
    for precision in a.precisions.split(","):
        res = probe_precision(device, precision, start, max_batch, height, width)
        results.append(res)
        print(f"{res['precision']}: {'batch':>7s} {'fits':>5s} {'alloc GiB':>9s} {'resv GiB':>8s} {'step s':>7s} "
              f"{'images/s':>10s}")
        for r in res["rows"]:
            if "error" in r:
                print(f"      {r['batch']:7d} {'no':>5s}  error: {r['error']}")
            elif r["fits"]:
                print(f"      {r['batch']:7d} {'yes':>5s} {r['alloc_gib']:9.2f} {r['reserved_gib']:8.2f} "
                      f"{r['step_s']:7.3f} {r['batch'] / max(r['step_s'], 1e-9):10,.0f}")
            else:
                print(f"      {r['batch']:7d} {'OOM':>5s}")
        per_image = (f"{1024 * res['gib_per_image']:.2f} MiB per image (+ {res['fixed_gib']:.2f} GiB model, gradients, "
                     f"AdamW)" if res["gib_per_image"] is not None else "memory per image: n/a")
        print(f"{res['precision']}: largest per-GPU batch {res['largest']}; recommended {res['recommended']} "
              f"(reserved ≤ {100 * (1 - MARGIN):.0f} % of {res['device_gib'] or 0:.1f} GiB); {per_image}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"device": name, "torch": torch.__version__, "results": results}, indent=1))
    print(f"RESULT gpu_probe value={float(results[0]['largest'] or 0):.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
