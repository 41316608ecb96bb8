"""`python -m raysweep probe`: the largest per-GPU batch that fits, found under the spec's real scaling.

Fresh worker processes (the spec's world size, device and precision) run one full training step
per candidate: doubling from `--start`, then bisecting between the last fit and the first OOM.
Every rank catches `torch.OutOfMemoryError` and the outcome is all-reduced, so all ranks agree and
none waits in a collective (worker/probe_step.py). The table goes to the console, to JSON under
the storage path, and to MLflow as a run of its own with a plot.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

from raysweep import layout, storage
from raysweep.config import SweepConfig
from raysweep.errors import UserError


@dataclass(frozen=True)
class ProbeOptions:
    """What the probe's workers need beyond the trial (crosses the Ray boundary as a dict)."""

    start: int  # first per-GPU batch tried
    max_batch: int  # stop doubling here
    max_memory_gb: float | None  # CPU workers: a batch fits only if its peak RSS stays under this
    output_file: str  # rank 0 writes the table here (JSON)


def largest_fitting(fits, start: int, max_batch: int) -> int | None:
    """The largest batch in [start, max_batch] for which `fits(batch)` holds: doubling from `start`, then
    bisecting between the last fit and the first failure (None when `start` does not fit). Ray-free: the
    probe's workers and benchmarks/gpu_probe.py share it."""
    last_fit, first_oom, batch = None, None, start
    while batch <= max_batch:
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
    return last_fit


def probe_worker(config: dict) -> None:
    """Every rank: candidate batch sizes in lockstep (each outcome is agreed by all-reduce)."""
    import dataclasses

    import ray
    import ray.train
    import ray.train.torch

    from raysweep.config import TrialConfig
    from raysweep.models import resolve_on_worker
    from raysweep.worker.device import device_name, setup_device
    from raysweep.worker.net import RankModel
    from raysweep.worker.probe_step import probe_step

    trial, opts = TrialConfig.from_dict(config["trial"]), ProbeOptions(**config["probe"])
    ctx = ray.train.get_context()
    resolve_on_worker(trial.model, ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id())
    device = ray.train.torch.get_device()
    setup_device(device, share=1 / trial.scaling.workers_per_gpu)
    # eager: compiling each candidate batch would cost seconds to tens of seconds apiece. The compiled step needs
    # less (batch 1024 bf16 on an H100: 3.58 GiB allocated against 5.56 eager), so the eager bound is safe, and a
    # trial's own start-up probe step runs its compiled step anyway and downshifts where it does not fit
    net = RankModel.build(trial, device, wrap=ray.train.torch.prepare_model, compile=False)  # DDP's buckets count too
    results = []

    def fits(batch: int) -> bool:
        r = probe_step(net, trial, batch)
        ok = r.fits and (device.type != "cpu" or opts.max_memory_gb is None or r.peak_rss_gb <= opts.max_memory_gb)
        rate = batch * ctx.get_world_size() / r.step_time_s if ok else 0.0
        results.append(dataclasses.replace(r, fits=ok, images_per_s=rate))
        return ok

    last_fit = largest_fitting(fits, opts.start, opts.max_batch)
    if ctx.get_world_rank() == 0:  # on the run's storage (local, NFS or s3://), where the driver reads it
        storage.write_text(opts.output_file, json.dumps({
            "results": [asdict(r) for r in results], "largest": last_fit, "world_size": ctx.get_world_size(),
            "device_name": device_name(device), "precision": net.precision}, indent=1))


@dataclass(frozen=True)
class ProbeResult:
    rows: list  # worker.probe_step.ProbeStep, by per-GPU batch
    largest: int | None
    recommended: int | None
    limit_gb: float
    memory_key: str
    device_name: str
    precision: str
    world_size: int
    path: str  # the JSON table: a local path or a URI under storage_path


def probe(config: SweepConfig, start: int = 8, max_batch: int = 65536, margin: float = 0.1,
          max_memory_gb: float | None = None, code: dict | None = None) -> ProbeResult:
    """Run the probe on the connected Ray cluster; returns the table and the recommendation. `code`: the user's
    model code for the workers (usercode.ship_for; None: shipped now)."""
    from raysweep import usercode
    from raysweep.trainer import make_trainer, worker_env
    from raysweep.worker.probe_step import ProbeStep

    trial = config.trials.trial(config.trials.default_knobs(), train_size=1)
    root = storage.join(storage.resolve(config.storage_path), config.name, layout.PROBE)
    name = f"probe-{datetime.now():%Y%m%d-%H%M%S}"
    out = storage.join(root, name, layout.PROBE_FILE)
    opts = ProbeOptions(start, max_batch, max_memory_gb, out)
    make_trainer(trial, None, root, name, env=worker_env(), worker_fn=probe_worker,
                 extra_config={"probe": asdict(opts)},
                 code=usercode.ship_for(config) if code is None else code).fit()
    data = json.loads(storage.read_text(out))
    rows = sorted((ProbeStep(**r) for r in data["results"]), key=lambda r: r.per_gpu_batch_size)
    gpu = config.scaling.use_gpu
    memory_key = "peak_mem_reserved_gb" if gpu else "peak_rss_gb"
    capacity = rows[0].device_memory_gb if gpu else (max_memory_gb or rows[0].device_memory_gb / data["world_size"])
    limit = capacity * (1 - margin)
    safe = [r.per_gpu_batch_size for r in rows if r.fits and getattr(r, memory_key) <= limit]
    return ProbeResult(rows, data["largest"], max(safe) if safe else None, limit, memory_key, data["device_name"],
                       data["precision"], data["world_size"], out)


def noise_scale_option(value: str | None, tracking_uri: str, experiment: str) -> tuple[float, str] | None:
    """--noise-scale: a number of samples, or `last` (the newest sweep's measurement in MLflow)."""
    from raysweep import tracking

    if value is None:
        return None
    if value == "last":
        return tracking.last_noise_scale(tracking_uri, experiment)
    try:
        number = float(value)
    except ValueError:
        number = -1.0
    if not number > 0:
        raise UserError(f"--noise-scale {value}: expected a positive number of samples (e.g. 500) or `last`")
    return number, "given on the command line"


def run(config: SweepConfig, *, address: str | None, start: int, max_batch: int, margin: float,
        max_memory_gb: float | None, verbose: bool, noise_scale: str | None = None) -> int:
    """The `probe` command. Exit 0 when some batch fits, 1 when none does."""
    import ray

    from raysweep import console, tracking
    from raysweep.cluster import connect, plan_concurrency
    from raysweep.config import spec_yaml
    from raysweep.models import check_spec_model
    from raysweep.report.plots import probe_plot

    if not 0 <= margin < 1:
        raise UserError(f"--margin {margin}: expected a fraction in [0, 1), e.g. 0.1")
    if start < 1 or max_batch < start:
        raise UserError(f"--start {start} --max-batch {max_batch}: expected 1 ≤ start ≤ max-batch")
    tracking_uri = tracking.resolve_tracking_uri(config.mlflow.tracking_uri)
    noise = noise_scale_option(noise_scale, tracking_uri, config.experiment_name)  # bad input fails before Ray
    model = check_spec_model(config)  # a model that cannot train, too
    started = connect(address, config.scaling.worker_start_timeout_s, verbose)
    try:
        console.print_plan(plan_concurrency(ray.cluster_resources(), config, 1), model)  # one trial's must fit
        result = probe(config, start, max_batch, margin, max_memory_gb)
        console.print_probe(result, margin)
        with tempfile.TemporaryDirectory() as folder:
            plot = Path(folder) / "probe.png"
            probe_plot(result, plot)
            run_id = tracking.in_store(lambda: tracking.log_probe(result, spec_yaml(config), config.experiment_name,
                                                                 tracking_uri, margin, plot),
                                       tracking_uri, config.mlflow.retry_s, "the probe's run")
        if noise is not None:
            from raysweep.noise import recommend

            per_step = result.world_size * config.trials.trial(config.trials.default_knobs(), 1).knobs.grad_accum_steps
            advice = recommend(noise[0], {r.per_gpu_batch_size * per_step: r.images_per_s for r in result.rows
                                          if r.fits}, noise[1])
            if advice is not None:
                from raysweep.answer import console as answer_console

                answer_console.print_recommendation(advice)
                tracking.in_store(lambda: tracking.log_recommendation(tracking_uri, run_id, advice), tracking_uri,
                                  config.mlflow.retry_s, "the probe's recommendation")
        return 0 if result.largest else 1
    finally:
        if started:
            ray.shutdown()
