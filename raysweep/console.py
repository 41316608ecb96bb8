"""Everything the driver prints: the plan, trial events, progress tables, epoch lines, summaries.

Rank code never prints; library code logs. This module only formats and prints.
"""

from __future__ import annotations

import math
import sys
import time
from datetime import datetime

from raysweep.config import SweepConfig
from raysweep.metrics import EAGER_FALLBACK, STARTUP_NAMES, STARTUP_PHASES, TrialView


def fmt(value, spec: str = ".4g") -> str:
    """A table cell: `-` for a missing value."""
    if value is None or value == "":
        return "-"
    if isinstance(value, float):
        return format(value, spec)
    return str(value)


def format_table(columns, rows) -> str:
    widths = [max(len(str(c)), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(columns)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def now() -> str:
    return datetime.now().strftime("%H:%M:%S")


def epoch_line(r: dict, epochs: int) -> str:
    """`train`'s line per epoch, from a reported result."""
    mem = (f"peak mem {r['peak_mem_allocated_gb']:.2f} GiB" if r.get("peak_mem_allocated_gb")
           else f"rss {r.get('rss_gb', 0):.2f} GiB")
    noise = f"  B_noise {fmt(r.get('grad_noise_scale'), ',.0f')}" if "grad_noise_scale" in r else ""
    compiled = f"  compiled in {r['compile_s']:.1f}s" if r.get("compile_s") else ""
    clock = f"  {r['train_seconds']:.1f} s trained" if r.get("train_seconds") else ""
    reached = f"  target in {r['time_to_target_s']:.1f} s" if r.get("time_to_target_s") is not None else ""
    return (f"epoch {int(r['epoch'])}/{epochs}  train_loss {r['train_loss']:.4f}  val_loss {r['val_loss']:.4f}  "
            f"val_exact_acc {r['val_exact_acc']:.3f}  val_char_acc {r['val_char_acc']:.3f}  lr {r['lr']:.2e}  "
            f"{r['samples_per_s']:,.0f} samples/s  {mem}{noise}{compiled}{clock}{reached}")


class ConsoleProgress:
    """Readable progress on the driver: events as they happen and a table every `every_s` seconds.

    In `train` mode (one trial) it prints one line per epoch instead of tables.
    """

    COLUMNS = ("trial", "status", "per_gpu", "global", "base_lr", "peak_lr", "warmup", "wd", "epoch",
               "val_loss", "val_exact", "samples/s", "mem_gib", "b_noise")

    def __init__(self, config: SweepConfig, train_size: int, every_s: float = 30.0, per_epoch: bool = False):
        self.config, self.train_size, self.every_s, self.per_epoch = config, train_size, every_s, per_epoch
        self.startups: dict[str, dict] = {}  # trial id → startup_s and its phases (metrics.STARTUP_NAMES)
        self.eager: set[str] = set()  # trials warned of an eager fallback
        self.last_table = time.monotonic()

    def row(self, view: TrialView) -> list[str]:
        t = self.config.trial(view.config, self.train_size)
        mem = view.value("peak_mem_allocated_gb") or view.value("rss_gb")
        return [view.trial_id, view.status, str(t.knobs.per_gpu_batch_size), str(t.global_batch_size),
                fmt(t.knobs.base_lr, ".2e"), fmt(t.peak_lr, ".2e"), fmt(t.knobs.warmup_epochs, "g"),
                fmt(t.knobs.weight_decay, ".1e"), fmt(view.last.get("epoch")), fmt(view.value("val_loss")),
                fmt(view.value("val_exact_acc"), ".3f"), fmt(view.value("samples_per_s"), ",.0f"), fmt(mem, ".2f"),
                fmt(view.value("grad_noise_scale"), ",.0f")]

    def table(self, views: list[TrialView]) -> str:
        return format_table(self.COLUMNS, [self.row(v) for v in views])

    # Tune callback hooks (the console callback forwards to these)
    def trial_start(self, view: TrialView) -> None:
        if not self.per_epoch:
            t = self.config.trial(view.config, self.train_size)
            baseline = " (baseline: the spec's defaults)" if self.config.is_baseline(view.config) else ""
            print(f"[{now()}] start  {view.trial_id}{baseline}: per-GPU batch {t.knobs.per_gpu_batch_size} × "
                  f"{t.world_size} workers × {t.knobs.grad_accum_steps} accum = global {t.global_batch_size}, "
                  f"peak LR {t.peak_lr:.2e}, warmup {t.knobs.warmup_epochs:g} ep, wd {t.knobs.weight_decay:.1e}",
                  flush=True)

    def trial_result(self, trial_id: str, result: dict) -> None:
        if result.get(EAGER_FALLBACK) and trial_id not in self.eager:
            self.eager.add(trial_id)
            print(f"[{now()}] warning {trial_id}: its compiled step ran eager (Dynamo hit a recompile limit): slower "
                  f"and another dropout stream than its compiled peers; MLflow tag raysweep.eager_fallback", flush=True)
        if "startup_s" in result and trial_id not in self.startups:
            self.startups[trial_id] = {k: float(result[k]) for k in STARTUP_NAMES if k in result}
            line = startup_line(self.startups[trial_id])
            print(line if self.per_epoch else f"[{now()}] up     {trial_id}: {line}", flush=True)
        if self.per_epoch:
            print(epoch_line(result, int(result.get("resolved_epochs", self.config.train.epochs))), flush=True)

    def trial_end(self, view: TrialView) -> None:
        metric = self.config.tune.metric
        seconds = f" ({view.value('train_seconds'):.0f} s)" if view.value("train_seconds") else ""
        reached = (f", {self.config.tune.target.metric} reached in {view.value('time_to_target_s'):.1f} s"
                   if view.value("time_to_target_s") is not None else "")
        print(f"[{now()}] {view.status:<8} {view.trial_id} at epoch {view.epoch}{seconds}: {metric} "
              f"{fmt(view.value(metric))}{reached}", flush=True)
        if view.error:
            print(f"         {view.trial_id}: {view.error}", flush=True)

    def step(self, views) -> None:
        if self.per_epoch or time.monotonic() - self.last_table < self.every_s:
            return
        self.last_table = time.monotonic()
        print(f"[{now()}] progress\n{self.table(list(views))}", flush=True)


class Progress:
    """A one-line progress bar on stderr (a line every 10 % when stderr is not a terminal)."""

    def __init__(self, label: str, total: int, enabled: bool = True):
        self.label, self.total, self.done = label, total, 0
        self.enabled = enabled and total > 0
        self.tty = sys.stderr.isatty()
        self.start = self.last = time.monotonic()
        self.last_decile = -1

    def advance(self, n: int) -> None:
        self.done += n
        if not self.enabled:
            return
        now = time.monotonic()
        decile = self.done * 10 // self.total
        if (self.tty and now - self.last > 0.2) or (not self.tty and decile > self.last_decile):
            self._print(now)
            self.last, self.last_decile = now, decile

    def _print(self, now: float) -> None:
        rate = self.done / max(now - self.start, 1e-9)
        eta = (self.total - self.done) / rate if rate > 0 else 0
        width = 30
        filled = width * self.done // self.total
        line = f"{self.label} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {rate:,.0f}/s eta {eta:.0f}s"
        print(("\r" + line) if self.tty else line, end="" if self.tty else "\n", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.enabled and self.tty:
            self._print(time.monotonic())
            print(file=sys.stderr, flush=True)


def progress_printer():
    """A `data.ProgressFn` that draws one `Progress` bar per label on stderr."""
    bars: dict[str, Progress] = {}

    def progress(label: str, done: int, total: int) -> None:
        bar = bars.get(label)
        if bar is None:  # the work starts (done == 0) or is already under way: its rate counts from here
            bar = bars[label] = Progress(label, total)
        if done > bar.done:
            bar.advance(done - bar.done)
        if done >= total:
            bar.close()
            del bars[label]

    return progress


def print_plan(plan) -> None:
    print(f"plan: {plan.message}", flush=True)


def print_waiting(line: str) -> None:
    print(f"plan: {line}", flush=True)


def print_data(data, config: SweepConfig) -> None:
    d = config.data
    print(f"data: {data.source}: {len(data.train)} train / {len(data.val)} val images {d.width}×{d.height}, "
          f"{d.length} characters of {d.num_classes}", flush=True)


def print_batch_cap(cap: int, probed=None) -> None:
    """`probed`: the probe's result when the cap was measured (`max: probe`)."""
    if probed is not None:
        print(f"probe: largest per-GPU batch that fits {probed.largest}, cap {cap} after the margin")
    print(f"batch cap: per-GPU batches above {cap} run as micro-batches ≤ {cap} with more accumulation "
          f"(same global batch and LR)")


def print_resumed(summary) -> None:
    """`summary`: sweep.ResumeSummary, e.g. `resumed: 3 done, 1 running from epoch 4, 2 pending`."""
    epochs = sorted({epoch for _, epoch in summary.running})
    running = f"{len(summary.running)} running" + (f" from epoch {', '.join(map(str, epochs))}" if epochs else "")
    print(f"resumed: {summary.done} done, {running}, {summary.pending} pending", flush=True)


def print_where(experiment_path, tracking_uri: str, experiment: str, experiment_id: str, ui: str, link: str,
                metric: str) -> None:
    """Where the sweep's results are, and how to review them."""
    print(f"results: {experiment_path}")
    print(f"mlflow:  {tracking_uri} (experiment {experiment!r}, id {experiment_id})")
    print(f"review:  {ui}\n         then open {link}")
    print(f"         (the trials, best {metric} first; to see the numbers: Columns → Metrics → {metric})")


def print_check(config: SweepConfig, rungs: tuple[list, dict] | None = None) -> None:
    """`check`: the resolved spec, the derived values at the defaults, and (`rungs`: rows and the epoch seconds
    they came from) ASHA's rungs in both units."""
    from raysweep.config import spec_yaml

    print(spec_yaml(config), end="")
    n = config.data.synthetic.train_size if config.data.train_dir is None else None
    trial = config.trial({}, n or 1)
    print("# derived at the defaults" + ("" if n else " (train size unknown until the folder is read: steps assume 1)"))
    for key in ("global_batch_size", "peak_lr", "steps_per_epoch", "warmup_steps", "total_steps"):
        print(f"#   {key}: {getattr(trial, key):.6g}")
    if rungs is not None:
        print_rungs(config, *rungs)


def print_rungs(config: SweepConfig, rows: list[list[str]], epoch_seconds: dict[int, float]) -> None:
    """ASHA's rungs in the spec's unit and the other for each of its global batches (`rows`: sweep.rung_table)."""
    seconds = config.time_attr == "train_seconds"
    other = "epochs" if seconds else "training seconds"
    batches = config.global_batches()
    print(f"# ASHA rungs in {config.tune.asha.unit} (then max_t), and in {other} at each global batch of the spec:")
    table = format_table(("#", config.tune.asha.unit, *(f"batch {b}" for b in batches)), rows)
    print("\n".join(f"#   {line}" for line in table.splitlines()))
    known = [b for b in batches if b in epoch_seconds]
    if known:
        print("#   (seconds an epoch as this experiment's trials measured them: "
              + ", ".join(f"batch {b} {epoch_seconds[b]:.2f} s" for b in known) + ")")
    if len(known) < len(batches):
        print("#   ?: no trial of this experiment has measured that batch's epoch seconds yet (run the sweep, or "
              "`train --set search.per_gpu_batch_size=N`)")


def make_console_callback(progress: ConsoleProgress):
    """A `ray.tune.Callback` that forwards Tune's events to `progress` (ray.tune imported here, lazily)."""
    from ray.tune import Callback

    horizon = progress.config.horizon

    class ConsoleCallback(Callback):
        def on_trial_start(self, iteration, trials, trial, **info):
            progress.trial_start(TrialView.of_trial(trial, horizon))

        def on_trial_result(self, iteration, trials, trial, result, **info):
            progress.trial_result(trial.trial_id, result)

        def on_trial_complete(self, iteration, trials, trial, **info):
            progress.trial_end(TrialView.of_trial(trial, horizon, ended="complete"))

        def on_trial_error(self, iteration, trials, trial, **info):
            progress.trial_end(TrialView.of_trial(trial, horizon, ended="error"))

        def on_step_end(self, iteration, trials, **info):
            if not progress.per_epoch:
                progress.step(TrialView.of_trial(t, horizon) for t in trials)

    return ConsoleCallback()


def startup_line(phases: dict) -> str:
    """A trial's start-up: trial start → first training step, and where it went (metrics.STARTUP_PHASES)."""
    parts = " · ".join(f"{name.removeprefix('startup_').removesuffix('_s')} {phases.get(name, 0):.1f}"
                       for name, _ in STARTUP_PHASES)
    return f"started in {phases['startup_s']:.1f}s ({parts})"


def print_busy(busy: float, wall_s: float, slots: int, startups: dict[str, dict]) -> None:
    """Every sweep's last figures: the share of its slot-seconds spent training, and its trials' start-up."""
    line = (f"busy {busy:.0%}: {slots} slot{'s' if slots > 1 else ''} × {wall_s:.0f}s of wall time, "
            f"{busy * wall_s * slots:.0f}s of it training and evaluating")
    warm = sorted(p["startup_s"] for p in startups.values() if not p.get("startup_group_s"))
    cold = sorted(p["startup_s"] for p in startups.values() if p.get("startup_group_s"))
    starts = [f"{len(group)} on {kind} groups, median {group[len(group) // 2]:.1f}s"
              for kind, group in (("new", cold), ("warm", warm)) if group]
    if starts:
        line += f"; trial start → first step: {'; '.join(starts)}"
    print(line)


def print_train_summary(config: SweepConfig, best: TrialView | None, train_size: int, wall_s: float,
                        startup: dict | None = None) -> None:
    """`train`'s closing line: the run's final figures."""
    if best is None:
        return
    m, trial = best.last, config.trial(best.config, train_size)
    line = (f"summary: {best.epoch} epochs in {wall_s:.0f}s; global batch {trial.global_batch_size}, "
            f"peak LR {trial.peak_lr:.2e}; final train_loss {m['train_loss']:.4f}, val_loss {m['val_loss']:.4f}, "
            f"val_exact_acc {m['val_exact_acc']:.3f}, val_char_acc {m['val_char_acc']:.3f}; "
            f"{m['samples_per_s']:,.0f} samples/s (last epoch)")
    if startup:
        line += f"; {startup_line(startup)}"
    print(line)


def print_sweep_summary(config: SweepConfig, views: list[TrialView], report, wall_s: float, top: int = 5) -> None:
    """`tune`'s closing lines: counts, epochs saved by ASHA, the top trials against the baseline, the
    recommendation and where the report is (`report`: report.SweepReport, built from the MLflow store)."""
    count = {s: sum(v.status == s for v in views) for s in ("finished", "pruned", "failed")}
    if config.time_attr == "epoch" and config.train.time_budget_s is None:
        run, budget, unit = sum(v.epoch for v in views), len(views) * config.max_t, "epochs"
    else:  # trials run different epochs: what they cost is their training seconds
        run, unit = sum(v.value("train_seconds") or 0 for v in views), "training seconds"
        budget = len(views) * min(config.max_t, config.train.time_budget_s or math.inf)
    saved = (f" of {budget:,.0f} {unit} run ({budget - run:,.0f} saved)" if math.isfinite(budget) and budget >= run
             else f" {unit} run")
    print(f"\nsweep: {len(views)} trials in {wall_s:.0f}s: {count['finished']} finished, {count['pruned']} pruned by "
          f"ASHA, {count['failed']} failed; {run:,.0f}{saved}")
    _print_report_body(report, top)


def print_report(report, top: int = 10) -> None:
    """`report`'s lines: the sweep, its top trials against the baseline, the recommendation, the files."""
    r = report.record
    counts = {s: sum(t.status == s for t in r.trials) for s in ("finished", "pruned", "failed", "interrupted", "running")}
    print(f"sweep: {r.parent_name} (experiment {r.experiment!r}): {len(r.trials)} trials, "
          + ", ".join(f"{n} {s}" for s, n in counts.items() if n))
    _print_report_body(report, top)


def _print_report_body(report, top: int) -> None:
    r = report.record
    metric = r.metric
    rows = []
    for row in report.rows[:top]:
        t = row.trial
        rows.append([t.trial_id + (" (baseline)" if t.baseline else ""), t.params.get("per_gpu_batch_size", "-"),
                     t.params.get("global_batch_size", "-"), fmt(t.number("base_lr"), ".2e"),
                     fmt(t.number("peak_lr"), ".2e"), t.params.get("warmup_epochs", "-"),
                     fmt(t.number("weight_decay"), ".1e"), str(t.epoch), fmt(row.value), _signed(row.delta),
                     fmt(t.wall_s, ".0f"), _signed(row.delta_wall_s, ".0f"), fmt(t.last("samples_per_s"), ",.0f"),
                     _signed(row.delta_samples_per_s, ",.0f"), fmt(t.last("grad_noise_scale"), ",.0f"),
                     fmt(t.last("train_seconds"), ".1f")]
                    + ([fmt(t.last("time_to_target_s"), ".1f")] if r.target else []))
    if rows:
        base = report.baseline
        order = (f"time to {r.target_label()} (training seconds), then {metric} ({r.mode})" if r.target
                 else f"{metric} ({r.mode})")
        print(f"top trials by {order}" + (f"; Δ against the baseline {base.trial_id} (the spec's defaults):"
                                          if base else ":"))
        print(format_table(("trial", "per_gpu", "global", "base_lr", "peak_lr", "warmup", "wd", "epoch", metric,
                            f"Δ{metric}", "wall_s", "Δwall_s", "samples/s", "Δsamples/s", "b_noise", "train_s")
                           + ((f"to {r.target_label()} s",) if r.target else ()), rows))
    else:
        print("no trial succeeded", file=sys.stderr)
    if report.recommendation is not None:
        print_recommendation(report.recommendation)
    if report.held:
        print_held(report.held, r.target_label())
    print(f"report:  {report.folder}/report.html (plots: {', '.join(f for f in report.files if f.endswith('.png'))}; "
          f"also on the MLflow parent run, under report/)")


def _signed(value, spec: str = ".4g") -> str:
    return "-" if value is None else format(value, "+" + spec)


def print_probe(result, margin: float) -> None:
    """The probe's table and recommendation (`result`: probe.ProbeResult)."""
    rows = [[str(r.per_gpu_batch_size), "yes" if r.fits else "OOM", f"{r.peak_mem_allocated_gb:.2f}",
             f"{r.peak_mem_reserved_gb:.2f}", f"{r.peak_rss_gb:.2f}", f"{r.step_time_s:.3f}",
             f"{r.images_per_s:,.0f}"] for r in result.rows]
    print(f"probe: {result.world_size} workers on {result.device_name}, {result.precision}, one full step per batch")
    print(format_table(("per_gpu_batch", "fits", "alloc_gib", "reserved_gib", "rss_gib", "step_s", "images/s"), rows))
    print(f"largest per-GPU batch that fits: {result.largest}")
    print(f"recommended: {result.recommended} ({result.memory_key} ≤ {result.limit_gb:.2f} GiB, a {margin:.0%} margin)")
    print(f"table: {result.path}")


def print_recommendation(rec) -> None:
    """The time-to-target table (`rec`: noise.Recommendation): relative samples, steps and time per global batch."""
    fastest = rec.fastest.global_batch
    rows = [[str(c.global_batch), f"{c.samples_per_s:,.0f}", f"{c.samples:.2f}", f"{c.steps:.2f}", f"{c.time:.2f}",
             "<- fastest" if c.global_batch == fastest else ""] for c in rec.candidates]
    print(f"\nbatch size worth using: gradient noise scale B_noise ≈ {rec.noise_scale:,.0f} samples ({rec.source})")
    print("predicted cost to reach the same loss (McCandlish et al. 2018): samples ∝ 1 + B/B_noise, "
          "steps ∝ 1 + B_noise/B, time ∝ samples ÷ samples/s")
    print(format_table(("global_batch", "samples/s", "samples×", "steps×", "time×", ""), rows))
    print(f"batch growth stops paying near B ≈ B_noise ≈ {rec.noise_scale:,.0f}: below it a doubled batch nearly halves "
          f"the steps; above it, steps fall little while samples grow. Fastest here: global batch {fastest}.")


def print_held(held, target: str) -> None:
    """The recommendation against the sweep (`held`: noise.Held per global batch): measured and predicted time to
    the target, and the error."""
    rows = [[str(h.global_batch), h.trial_id, f"{h.measured_s:.1f}", f"{h.predicted_s:.1f}", f"{h.error:+.0%}",
             f"{h.measured_samples:,.0f}", f"{h.predicted_samples:,.0f}"] for h in held]
    print(f"held against this sweep: each global batch's fastest trial to {target}, beside the prediction "
          f"(E_min fitted to all of them: the errors are the model's shape across batches)")
    print(format_table(("global_batch", "trial", "measured_s", "predicted_s", "error", "samples", "predicted"), rows))
