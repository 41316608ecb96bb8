"""One-off GPU experiment behind issue 19's step design (benchmarks/RESULTS.md, "GPU step design"): raysweep's
own step (gpu_throughput.Bench, batch 1024 bf16 compiled) with one part swapped back: the first convolution on
cuDNN instead of nine shifted multiply-adds, native dropout instead of the one-bit masks, dropout 0; then
profiles of the step with and without the multiply-adds. Needs CUDA. Its first run (2026-11-23, with the
multiply-adds as the variant) recorded only the profiles: a bug cost the throughput rows.

    python benchmarks/explore/step_ablations.py           # from the repository root; files into $OUT
"""
import json, os, sys, time, traceback
from pathlib import Path
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT)); sys.path.insert(0, str(ROOT / "benchmarks"))
import torch
import torch.nn.functional as F
import raysweep.model as M
from gpu_throughput import Bench, measure, profile, flops_per_image

OUT = Path(os.environ.get("OUT", "/tmp/out"))
T0 = time.perf_counter()
BUDGET = float(os.environ.get("BUDGET", "150"))
rows = []
real_dropout, real_forward = M.plain_dropout, M.ConvBlock.forward


def native_dropout(x, p, training):
    return F.dropout(x, p, training) if training and p > 0 else x


def cudnn_conv1(self, x):
    """The CUDA path as it was before the first convolution became multiply-adds: cuDNN for every conv."""
    if not x.is_cuda:
        return real_forward(self, x)
    return self.pool(M.plain_dropout(torch.relu(self.bn(self.conv(x))), self.dropout, self.training))


VARIANTS = {
    "product": {},  # raysweep's model as it is
    "cudnn-conv1": {"forward": cudnn_conv1},
    "native-dropout": {"dropout": native_dropout},
}


def run(variant, batch, mode, steps, p=0.5):
    if time.perf_counter() - T0 > BUDGET:
        print("skip", variant, batch, mode, flush=True); return
    patch = VARIANTS[variant]
    M.plain_dropout = patch.get("dropout", real_dropout)
    M.ConvBlock.forward = patch.get("forward", real_forward)
    row = {"variant": variant, "batch": batch, "mode": mode, "dropout": p}
    try:
        b = Bench(torch.device("cuda:0"), batch, "bf16", mode, 60, 160, steps)
        if p != 0.5:
            for m in b.net.core.modules():
                if hasattr(m, "dropout") and isinstance(m.dropout, float):
                    m.dropout = p
        rate, alloc, res = measure(b)
        row.update(images_per_s=rate, alloc_gib=alloc, **b.setting())
        print(f"{variant:24s} batch {batch:5d} {mode:7s} p={p}: {rate:10,.0f} img/s  alloc {alloc:.2f} GiB  compile {b.net.compile_s:.1f}s", flush=True)
        del b
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        print(variant, batch, mode, "ERROR", row["error"], flush=True)
        traceback.print_exc()
    finally:
        M.plain_dropout, M.ConvBlock.forward = real_dropout, real_forward
    rows.append(row)
    (OUT / "ablation.json").write_text(json.dumps(rows, indent=1))
    torch.cuda.empty_cache()


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    run("product", 1024, "on", 30)
    run("product", 1024, "on", 30, p=0.0)
    run("cudnn-conv1", 1024, "on", 30)
    run("native-dropout", 1024, "on", 30)
    for variant in ("product", "cudnn-conv1"):  # where the time goes, and the layout conversions
        try:
            M.ConvBlock.forward = VARIANTS[variant].get("forward", real_forward)
            profile(Bench(torch.device("cuda:0"), 1024, "bf16", "on", 60, 160, 10), 10, flops_per_image(60, 160), 989.0)
        except Exception:
            traceback.print_exc()
        finally:
            M.ConvBlock.forward = real_forward
