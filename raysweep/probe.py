"""`python -m raysweep probe`: the largest per-GPU batch that fits, found under the spec's real scaling.

Fresh worker processes (the spec's world size, device and precision) run one full training step
per candidate: doubling from `--start`, then bisecting between the last fit and the first OOM.
Every rank catches `torch.OutOfMemoryError` and the outcome is all-reduced, so all ranks agree and
none waits in a collective (train_loop.probe_step). The table goes to the console, to JSON under
the storage path, and to MLflow as a run of its own with a plot.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from raysweep.config import SweepConfig
from raysweep.errors import UserError


def probe_worker(config: dict) -> None:
    """Every rank: candidate batch sizes in lockstep (each outcome is agreed by all-reduce)."""
    import ray.train
    import ray.train.torch
    import torch

    from raysweep.config import TrialConfig
    from raysweep.optim import build_optimizer
    from raysweep.train_loop import _device_name, build_model, probe_step, resolve_precision

    trial = TrialConfig.from_dict(config["trial"])
    opts = config["probe"]
    ctx = ray.train.get_context()
    device = ray.train.torch.get_device()
    torch.manual_seed(trial.train.seed)
    model = ray.train.torch.prepare_model(build_model(trial))  # DDP's buckets count too
    core = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    optimizer = build_optimizer(core, trial.peak_lr, trial.knobs.weight_decay, device.type)
    precision = resolve_precision(trial.train.precision, device)
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    results = []

    def fits(batch: int) -> bool:
        r = probe_step(core, optimizer, scaler, trial, batch, device, precision)
        if device.type == "cpu" and opts["max_memory_gb"] is not None:
            r["fits"] = r["fits"] and r["peak_rss_gb"] <= opts["max_memory_gb"]  # CPU: no allocator limit
        r["images_per_s"] = batch * ctx.get_world_size() / r["step_time_s"] if r["fits"] else 0.0
        results.append(r)
        return r["fits"]

    last_fit, first_oom, batch = None, None, opts["start"]
    while batch <= opts["max_batch"]:
        if not fits(batch):
            first_oom = batch
            break
        last_fit, batch = batch, batch * 2
    if last_fit is not None and first_oom is not None:
        lo, hi = last_fit, first_oom
        while hi - lo > 1:  # bisect: the largest batch that fits, exactly
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        last_fit = lo
    if ctx.get_world_rank() == 0:
        out = Path(config["output_file"])
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"results": results, "largest": last_fit, "world_size": ctx.get_world_size(),
                                   "device_name": _device_name(device), "precision": precision}, indent=1))


@dataclass(frozen=True)
class ProbeResult:
    rows: list[dict]
    largest: int | None
    recommended: int | None
    limit_gb: float
    memory_key: str
    device_name: str
    precision: str
    world_size: int
    path: Path


def probe(config: SweepConfig, start: int = 8, max_batch: int = 65536, margin: float = 0.1,
          max_memory_gb: float | None = None) -> ProbeResult:
    """Run the probe on the connected Ray cluster; returns the table and the recommendation."""
    from raysweep.train_loop import make_trainer, worker_env

    trial = config.trial(config.default_knobs(), train_size=1)
    storage = config.storage_path.expanduser().resolve() / config.name / "probe"
    name = f"probe-{datetime.now():%Y%m%d-%H%M%S}"
    out = storage / name / "probe.json"
    opts = {"start": start, "max_batch": max_batch, "max_memory_gb": max_memory_gb}
    make_trainer(trial, None, str(storage), name, env=worker_env(), worker_fn=probe_worker,
                 extra_config={"probe": opts, "output_file": str(out)}).fit()
    data = json.loads(out.read_text())
    rows = sorted(data["results"], key=lambda r: r["per_gpu_batch_size"])
    gpu = config.scaling.use_gpu
    memory_key = "peak_mem_reserved_gb" if gpu else "peak_rss_gb"
    capacity = rows[0]["device_memory_gb"] if gpu else (max_memory_gb or rows[0]["device_memory_gb"] / data["world_size"])
    limit = capacity * (1 - margin)
    safe = [r["per_gpu_batch_size"] for r in rows if r["fits"] and r[memory_key] <= limit]
    return ProbeResult(rows, data["largest"], max(safe) if safe else None, limit, memory_key, data["device_name"],
                       data["precision"], data["world_size"], out)


def report(result: ProbeResult, config: SweepConfig, tracking_uri: str, margin: float) -> None:
    """Console table, and the MLflow run (metrics per batch, JSON and a PNG plot)."""
    from raysweep.sweep import format_table

    rows = [[str(r["per_gpu_batch_size"]), "yes" if r["fits"] else "OOM", f"{r['peak_mem_allocated_gb']:.2f}",
             f"{r['peak_mem_reserved_gb']:.2f}", f"{r['peak_rss_gb']:.2f}", f"{r['step_time_s']:.3f}",
             f"{r['images_per_s']:,.0f}"] for r in result.rows]
    print(f"probe: {result.world_size} workers on {result.device_name}, {result.precision}, one full step per batch")
    print(format_table(("per_gpu_batch", "fits", "alloc_gib", "reserved_gib", "rss_gib", "step_s", "images/s"), rows))
    print(f"largest per-GPU batch that fits: {result.largest}")
    print(f"recommended: {result.recommended} ({result.memory_key} ≤ {result.limit_gb:.2f} GiB, a {margin:.0%} margin)")
    print(f"table: {result.path}")
    _log_mlflow(result, config, tracking_uri, margin)


def _log_mlflow(result: ProbeResult, config: SweepConfig, tracking_uri: str, margin: float) -> None:
    import tempfile

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from mlflow.entities import Metric, Param

    from raysweep import tracking
    from raysweep.config import spec_yaml

    experiment_id, run_id = tracking.open_sweep(
        tracking_uri, config.experiment_name, run_name=f"probe {datetime.now():%Y-%m-%d %H:%M:%S}",
        tags={"raysweep.kind": "probe"}, spec_text=spec_yaml(config))
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    now = int(time.time() * 1000)
    keys = ("peak_mem_allocated_gb", "peak_mem_reserved_gb", "peak_rss_gb", "step_time_s", "images_per_s")
    metrics = [Metric(k, float(r[k]), now, r["per_gpu_batch_size"]) for r in result.rows for k in keys]
    metrics += [Metric("fits", float(r["fits"]), now, r["per_gpu_batch_size"]) for r in result.rows]
    params = {"world_size": result.world_size, "device_name": result.device_name, "precision": result.precision,
              "largest_per_gpu_batch": result.largest, "recommended_per_gpu_batch": result.recommended,
              "margin": margin, "memory_limit_gb": round(result.limit_gb, 3)}
    client.log_batch(run_id, metrics=metrics, params=[Param(k, str(v)) for k, v in params.items()])
    client.log_artifact(run_id, str(result.path))
    fig, (ax_mem, ax_rate) = plt.subplots(1, 2, figsize=(10, 4))
    xs = [r["per_gpu_batch_size"] for r in result.rows]
    for ax, key, label in ((ax_mem, result.memory_key, "peak memory (GiB)"), (ax_rate, "images_per_s", "images/s")):
        ax.scatter(xs, [r[key] for r in result.rows], c=["tab:green" if r["fits"] else "tab:red" for r in result.rows])
        ax.set_xscale("log", base=2)
        ax.set_xlabel("per-GPU batch")
        ax.set_ylabel(label)
    ax_mem.axhline(result.limit_gb, color="grey", linestyle="--", label="limit after margin")
    ax_mem.legend()
    fig.suptitle(f"probe: {result.world_size} × {result.device_name}, {result.precision} (red: OOM)")
    fig.tight_layout()
    with tempfile.TemporaryDirectory() as d:
        png = Path(d) / "probe.png"
        fig.savefig(png, dpi=100)
        client.log_artifact(run_id, str(png))
    plt.close(fig)
    client.set_terminated(run_id, status="FINISHED")


def run(config: SweepConfig, *, address: str | None, start: int, max_batch: int, margin: float,
        max_memory_gb: float | None, verbose: bool) -> int:
    """The `probe` command. Exit 0 when some batch fits, 1 when none does."""
    import ray

    from raysweep import tracking
    from raysweep.sweep import connect, plan_concurrency

    if not 0 <= margin < 1:
        raise UserError(f"--margin {margin}: expected a fraction in [0, 1), e.g. 0.1")
    if start < 1 or max_batch < start:
        raise UserError(f"--start {start} --max-batch {max_batch}: expected 1 ≤ start ≤ max-batch")
    tracking_uri = tracking.resolve_tracking_uri(config.mlflow.tracking_uri)
    started = connect(address, config, verbose)
    try:
        plan_concurrency(ray.cluster_resources(), config, 1)  # one trial's workers must fit
        result = probe(config, start, max_batch, margin, max_memory_gb)
        report(result, config, tracking_uri, margin)
        return 0 if result.largest else 1
    finally:
        if started:
            ray.shutdown()
