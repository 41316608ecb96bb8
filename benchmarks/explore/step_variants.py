"""One-off GPU experiment behind issue 19's step design (run once on an H100, 2026-11-23; figures in
benchmarks/RESULTS.md, "GPU step design"): which way of running the same captcha CNN reaches the figures.

The CNN is written here plainly (nn.Conv2d → BatchNorm → ReLU → F.dropout → MaxPool), independent of raysweep's
model, and its step (forward, loss, backward, clip, fused AdamW) runs eager / compiled / compiled + one captured
CUDA graph per step, at batch 1024 and 64, bf16, channels_last; the input with NCHW or NHWC strides
(`layout_fix`); a profile; Inductor cache timings in fresh processes. Needs CUDA.

    cd benchmarks/explore && python step_variants.py     # files into $OUT (default /tmp/out)
"""
import json, os, subprocess, sys, time, traceback
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

OUT = Path(os.environ.get("OUT", "/tmp/out"))
H, W, L, C = 60, 160, 4, 36
T0 = time.perf_counter()
BUDGET = float(os.environ.get("BUDGET", "420"))
results = []


def log(*a):
    print(f"[{time.perf_counter() - T0:6.1f}s]", *a, flush=True)


def dump():
    (OUT / "explore.json").write_text(json.dumps(results, indent=1))


class Block(nn.Module):
    def __init__(self, cin, cout, p):
        super().__init__()
        self.conv, self.bn, self.p = nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), p
        self.pool = nn.MaxPool2d(2)

    def forward(self, x):
        x = torch.relu(self.bn(self.conv(x)))
        return self.pool(F.dropout(x, self.p, self.training))


class Plain(nn.Module):
    def __init__(self, p=0.5):
        super().__init__()
        self.features = nn.Sequential(Block(1, 32, p), Block(32, 64, p), Block(64, 64, p))
        self.fc1, self.fc2, self.p = nn.Linear(64 * 7 * 20, 1024), nn.Linear(1024, L * C), p

    def forward(self, x):
        if x.dtype == torch.uint8:
            x = x.float().div(255.0)
        h = F.dropout(torch.relu(self.fc1(self.features(x).flatten(1))), self.p, self.training)
        return self.fc2(h)


def make(batch, mode, p=0.5, graphs=False, n_batches=8, model_kind="plain", uint8_in=False, layout_fix=False):
    dev = torch.device("cuda")
    torch._dynamo.reset()
    torch.manual_seed(0)
    if model_kind == "plain":
        model = Plain(p)
    else:
        sys.path.insert(0, os.getcwd())
        from raysweep.model import CaptchaCNN
        model = CaptchaCNN(H, W, L, C, p)
    model = model.to(memory_format=torch.channels_last).to(dev)
    step_model = model if mode == "eager" else torch.compile(model, mode=mode, dynamic=False)
    lr = torch.tensor(1e-3, device=dev) if graphs else 1e-3
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4, fused=True, capturable=graphs)
    params = list(model.parameters())
    images = torch.randint(0, 256, (batch * n_batches, H, W), dtype=torch.uint8, device=dev)
    labels = torch.randint(0, C, (batch * n_batches, L), device=dev)
    targets = F.one_hot(labels, C).flatten(1).float()
    idx = torch.empty(batch, dtype=torch.int64, device=dev)
    loss_sum = torch.zeros((), device=dev, dtype=torch.float64)

    def step():
        xb = images[idx].unsqueeze(1)
        if layout_fix:
            xb = xb.as_strided(xb.shape, (H * W, 1, W, 1))
        x = xb if uint8_in else xb.float().div_(255.0)
        if not uint8_in:
            x = x.contiguous(memory_format=torch.channels_last)
        y = targets[idx]
        with torch.autocast("cuda", torch.bfloat16):
            logits = step_model(x)
        loss = F.multilabel_soft_margin_loss(logits.float(), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_sum.add_(loss.detach())

    perms = [torch.randperm(batch * n_batches, device=dev)[:batch] for _ in range(n_batches)]
    if not graphs:
        def run(i):
            idx.copy_(perms[i % n_batches])
            step()
        return run
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(3):
            idx.copy_(perms[i])
            step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()

    def run(i):
        idx.copy_(perms[i % n_batches])
        g.replay()
    return run


def measure(name, batch, steps, **kw):
    if time.perf_counter() - T0 > BUDGET:
        log("skip (budget)", name)
        return
    row = {"name": name, "batch": batch, **{k: str(v) for k, v in kw.items()}}
    try:
        t = time.perf_counter()
        run = make(batch, **kw)
        for i in range(3):
            run(i)
        torch.cuda.synchronize()
        row["setup_s"] = time.perf_counter() - t
        t = time.perf_counter()
        for i in range(steps):
            run(i)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
        row.update(images_per_s=batch * steps / dt, step_ms=1e3 * dt / steps,
                   peak_alloc_gib=torch.cuda.max_memory_allocated() / 2**30)
        log(f"{name:40s} batch {batch:5d}: {row['images_per_s']:10,.0f} img/s  {row['step_ms']:.3f} ms/step  "
            f"setup {row['setup_s']:.1f}s")
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {str(e)[:600]}"
        log(name, "ERROR", row["error"])
        traceback.print_exc()
    results.append(row)
    dump()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return row


def profile(batch, steps=10, **kw):
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile as tprof
    run = make(batch, **kw)
    for i in range(3):
        run(i)
    torch.cuda.synchronize()
    with tprof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            run(i)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    by = {}
    for e in kernels:
        by.setdefault(e.name, [0, 0.0])
        by[e.name][0] += 1
        by[e.name][1] += e.time_range.elapsed_us() / 1e3 / steps
    top = sorted(by.items(), key=lambda kv: -kv[1][1])
    lines = [f"profile {kw} batch {batch}: {len(kernels) / steps:.0f} kernels/step, busy {sum(v[1] for v in by.values()):.2f} ms/step"]
    lines += [f"  {ms:7.3f} ms  x{n / steps:4.0f}  {name[:150]}" for name, (n, ms) in top[:40]]
    conv = [k for k in by if "nchw" in k.lower() or "nhwc" in k.lower()]
    lines.append(f"layout-conversion kernels: {conv}")
    text = "\n".join(lines)
    print(text, flush=True)
    with open(OUT / "explore_profile.txt", "a") as f:
        f.write(text + "\n\n")


CACHE_CHILD = r"""
import os, sys, time, torch
sys.path.insert(0, os.environ["SCRATCH"])
t0 = time.perf_counter()
import step_variants as explore
art = os.environ.get("LOAD_ART")
if art and os.path.exists(art):
    torch.compiler.load_cache_artifacts(open(art, "rb").read())
t1 = time.perf_counter()
run = explore.make(1024, "default", graphs=True)
run(0); torch.cuda.synchronize()
t2 = time.perf_counter()
save = os.environ.get("SAVE_ART")
if save:
    r = torch.compiler.save_cache_artifacts()
    if r is not None:
        open(save, "wb").write(r[0])
print(f"CACHE {os.environ.get('LABEL')}: import+load {t1 - t0:.1f} s, compile+capture+first step {t2 - t1:.1f} s", flush=True)
"""


def cache_timings():
    import tempfile
    d = tempfile.mkdtemp()
    art = os.path.join(d, "artifacts.bin")
    env = dict(os.environ, SCRATCH=str(Path(__file__).parent), TORCHINDUCTOR_CACHE_DIR=os.path.join(d, "c1"))
    for label, extra in [("cold", {"SAVE_ART": art}), ("warm-same-dir", {}),
                         ("fresh-dir+artifacts", {"TORCHINDUCTOR_CACHE_DIR": os.path.join(d, "c2"), "LOAD_ART": art}),
                         ("fresh-dir-no-artifacts", {"TORCHINDUCTOR_CACHE_DIR": os.path.join(d, "c3")})]:
        if time.perf_counter() - T0 > BUDGET + 60:
            log("skip cache", label)
            continue
        t = time.perf_counter()
        r = subprocess.run([sys.executable, "-c", CACHE_CHILD], env={**env, **extra, "LABEL": label},
                           capture_output=True, text=True, timeout=240)
        line = [l for l in r.stdout.splitlines() if l.startswith("CACHE")]
        log(f"{label}: wall {time.perf_counter() - t:.1f} s", line, r.stderr[-1500:] if r.returncode else "")
        results.append({"cache": label, "wall_s": time.perf_counter() - t, "line": line,
                        "size": os.path.getsize(art) if os.path.exists(art) else None})
        dump()


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    torch.backends.cudnn.benchmark = True
    log(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())
    which = sys.argv[1:] or ["main"]
    if "main" in which:
        measure("raysweep eager", 1024, 20, mode="eager", model_kind="raysweep")
        measure("plain eager", 1024, 20, mode="eager")
        measure("plain compile", 1024, 30, mode="default")
        measure("plain compile+graph", 1024, 30, mode="default", graphs=True)
        measure("plain compile+graph layoutfix", 1024, 30, mode="default", graphs=True, layout_fix=True)
        measure("plain compile+graph uint8in", 1024, 30, mode="default", graphs=True, uint8_in=True)
        measure("plain compile+graph p0", 1024, 30, mode="default", graphs=True, p=0.0)
        measure("plain compile+graph", 64, 200, mode="default", graphs=True)
        measure("plain compile", 64, 200, mode="default")
        measure("plain eager+graph", 64, 200, mode="eager", graphs=True)
        measure("plain reduce-overhead", 64, 200, mode="reduce-overhead")
        measure("plain compile+graph", 256, 60, mode="default", graphs=True)
        measure("plain compile+graph", 4096, 10, mode="default", graphs=True)
        try:
            profile(1024, mode="default", graphs=False)
            profile(1024, mode="eager", graphs=False)
        except Exception:
            traceback.print_exc()
        cache_timings()
        measure("plain max-autotune-nocg+graph", 1024, 30, mode="max-autotune-no-cudagraphs", graphs=True)
    log("done")
