"""The sweep report, from the MLflow store alone: the summary table with the baseline delta, the plots,
each trial's curves, the time-to-target recommendation and one self-contained report.html.

`tune` builds it at the end of every sweep; `python -m raysweep report` rebuilds it for any sweep in a
store (one that ran on a cluster, an interrupted one) without starting Ray. Reads go through
tracking.load_sweep, writes through tracking.log_report; this module only computes and draws.
"""

from __future__ import annotations

import base64
import html
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

from raysweep import storage, tracking
from raysweep.errors import UserError
from raysweep.metrics import RunRecord, SweepRecord, rank
from raysweep.noise import Held, Recommendation, held_against, recommend

PLOTS = {  # file → what it shows (the HTML's captions)
    "metric_curves.png": "the ranking metric per epoch, one line per trial; × where ASHA pruned, ! where a trial failed",
    "metric_time.png": "the ranking metric against each trial's training seconds (start-up excluded): what the time "
                       "users pay buys; the target's line where the sweep has one, ● where a trial reached it",
    "lr_schedule.png": "the learning rate each trial ran, per epoch (warmup, then cosine)",
    "batch_lr.png": "global batch × peak LR, coloured by the final ranking metric; the best ringed",
    "throughput_memory.png": "training throughput and peak memory against the per-GPU batch",
    "noise_scale.png": "the gradient noise scale per epoch, and the predicted time to the same loss per global batch",
}


@dataclass(frozen=True)
class SummaryRow:
    trial: RunRecord
    value: float | None  # the ranking metric, last epoch
    delta: float | None  # against the baseline (None: no baseline, or this is it)
    delta_wall_s: float | None
    delta_samples_per_s: float | None

    def as_dict(self, metric: str) -> dict:
        t = self.trial
        return {"trial_id": t.trial_id, "run_id": t.run_id, "status": t.status, "baseline": t.baseline,
                "per_gpu_batch_size": t.number("per_gpu_batch_size"), "global_batch_size": t.number("global_batch_size"),
                "base_lr": t.number("base_lr"), "peak_lr": t.number("peak_lr"), "epoch": t.epoch, metric: self.value,
                f"delta_{metric}": self.delta, "wall_s": t.wall_s, "delta_wall_s": self.delta_wall_s,
                "samples_per_s": t.last("samples_per_s"), "delta_samples_per_s": self.delta_samples_per_s,
                "grad_noise_scale": t.last("grad_noise_scale"), "train_seconds": t.last("train_seconds"),
                "resolved_epochs": t.number("resolved_epochs"), "time_to_target_s": t.last("time_to_target_s"),
                "epochs_to_target": t.last("epochs_to_target"), "samples_to_target": t.last("samples_to_target")}


@dataclass(frozen=True)
class SweepReport:
    record: SweepRecord
    rows: list[SummaryRow]  # ranked, best first (failed trials and those without the metric left out)
    baseline: RunRecord | None
    recommendation: Recommendation | None
    held: list[Held]  # the recommendation against the sweep's measured times to the target, per global batch
    folder: str  # where the files are
    files: list[str]  # file names in `folder`: plots and report.html


def ranked(record: SweepRecord) -> list[RunRecord]:
    """Trials that did not fail, best first: by the metric, or with a target by time_to_target_s and then the rest
    by the metric (metrics.rank, as the sweep's own summary)."""
    return rank([t for t in record.trials if t.status != "failed"], RunRecord.last, record.metric, record.mode,
                record.target is not None)


def held(record: SweepRecord, advice: Recommendation | None) -> list[Held]:
    """The recommendation's B_noise held against the sweep: per global batch, its fastest trial to the target
    (noise.held_against); [] without a target, a B_noise, or two batches that reached it."""
    if advice is None or record.target is None:
        return []
    best: dict[int, tuple[str, float, float]] = {}
    for t in record.trials:
        batch, seconds, samples = t.number("global_batch_size"), t.last("time_to_target_s"), t.last("samples_to_target")
        if batch and seconds and samples and (int(batch) not in best or seconds < best[int(batch)][1]):
            best[int(batch)] = (t.trial_id, seconds, samples)
    return held_against(advice.noise_scale, best)


def summary_rows(record: SweepRecord) -> tuple[list[SummaryRow], RunRecord | None]:
    baseline = next((t for t in record.trials if t.baseline), None)

    def minus(a, b):
        return None if a is None or b is None else a - b

    rows = []
    for t in ranked(record):
        base = baseline if baseline is not None and t is not baseline else None
        rows.append(SummaryRow(
            t, t.last(record.metric),
            minus(t.last(record.metric), base.last(record.metric)) if base else None,
            minus(t.wall_s, base.wall_s) if base else None,
            minus(t.last("samples_per_s"), base.last("samples_per_s")) if base else None))
    return rows, baseline


def recommendation(record: SweepRecord) -> Recommendation | None:
    """B_noise from the best trial's last epoch (else the median of the trials' last values); throughput per
    global batch = the median last `samples_per_s` of its trials. None when no trial measured B_noise."""
    best = ranked(record)
    measured = [t for t in (best or record.trials) if t.last("grad_noise_scale")]
    if not measured:
        return None
    if best and measured[0] is best[0]:
        noise, source = best[0].last("grad_noise_scale"), f"best trial {best[0].trial_id}, epoch {best[0].epoch}"
    else:
        noise = statistics.median(t.last("grad_noise_scale") for t in measured)
        source = f"median of {len(measured)} trials' last epochs"
    rates: dict[int, list[float]] = {}
    for t in record.trials:
        batch, rate = t.number("global_batch_size"), t.last("samples_per_s")
        if batch and rate:
            rates.setdefault(int(batch), []).append(rate)
    return recommend(noise, {b: statistics.median(r) for b, r in rates.items()}, source)


def build(record: SweepRecord, folder: Path, ui_base: str = "http://127.0.0.1:5000") -> tuple[SweepReport, dict]:
    """Write the plots, the per-trial PNGs (under trials/) and report.html into `folder`.
    Returns the report and {child run id: its PNG} for tracking.log_report."""
    folder.mkdir(parents=True, exist_ok=True)
    rows, baseline = summary_rows(record)
    advice = recommendation(record)
    checked = held(record, advice)
    files = _parent_plots(record, rows, advice, folder)
    trial_pngs = {}
    for t in record.trials:
        if t.history:
            path = folder / "trials" / f"{t.trial_id}.png"
            _trial_plot(t, record.metric, path)
            trial_pngs[t.run_id] = path
    report = SweepReport(record, rows, baseline, advice, checked, str(folder), files)
    (folder / "report.html").write_text(_html(report, ui_base))
    return SweepReport(record, rows, baseline, advice, checked, str(folder), [*files, "report.html"]), trial_pngs


REPORT_MARKER = ".raysweep-report"  # in a local report folder: raysweep wrote the folder (claim_folder)


def publish(record: SweepRecord, location: str) -> SweepReport:
    """Build the report into `location` (a folder, or a URI under shared storage) and log it to MLflow: the
    files and summary.json on the parent run, each trial's PNG on its child run, the recommendation.

    The report is built in a folder of its own, so that MLflow gets the report's files and nothing else, then
    copied to `location`; a local folder must be new, empty or a report raysweep wrote (`claim_folder`)."""
    import dataclasses
    import shutil
    import tempfile

    local = not storage.is_uri(location)
    if local:
        claim_folder(Path(location))
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        report, trial_pngs = build(record, folder)
        tracking.log_report(record.tracking_uri, record, folder, trial_pngs,
                            [row.as_dict(record.metric) for row in report.rows])
        if report.recommendation is not None:
            tracking.log_recommendation(record.tracking_uri, record.parent_run_id, report.recommendation)
        if local:
            shutil.rmtree(Path(location) / "trials", ignore_errors=True)  # a rebuilt report holds this sweep's only
            storage.write_text(str(Path(location) / REPORT_MARKER), "written by `raysweep report`; rewritten by it\n")
        for path in folder.rglob("*.*"):
            storage.write_bytes(storage.join(location, str(path.relative_to(folder))), path.read_bytes())
    return dataclasses.replace(report, folder=location)


def claim_folder(folder: Path) -> None:
    """A local folder the report may write: new, empty, or a report raysweep wrote and nothing else
    (`foreign_files`). Any other folder is refused: the report never mixes with, or deletes, other files (a rebuild
    removes trials/ whole, and writes over its own names)."""
    if folder.exists() and not folder.is_dir():
        raise UserError(f"report folder {folder}: a file, not a folder; give a new folder, e.g. --out ./report")
    foreign = foreign_files(folder) if folder.is_dir() else []
    if foreign:
        shown = ", ".join(foreign[:3]) + (", …" if len(foreign) > 3 else "")
        raise UserError(f"report folder {folder}: it holds files raysweep did not write ({shown}); give a new "
                        f"or empty folder, e.g. --out {folder / 'raysweep_report'}, or move them out")


def foreign_files(folder: Path) -> list[str]:
    """What in a report folder raysweep did not write, as paths relative to it, sorted. A report raysweep wrote
    holds its marker (REPORT_MARKER) and beside it only what `publish` writes: report.html and the plots (PLOTS),
    one PNG per trial under trials/, and what a killed write leaves (`_written_name`). Any other entry is foreign,
    at any depth: a folder of another name is named itself (not entered: it may be a .git), and so is a link.
    Without the marker, the report's names alone are not known to be raysweep's (a report.html may be a
    person's): then they are all foreign."""
    def own(entry: Path, written) -> bool:
        return entry.is_file() and not entry.is_symlink() and written(_written_name(entry.name))

    entries = sorted(folder.iterdir())
    top = {REPORT_MARKER, "report.html", *PLOTS}
    foreign = []
    for entry in entries:
        if entry.name == "trials" and entry.is_dir() and not entry.is_symlink():
            foreign += [f"trials/{e.name}" for e in sorted(entry.iterdir()) if not own(e, lambda n: n.endswith(".png"))]
        elif not own(entry, top.__contains__):
            foreign.append(entry.name)
    if not foreign and entries and not (folder / REPORT_MARKER).is_file():
        return [entry.name for entry in entries]  # the report's names, but nothing says raysweep wrote them
    return foreign


def _written_name(name: str) -> str:
    """The file a name is raysweep's write of: itself, or <name> for `.<name>.<pid>.tmp`, what storage.write_bytes
    leaves when a report is killed mid-write."""
    match = re.fullmatch(r"\.(.+)\.\d+\.tmp", name)
    return match.group(1) if match else name


def run(spec: str | None, overrides: list[str], experiment: str | None, tracking_uri: str | None,
        out: str | None) -> int:
    """`python -m raysweep report`: the newest sweep of a spec's experiment (or of --experiment), from the
    store alone (no Ray). Exit 0, or 2 (UserError) for an unknown experiment or an empty store."""
    from raysweep import console

    if (spec is None) == (experiment is None):
        raise UserError("report: give a spec (e.g. search_spaces/quickstart.yaml) or --experiment NAME, not both")
    if spec is not None:
        from raysweep.config import load_config

        config = load_config(spec, overrides, sweep=False)
        experiment = config.experiment_name
        uri = tracking.resolve_tracking_uri(tracking_uri or config.mlflow.tracking_uri)
        default_out = storage.join(storage.resolve(config.storage_path), config.name, "report")
    else:
        uri = tracking.resolve_tracking_uri(tracking_uri)
        default_out = str(Path("raysweep_report", experiment).resolve())
    tracking.reconcile_orphans(uri)  # a sweep whose driver died is not shown as still running
    record = tracking.load_sweep(uri, experiment)
    report = publish(record, out or default_out)
    console.print_report(report)
    return 0


# ---------------------------------------------------------------------------------------------
# Plots


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _colors(trials: list[RunRecord]) -> dict[str, tuple]:
    plt = _pyplot()
    cmap = plt.get_cmap("tab10" if len(trials) <= 10 else "tab20")
    return {t.trial_id: cmap(i % cmap.N) for i, t in enumerate(trials)}


def _label(t: RunRecord) -> str:
    return f"{t.trial_id}{' (baseline)' if t.baseline else ''}"


def _legend_right(ax) -> None:
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)


def _parent_plots(record: SweepRecord, rows: list[SummaryRow], advice, folder: Path) -> list[str]:
    plt = _pyplot()
    metric, trials = record.metric, record.trials
    colors = _colors(trials)
    best = rows[0].trial if rows else None
    written = []

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(folder / name, dpi=110)
        plt.close(fig)
        written.append(name)

    # 1. the ranking metric per epoch
    fig, ax = plt.subplots(figsize=(9, 4.8))
    for t in trials:
        curve = t.history.get(metric, {})
        if not curve:
            continue
        xs = sorted(curve)
        ax.plot(xs, [curve[x] for x in xs], marker=".", color=colors[t.trial_id], label=_label(t),
                linewidth=2.5 if t is best else 1.2)
        end = (xs[-1], curve[xs[-1]])
        if t.status == "pruned":
            ax.scatter(*end, marker="x", s=70, color=colors[t.trial_id], zorder=3)
        elif t.status == "failed":
            ax.scatter(*end, marker="X", s=90, color="black", zorder=3)
            ax.annotate(t.tags.get("failure", "failed"), end, textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("epoch")
    ax.set_ylabel(metric)
    ax.set_title(f"{record.experiment}: {metric} per epoch (× pruned by ASHA, X failed; thick: best)")
    ax.grid(alpha=0.3)
    _legend_right(ax)
    save(fig, "metric_curves.png")

    # 1b. the same against training seconds: what the time users pay buys
    fig, ax = plt.subplots(figsize=(9, 4.8))
    for t in trials:
        curve, clock = t.history.get(metric, {}), t.history.get("train_seconds", {})
        xs = sorted(e for e in curve if e in clock)
        if not xs:
            continue
        ax.plot([clock[e] for e in xs], [curve[e] for e in xs], marker=".", color=colors[t.trial_id],
                label=f"{_label(t)} (batch {t.params.get('global_batch_size', '?')})", linewidth=2.5 if t is best else 1.2)
        if t.status == "pruned":
            ax.scatter(clock[xs[-1]], curve[xs[-1]], marker="x", s=70, color=colors[t.trial_id], zorder=3)
        if record.target is not None and t.last("time_to_target_s") is not None:
            ax.scatter(t.last("time_to_target_s"), record.target[1], marker="o", s=45, color=colors[t.trial_id], zorder=4)
    if record.target is not None:
        ax.axhline(record.target[1], color="grey", linestyle="--", label=f"target {record.target_label()}")
    ax.set_xlabel("training seconds (start-up excluded)")
    ax.set_ylabel(metric)
    ax.set_title(f"{metric} against training seconds (× pruned; ● reached the target; thick: best)")
    ax.grid(alpha=0.3)
    _legend_right(ax)
    save(fig, "metric_time.png")

    # 2. the LR each trial ran
    fig, ax = plt.subplots(figsize=(9, 4.8))
    for t in trials:
        curve = t.history.get("lr", {})
        if curve:
            xs = sorted(curve)
            ax.plot([0, *xs], [0.0, *(curve[x] for x in xs)], marker=".", color=colors[t.trial_id], label=_label(t))
    ax.set_xlabel("epoch (LR at the epoch's end; 0 = before the first step)")
    ax.set_ylabel("learning rate")
    ax.set_title("LR schedule run by each trial: linear warmup, then cosine to the floor")
    ax.grid(alpha=0.3)
    _legend_right(ax)
    save(fig, "lr_schedule.png")

    # 3. global batch × peak LR, coloured by the final metric
    points = [(t.number("global_batch_size"), t.number("peak_lr"), row.value, t) for row in rows for t in [row.trial]]
    fig, ax = plt.subplots(figsize=(7.5, 5))
    if points:
        sc = ax.scatter([p[0] for p in points], [p[1] for p in points], c=[p[2] for p in points], s=70,
                        cmap="viridis_r" if record.mode == "min" else "viridis", edgecolors="grey", zorder=2)
        fig.colorbar(sc, ax=ax, label=f"final {metric}")
        ax.scatter([points[0][0]], [points[0][1]], s=260, facecolors="none", edgecolors="red", linewidths=2,
                   label=f"best: {points[0][3].trial_id}", zorder=3)
        failed = [t for t in trials if t.status == "failed" and t.number("global_batch_size")]
        if failed:
            ax.scatter([t.number("global_batch_size") for t in failed], [t.number("peak_lr") for t in failed],
                       marker="X", color="black", s=60, label="failed")
        ax.legend(loc="best", fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("global batch (samples per optimizer step)")
    ax.set_ylabel("peak learning rate")
    ax.set_title("which batch and LR region wins")
    ax.grid(alpha=0.3, which="both")
    save(fig, "batch_lr.png")

    # 4. throughput and peak memory against the per-GPU batch
    gpu = any((t.last("peak_mem_allocated_gb") or 0) > 0 for t in trials)
    mem_key, mem_label = (("peak_mem_reserved_gb", "peak GPU memory reserved (GiB)") if gpu
                          else ("rss_gb", "worker resident memory (GiB, CPU)"))
    fig, (ax_rate, ax_mem) = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, key, label in ((ax_rate, "samples_per_s", "samples/s (global)"), (ax_mem, mem_key, mem_label)):
        xs = [t.number("micro_batch_size") or t.number("per_gpu_batch_size") for t in trials if t.last(key) is not None]
        ys = [t.last(key) for t in trials if t.last(key) is not None]
        ax.scatter(xs, ys, color=[colors[t.trial_id] for t in trials if t.last(key) is not None], s=50)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("per-GPU micro-batch (samples per forward/backward on one rank)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    ax_rate.set_title("throughput, last epoch of each trial")
    ax_mem.set_title("memory, last epoch of each trial")
    save(fig, "throughput_memory.png")

    # 5. the noise scale, and the recommendation
    if any(t.history.get("grad_noise_scale") for t in trials):
        fig, (ax_noise, ax_time) = plt.subplots(1, 2, figsize=(12, 4.5))
        for t in trials:
            curve = t.history.get("grad_noise_scale", {})
            if curve:
                xs = sorted(curve)
                ax_noise.plot(xs, [curve[x] for x in xs], marker=".", color=colors[t.trial_id], label=_label(t))
        ax_noise.set_yscale("log")
        ax_noise.set_xlabel("epoch")
        ax_noise.set_ylabel("B_noise (samples)")
        ax_noise.set_title("gradient noise scale per epoch (grows as training proceeds)")
        ax_noise.grid(alpha=0.3, which="both")
        _legend_right(ax_noise)
        if advice is not None:
            xs = [c.global_batch for c in advice.candidates]
            ax_time.plot(xs, [c.time for c in advice.candidates], marker="o", label="time× (from samples/s)")
            ax_time.plot(xs, [c.samples / min(c.samples for c in advice.candidates) for c in advice.candidates],
                         linestyle="--", label="samples× (vs the smallest)")
            ax_time.axvline(advice.noise_scale, color="grey", linestyle=":", label=f"B_noise ≈ {advice.noise_scale:,.0f}")
            ax_time.scatter([advice.fastest.global_batch], [1.0], s=200, facecolors="none", edgecolors="red",
                            linewidths=2, label=f"fastest: {advice.fastest.global_batch}")
            ax_time.set_xscale("log", base=2)
            ax_time.set_xlabel("global batch")
            ax_time.set_ylabel("relative to the fastest (1 = best)")
            ax_time.set_title(f"predicted cost to the same loss ({advice.source})", fontsize=9)
            ax_time.legend(fontsize=8, loc="best")
            ax_time.grid(alpha=0.3, which="both")
        else:
            ax_time.set_axis_off()
            ax_time.text(0.5, 0.5, "no recommendation: no throughput per batch", ha="center", va="center")
        save(fig, "noise_scale.png")
    return written


def _trial_plot(t: RunRecord, metric: str, path: Path) -> None:
    """One trial's curves: losses, accuracies, LR (and B_noise where measured)."""
    plt = _pyplot()
    path.parent.mkdir(parents=True, exist_ok=True)
    panels = [("loss", ("train_loss", "val_loss")), ("accuracy", ("val_exact_acc", "val_char_acc")),
              ("learning rate", ("lr",))]
    fig, axes = plt.subplots(1, len(panels), figsize=(13, 3.8))
    for ax, (ylabel, names) in zip(axes, panels):
        for name in names:
            curve = t.history.get(name, {})
            if curve:
                xs = sorted(curve)
                ax.plot(xs, [curve[x] for x in xs], marker=".", label=name)
        ax.set_xlabel("epoch")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    batch = t.params.get("global_batch_size", "?")
    fig.suptitle(f"trial {t.trial_id}{' (baseline)' if t.baseline else ''}: {t.status} at epoch {t.epoch}, "
                 f"global batch {batch}, peak LR {t.number('peak_lr') or 0:.2e}; final {metric} "
                 f"{t.last(metric) if t.last(metric) is not None else float('nan'):.4g}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# report.html: one file, images inlined


def _fmt(value, spec=".4g") -> str:
    return "–" if value is None else format(value, spec)


def _signed(value, spec=".4g") -> str:
    return "" if value is None else format(value, "+" + spec)


def _html(report: SweepReport, ui_base: str) -> str:
    r, metric = report.record, report.record.metric
    folder = Path(report.folder)
    run_url = f"{ui_base}/#/experiments/{r.experiment_id}/runs"
    rows = []
    for i, row in enumerate(report.rows, 1):
        t = row.trial
        rows.append(
            f"<tr{' class=baseline' if t.baseline else ''}><td>{i}</td>"
            f"<td><a href='{run_url}/{t.run_id}'>{html.escape(t.trial_id)}</a>{' (baseline)' if t.baseline else ''}</td>"
            f"<td>{t.status}</td><td>{t.params.get('per_gpu_batch_size', '')}</td><td>{t.params.get('global_batch_size', '')}</td>"
            f"<td>{_fmt(t.number('base_lr'), '.2e')}</td><td>{_fmt(t.number('peak_lr'), '.2e')}</td>"
            f"<td>{t.params.get('warmup_epochs', '')}</td><td>{_fmt(t.number('weight_decay'), '.1e')}</td><td>{t.epoch}</td>"
            f"<td>{_fmt(row.value)}</td><td>{_signed(row.delta)}</td><td>{_fmt(t.wall_s, '.0f')}</td>"
            f"<td>{_signed(row.delta_wall_s, '.0f')}</td><td>{_fmt(t.last('samples_per_s'), ',.0f')}</td>"
            f"<td>{_signed(row.delta_samples_per_s, ',.0f')}</td><td>{_fmt(t.last('grad_noise_scale'), ',.0f')}</td>"
            f"<td>{_fmt(t.last('train_seconds'), '.1f')}</td>"
            + (f"<td>{_fmt(t.last('time_to_target_s'), '.1f')}</td>" if r.target else "") + "</tr>")
    others = [t for t in r.trials if t not in [row.trial for row in report.rows]]
    for t in others:
        rows.append(f"<tr class=other><td></td><td><a href='{run_url}/{t.run_id}'>{html.escape(t.trial_id)}</a></td>"
                    f"<td>{t.status} {html.escape(t.tags.get('failure', ''))}</td>"
                    f"<td colspan={16 if r.target else 15}>{html.escape(t.tags.get('error', '')[:200])}</td></tr>")
    images = []
    for name in report.files:
        data = base64.b64encode((folder / name).read_bytes()).decode()
        images.append(f"<figure><img alt='{name}' src='data:image/png;base64,{data}'>"
                      f"<figcaption>{html.escape(PLOTS.get(name, name))}</figcaption></figure>")
    advice = ""
    if report.recommendation is not None:
        rec = report.recommendation
        cells = "".join(f"<tr{' class=best' if c is rec.fastest else ''}><td>{c.global_batch}</td><td>{c.samples_per_s:,.0f}</td>"
                        f"<td>{c.samples:.2f}</td><td>{c.steps:.2f}</td><td>{c.time:.2f}</td></tr>" for c in rec.candidates)
        advice = (f"<h2>Batch size worth using</h2><p>Gradient noise scale B<sub>noise</sub> ≈ {rec.noise_scale:,.0f} "
                  f"samples ({html.escape(rec.source)}). Predicted cost to reach the same loss: samples ∝ 1 + B/B<sub>noise</sub>, "
                  f"steps ∝ 1 + B<sub>noise</sub>/B, time ∝ samples ÷ samples/s. Fastest: global batch "
                  f"<b>{rec.fastest.global_batch}</b>; growth stops paying near B ≈ {rec.noise_scale:,.0f}.</p>"
                  f"<table><tr><th>global batch</th><th>samples/s</th><th>samples×</th><th>steps×</th><th>time×</th></tr>"
                  f"{cells}</table>")
    if report.held:
        cells = "".join(f"<tr><td>{h.global_batch}</td><td>{html.escape(h.trial_id)}</td><td>{h.measured_s:.1f}</td>"
                        f"<td>{h.predicted_s:.1f}</td><td>{h.error:+.0%}</td><td>{h.measured_samples:,.0f}</td>"
                        f"<td>{h.predicted_samples:,.0f}</td></tr>" for h in report.held)
        advice += (f"<h3 id='held'>The prediction held against this sweep</h3><p>Per global batch, the trial that reached "
                   f"{html.escape(r.target_label())} soonest, beside what B<sub>noise</sub> predicts (E<sub>min</sub> "
                   f"fitted to all these batches at once, so the errors show how well the model's shape across batches "
                   f"holds).</p><table id='held'><tr><th>global batch</th><th>trial</th><th>measured s</th>"
                   f"<th>predicted s</th><th>error</th><th>measured samples</th><th>predicted samples</th></tr>"
                   f"{cells}</table>")
    target_th = f"<th>time to {html.escape(r.target_label())} (s)</th>" if r.target else ""
    ranking = (f"ranked by the time to <b>{html.escape(r.target_label())}</b> (training seconds, interpolated between "
               f"the epochs that straddle it), then the trials that never got there by <b>{metric}</b> ({r.mode})"
               if r.target else f"ranked by <b>{metric}</b> ({r.mode})")
    base = report.baseline
    base_line = (f"Baseline (the spec's defaults): <a href='{run_url}/{base.run_id}'>{html.escape(base.trial_id)}</a>, "
                 f"{metric} {_fmt(base.last(metric))}." if base else "No baseline trial in this sweep.")
    counts = {s: sum(t.status == s for t in r.trials) for s in ("finished", "pruned", "failed", "interrupted", "running")}
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>raysweep report: {html.escape(r.experiment)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; color: #222; max-width: 1400px; }}
table {{ border-collapse: collapse; margin: 1em 0; font-size: 14px; }}
th, td {{ border: 1px solid #ccc; padding: 3px 8px; text-align: right; }}
th {{ background: #f0f0f0; }} tr.baseline {{ background: #fff6d5; }} tr.best {{ background: #e3f5e1; }}
tr.other {{ color: #888; }} figure {{ margin: 1.5em 0; }} img {{ max-width: 100%; border: 1px solid #eee; }}
figcaption {{ color: #555; font-size: 14px; }} pre {{ background: #f7f7f7; padding: 1em; overflow: auto; }}
</style></head><body>
<h1>Sweep {html.escape(r.parent_name)}</h1>
<p>Experiment <b>{html.escape(r.experiment)}</b> in <code>{html.escape(r.tracking_uri)}</code>:
{len(r.trials)} trials ({", ".join(f"{n} {s}" for s, n in counts.items() if n)}), {ranking}.
<a href="{run_url}/{r.parent_run_id}">parent run in the MLflow UI</a> (start <code>mlflow ui</code> on the store first).</p>
<p>{base_line} Δ columns are against it.</p>
<h2>Trials</h2>
<table id="summary"><tr><th>#</th><th>trial</th><th>status</th><th>per-GPU</th><th>global</th><th>base LR</th><th>peak LR</th>
<th>warmup</th><th>wd</th><th>epoch</th><th>{metric}</th><th>Δ {metric}</th><th>wall s</th><th>Δ wall s</th>
<th>samples/s</th><th>Δ samples/s</th><th>B<sub>noise</sub></th><th>train s</th>{target_th}</tr>
{"".join(rows)}</table>
{advice}
<h2>Plots</h2>
{"".join(images)}
<h2>Spec</h2>
<pre>{html.escape(r.spec_text)}</pre>
</body></html>
"""
