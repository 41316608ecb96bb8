"""Everything the driver prints: the plan, trial events, progress tables, epoch lines, summaries.

Rank code never prints; library code logs. This module only formats and prints. The sweep's summary table (its
columns, the missing-value rule) is report/table.py's, printed here as text.
"""

from __future__ import annotations

import math
import sys
import time
from datetime import datetime
from typing import TYPE_CHECKING

from raysweep.metrics import (
    EAGER_FALLBACK,
    FINISHED,
    STARTUP_NAMES,
    STARTUP_PHASES,
    TrialView,
    eager_reason,
    outcome_counts,
)
from raysweep.metrics import names as M
from raysweep.report.table import SAMPLES, counted, fmt, format_table, shown

if TYPE_CHECKING:
    from raysweep.config import DataConfig, SweepConfig, TrainConfig, TuneSection
    from raysweep.metrics import Horizon, RunRecord

# `train`'s figures of an epoch, in order, with their format (epoch_line; the first four close print_train_summary)
EPOCH_FIGURES = ((M.train_loss, ".4f"), (M.val_loss, ".4f"), (M.val_exact_acc, ".3f"), (M.val_char_acc, ".3f"),
                 (M.lr, ".2e"))
FINAL_FIGURES = EPOCH_FIGURES[:4]  # the losses and accuracies


def now() -> str:
    return datetime.now().strftime("%H:%M:%S")


def epoch_line(r: dict, epochs: int) -> str:
    """`train`'s line per epoch, from a reported result."""
    mem = (f"peak mem {r[M.peak_mem_allocated_gb]:.2f} GiB" if r.get(M.peak_mem_allocated_gb)
           else f"rss {r.get(M.rss_gb, 0):.2f} GiB")
    noise = f"  B_noise {fmt(r.get(M.grad_noise_scale), SAMPLES)}" if M.grad_noise_scale in r else ""
    compiled = f"  compiled in {r[M.compile_s]:.1f}s" if r.get(M.compile_s) else ""
    clock = f"  {r[M.train_seconds]:.1f} s trained" if r.get(M.train_seconds) else ""
    reached = f"  target in {r[M.time_to_target_s]:.1f} s" if r.get(M.time_to_target_s) is not None else ""
    figures = "  ".join(f"{name} {r[name]:{spec}}" for name, spec in EPOCH_FIGURES)
    return (f"epoch {int(r[M.epoch])}/{epochs}  {figures}  {r[M.samples_per_s]:,.0f} samples/s  "
            f"{mem}{noise}{compiled}{clock}{reached}")


SIT_OUT_SHOWN = 0.05  # a trial's start line says how much of the set an epoch leaves out from this share on


def sitting_out(t) -> str:
    """The end of a trial's start line where whole steps leave much of the set out of each epoch (config.TrialConfig:
    steps_per_epoch is floor(train_size / global batch)), e.g. `; 2 steps an epoch: 49,152 of 50,000 samples`."""
    if t.train_size - t.samples_per_epoch < SIT_OUT_SHOWN * t.train_size:
        return ""
    steps = f"{t.steps_per_epoch} step{'s' if t.steps_per_epoch > 1 else ''}"
    return (f"; {steps} an epoch: {t.samples_per_epoch:,} of {t.train_size:,} samples (whole steps; the rest sit out, "
            f"others each epoch)")


class ConsoleProgress:
    """Readable progress on the driver: events as they happen and a table every `every_s` seconds.

    In `train` mode (one trial) it prints one line per epoch instead of tables.
    """

    COLUMNS = ("trial", "status", "per_gpu", "global", "base_lr", "peak_lr", "warmup", "wd", "epoch",
               "val_loss", "val_exact", "samples/s", "mem_gib", "b_noise")

    def __init__(self, trials, tune: TuneSection, epochs: int, train_size: int, every_s: float = 30.0,
                 per_epoch: bool = False):
        """`trials`: a trial's config from its knobs, and which knobs are the baseline (config.TrialFactory:
        `.trial(knobs, train_size)`, `.is_baseline(knobs)`); `tune`: the spec's tune section (its metric and
        target); `epochs`: train.epochs (an epoch line's total before the trial reports its own)."""
        self.trials, self.train_size, self.epochs = trials, train_size, epochs
        self.metric = tune.metric
        self.target_metric = tune.target.metric if tune.target is not None else None
        self.every_s, self.per_epoch = every_s, per_epoch
        self.startups: dict[str, dict] = {}  # trial id → startup_s and its phases (metrics.STARTUP_NAMES)
        self.eager: set[str] = set()  # trials warned of an eager fallback
        self.last_table = time.monotonic()

    def row(self, view: TrialView) -> list[str]:
        t = self.trials.trial(view.config, self.train_size)
        mem = view.value(M.peak_mem_allocated_gb) or view.value(M.rss_gb)
        return [view.trial_id, view.status, str(t.knobs.per_gpu_batch_size), str(t.global_batch_size),
                fmt(t.knobs.base_lr, ".2e"), fmt(t.peak_lr, ".2e"), fmt(t.knobs.warmup_epochs, "g"),
                fmt(t.knobs.weight_decay, ".1e"), fmt(view.last.get(M.epoch)), fmt(view.value(M.val_loss)),
                fmt(view.value(M.val_exact_acc), ".3f"), fmt(view.value(M.samples_per_s), ",.0f"), fmt(mem, ".2f"),
                fmt(view.value(M.grad_noise_scale), SAMPLES)]

    def table(self, views: list[TrialView]) -> str:
        return format_table(self.COLUMNS, [self.row(v) for v in views])

    # Tune callback hooks (the console callback forwards to these)
    def trial_start(self, view: TrialView) -> None:
        if not self.per_epoch:
            t = self.trials.trial(view.config, self.train_size)
            baseline = " (baseline: the spec's defaults)" if self.trials.is_baseline(view.config) else ""
            print(f"[{now()}] start  {view.trial_id}{baseline}: per-GPU batch {t.knobs.per_gpu_batch_size} × "
                  f"{t.world_size} workers × {t.knobs.grad_accum_steps} accum = global {t.global_batch_size}, "
                  f"peak LR {t.peak_lr:.2e}, warmup {t.knobs.warmup_epochs:g} ep, wd {t.knobs.weight_decay:.1e}"
                  f"{sitting_out(t)}", flush=True)

    def trial_result(self, trial_id: str, result: dict) -> None:
        if result.get(EAGER_FALLBACK) and trial_id not in self.eager:
            self.eager.add(trial_id)
            why = eager_reason(result[EAGER_FALLBACK])
            print(f"[{now()}] warning {trial_id}: its compiled step ran eager ({why}): slower and another dropout "
                  f"stream than its compiled peers; MLflow tag raysweep.eager_fallback", flush=True)
        if M.startup_s in result and trial_id not in self.startups:
            self.startups[trial_id] = {k: float(result[k]) for k in STARTUP_NAMES if k in result}
            line = startup_line(self.startups[trial_id]) + placed_on(result.get(M.nodes))
            print(line if self.per_epoch else f"[{now()}] up     {trial_id}: {line}", flush=True)
        if self.per_epoch:
            print(epoch_line(result, int(result.get(M.resolved_epochs, self.epochs))), flush=True)

    def trial_end(self, view: TrialView) -> None:
        seconds = f" ({view.value(M.train_seconds):.0f} s)" if view.value(M.train_seconds) else ""
        reached = (f", {self.target_metric} reached in {view.value(M.time_to_target_s):.1f} s"
                   if view.value(M.time_to_target_s) is not None else "")
        print(f"[{now()}] {view.status:<8} {view.trial_id} at epoch {view.epoch}{seconds}: {self.metric} "
              f"{fmt(view.value(self.metric))}{reached}", flush=True)
        if view.error:
            print(f"         {view.trial_id}: {view.error}", flush=True)
        t = self.trials.trial(view.config, self.train_size)
        if (view.status == FINISHED and 0 < view.epoch * t.steps_per_epoch <= t.warmup_steps
                and view.value(M.time_to_target_s) is None):
            # only a time budget ends a trial this early (config.SweepConfig.trial_problem refuses the rest)
            warmup = f"{t.knobs.warmup_epochs:g} epoch{'' if t.knobs.warmup_epochs == 1 else 's'}"
            print(f"[{now()}] warning {view.trial_id}: it ended at epoch {view.epoch}, inside its warmup of {warmup} "
                  f"(train.time_budget_s fit no more): its LR never reached peak_lr {t.peak_lr:.2e}; lower "
                  f"warmup_epochs or raise train.time_budget_s", flush=True)

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
        line = (f"{self.label} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {rate:,.0f}/s "
                f"eta {eta:.0f}s")
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


def print_plan(plan, model=None) -> None:
    """The plan (cluster.Plan) and the model it trains (models.ModelFacts: its factory and parameter count)."""
    print(f"plan: {plan.message}" + (f"; model {model.line()}" if model is not None else ""), flush=True)


def print_search(line: str) -> None:
    print(f"search: {line}", flush=True)


def print_waiting(line: str) -> None:
    print(f"plan: {line}", flush=True)


def print_cluster(line: str) -> None:
    print(f"cluster: {line}", flush=True)


def print_data(data, spec: DataConfig) -> None:
    """The data a sweep runs on (`data`: data.CaptchaData; `spec`: the spec's data section, for the image shape),
    then each conversion or finding of reading it, once (CaptchaData.notes; the sweep logs them too)."""
    cached = [f.key for f in (data.facts.train, data.facts.val) if f is not None and f.from_cache] \
        if data.facts is not None else []
    reused = f" (decoded images of {' and '.join(cached)} from the cache)" if cached else ""
    print(f"data: {data.source}: {len(data.train):,} train / {len(data.val):,} val images {spec.width}×{spec.height}, "
          f"{spec.length} characters of {spec.num_classes}{reused}", flush=True)
    for note in data.notes:
        print(f"data: {note}", flush=True)


def print_data_description(d) -> None:
    """`check`'s account of the data (`d`: data.describe.DataDescription): counts, what each folder held, the
    characters found against data.charset and their spread per position, leakage; every line a comment."""
    print(f"# data: {d.source}: {d.train_size:,} train / {d.val_size:,} val images")
    facts = d.facts
    for f in (facts.train, facts.val) if facts is not None else ():
        if f is None:
            continue
        formats = ", ".join(f"{n:,} {k}" for k, n in f.formats.items())
        sizes = ", ".join(f"{n:,} at {k}" for k, n in f.sizes.items())
        modes = ", ".join(f"{n:,} {k}" for k, n in f.modes.items())
        print(f"#   {f.key}: {f.images:,} images ({formats}); sizes {sizes}; {f.resized:,} resized; modes {modes}"
              + (f"; {f.duplicates:,} repeat another image's pixels" if f.duplicates else ""))
    for note in d.notes:
        print(f"#   note: {note}")
    if facts is not None and facts.train is not None:
        print(f"#   leakage: {facts.val_in_train:,} validation images have the pixels of a training image")
    used = d.charset_size - len(d.absent)
    absent = f"; never in a training label: {d.absent!r} (data.charset could leave them out)" if d.absent else ""
    print(f"#   characters: {used} of data.charset's {d.charset_size} appear in the training labels{absent}")
    if d.val_unseen:
        print(f"#   validation labels hold characters no training label does: {d.val_unseen!r}")
    uniform = 1 / d.charset_size
    print(f"#   spread per position (share of the least and the most common character; uniform {uniform:.1%}):")
    for p in d.spread:
        print(f"#     position {p.position}: {p.present} characters, least {p.least[0]!r} {p.least[1]:.1%}, "
              f"most {p.most[0]!r} {p.most[1]:.1%}")


def print_batch_cap(cap: int, probed=None) -> None:
    """`probed`: the probe's result when the cap was measured (`max: probe`)."""
    if probed is not None:
        print(f"probe: largest per-GPU batch that fits {probed.largest}, cap {cap} after the margin")
    print(f"batch cap: per-GPU batches above {cap} run as micro-batches ≤ {cap} with more accumulation "
          f"(same global batch and LR)")


def print_resumed(summary) -> None:
    """`summary`: resume.ResumeSummary, e.g. `resumed: 3 done, 1 running from epoch 4, 2 pending`."""
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


def print_check(config: SweepConfig, train_size: int, rungs: tuple[list, dict] | None = None,
                data=None, model=None) -> None:
    """`check`: the resolved spec, the derived values at the defaults (`train_size`: the training images), the model
    (`model`: models.ModelFacts, what its check found), the data (`data`: data.describe.DataDescription; None: the
    synthetic set, not rendered yet) and (`rungs`: rows and the epoch seconds they came from) ASHA's rungs in both
    units."""
    from raysweep.config import spec_yaml

    print(spec_yaml(config), end="")
    trial = config.trials.trial({}, train_size)
    print(f"# derived at the defaults ({train_size:,} training images)")
    for key in (M.global_batch_size, M.peak_lr, M.steps_per_epoch, M.samples_per_epoch, M.warmup_steps,
                M.total_steps):
        print(f"#   {key}: {getattr(trial, key):.6g}")
    if model is not None:
        print(f"# model: {model.line()}; logits {model.output} for a batch of 2 (checked on the CPU: built, one "
              f"forward and backward)")
    if data is not None:
        print_data_description(data)
    else:
        s = config.data.synthetic
        print(f"# data: synthetic (seed {s.seed}): {s.train_size:,} train / {s.val_size:,} val images, rendered by the "
              f"first tune or train (then cached); `check` describes it once it is")
    if rungs is not None:
        print_rungs(config.tune.asha.unit, config.trials.global_batches(), *rungs)


def print_rungs(unit: str, batches: list[int], rows: list[list[str]], epoch_seconds: dict[int, float]) -> None:
    """ASHA's rungs in the spec's unit (tune.asha.unit) and the other for each of its global batches (`batches`:
    config.TrialFactory.global_batches; `rows`: asha.rung_table)."""
    other = "epochs" if unit == "seconds" else "training seconds"
    print(f"# ASHA rungs in {unit} (then max_t), and in {other} at each global batch of the spec:")
    table = format_table(("#", unit, *(f"batch {b}" for b in batches)), rows)
    print("\n".join(f"#   {line}" for line in table.splitlines()))
    known = [b for b in batches if b in epoch_seconds]
    if known:
        print("#   (seconds an epoch as this experiment's trials measured them: "
              + ", ".join(f"batch {b} {epoch_seconds[b]:.2f} s" for b in known) + ")")
    if len(known) < len(batches):
        print("#   ?: no trial of this experiment has measured that batch's epoch seconds yet (run the sweep, or "
              "`train --set search.per_gpu_batch_size=N`)")


def startup_line(phases: dict) -> str:
    """A trial's start-up: trial start → first training step, and where it went (metrics.STARTUP_PHASES)."""
    parts = " · ".join(f"{name.removeprefix('startup_').removesuffix('_s')} {phases.get(name, 0):.1f}"
                       for name, _ in STARTUP_PHASES)
    return f"started in {phases[M.startup_s]:.1f}s ({parts})"


def placed_on(node_ids: str | None) -> str:
    """The end of a trial's "up" line, e.g. " on 10.0.0.11×3": the machines its ranks run on, by IP in rank order
    (WorkerParams.nodes holds Ray node ids); a node Ray no longer lists keeps its id. Empty where Ray is not up."""
    import ray

    if not node_ids or not ray.is_initialized():
        return ""
    ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    machines = [ips.get(node, node[:8]) for node in node_ids.split(",")]
    counts = {ip: machines.count(ip) for ip in machines}
    return " on " + ", ".join(f"{ip}×{n}" if n > 1 else ip for ip, n in counts.items())


def print_busy(busy: float, wall_s: float, slots: int, startups: dict[str, dict]) -> None:
    """Every sweep's last figures: the share of its slot-seconds spent training, and its trials' start-up."""
    line = (f"busy {busy:.0%}: {slots} slot{'s' if slots > 1 else ''} × {wall_s:.0f}s of wall time, "
            f"{busy * wall_s * slots:.0f}s of it training and evaluating")
    warm = sorted(p[M.startup_s] for p in startups.values() if not p.get(M.startup_group_s))
    cold = sorted(p[M.startup_s] for p in startups.values() if p.get(M.startup_group_s))
    starts = [f"{len(group)} on {kind} groups, median {group[len(group) // 2]:.1f}s"
              for kind, group in (("new", cold), ("warm", warm)) if group]
    if starts:
        line += f"; trial start → first step: {'; '.join(starts)}"
    print(line)


def print_train_summary(record: RunRecord | None, wall_s: float, startup: dict | None = None) -> None:
    """`train`'s closing line: the run's final figures (`record`: its trial as the store holds it, None: no trial
    to show; `startup`: its start-up phases, ConsoleProgress.startups)."""
    if record is None:
        return
    finals = ", ".join(f"{name} {fmt(record.last(name), spec)}" for name, spec in FINAL_FIGURES)
    batch, peak_lr = fmt(record.params.get(M.global_batch_size)), fmt(record.number(M.peak_lr), ".2e")
    line = (f"summary: {record.epoch} epochs in {wall_s:.0f}s; global batch {batch}, peak LR {peak_lr}; "
            f"final {finals}; {fmt(record.last(M.samples_per_s), ',.0f')} samples/s (last epoch)")
    if startup:
        line += f"; {startup_line(startup)}"
    print(line)


def print_sweep_summary(report, wall_s: float, horizon: Horizon, train: TrainConfig, top: int = 5) -> None:
    """`tune`'s closing lines, all from the store (`report`: report.SweepReport): counts, the epochs (or training
    seconds) ASHA saved against every trial running to `horizon`'s max_t (or `train`.time_budget_s), the top trials
    against the baseline, the recommendation and where the report is."""
    trials, time_budget_s = report.record.trials, train.time_budget_s
    count = outcome_counts(trials)
    if horizon.time_attr == M.epoch and time_budget_s is None:
        run, budget, unit = sum(t.epoch for t in trials), len(trials) * horizon.max_t, "epochs"
    else:  # trials run different epochs: what they cost is their training seconds
        run, unit = sum(t.last(M.train_seconds) or 0 for t in trials), "training seconds"
        budget = len(trials) * min(horizon.max_t, time_budget_s or math.inf)
    saved = (f" of {budget:,.0f} {unit} run ({budget - run:,.0f} saved)" if math.isfinite(budget) and budget >= run
             else f" {unit} run")
    print(f"\nsweep: {len(trials)} trials in {wall_s:.0f}s: {count['finished']} finished, {count['pruned']} pruned by "
          f"ASHA, {count['failed']} failed; {run:,.0f}{saved}")
    _print_report_body(report, top)


def print_report(report, top: int = 10) -> None:
    """`report`'s lines: the sweep, its top trials against the baseline, the recommendation, the files."""
    r = report.record
    print(f"sweep: {r.parent_name} (experiment {r.experiment!r}): {len(r.trials)} trials, {counted(r.trials)}")
    _print_report_body(report, top)


def _print_report_body(report, top: int) -> None:
    """The top trials (report/table.py's columns), the recommendation and how it held, the report's files."""
    from raysweep.answer import console as answer_console

    r = report.record
    columns = shown(r)
    rows = [[c.text(row) for c in columns] for row in report.rows[:top]]
    if rows:
        base = report.baseline
        order = (f"time to {r.target_label()} (training seconds), then {r.metric} ({r.mode})" if r.target
                 else f"{r.metric} ({r.mode})")
        print(f"top trials by {order}" + (f"; Δ against the baseline {base.trial_id} (the spec's defaults):"
                                          if base else ":"))
        print(format_table([c.header for c in columns], rows))
    else:
        print("no trial succeeded", file=sys.stderr)
    if report.importance is not None:
        imp = report.importance
        shares = ", ".join(f"{name} {share:.0%}" for name, share in imp.importance.items())
        print(f"\nknob importance for {imp.metric} at {imp.at} (fANOVA over {len(imp.points)} finished and pruned "
              f"trials): {shares}")
    if report.recommendation is not None:
        answer_console.print_recommendation(report.recommendation)
    if report.held:
        answer_console.print_held(report.held, r.target_label())
    print(f"report:  {report.folder}/report.html (plots: {', '.join(f for f in report.files if f.endswith('.png'))}; "
          f"also on the MLflow parent run, under report/)")


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
