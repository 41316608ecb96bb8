"""Every PNG raysweep draws: the sweep's plots (PLOTS), each trial's curves, and the probe's table.

matplotlib is imported inside the functions (Agg, no display), so importing this module stays instant. Curves
of a metric per trial, against epochs or training seconds, all go through `_curves`.

A trial's PNG carries what it was drawn from (`trial_key`, a PNG text entry), so that a report rebuilt over an earlier
one keeps each PNG whose trial did not change (`drawn_key`) instead of drawing it again: a trial's plot costs 0.5 s
on two cores, and `confirm` rebuilds the whole report after a sweep of any size.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
from pathlib import Path

from raysweep.metrics import FAILED, PRUNED, RunRecord, SweepRecord
from raysweep.metrics import names as M
from raysweep.noise import in_samples

PLOTS = {  # file → what it shows (the HTML's captions)
    "metric_curves.png": "the ranking metric per epoch, one line per trial; × where ASHA pruned, ! where a trial "
                         "failed",
    "metric_time.png": "the ranking metric against each trial's training seconds (start-up excluded): what the time "
                       "users pay buys; the target's line where the sweep has one, ● where a trial reached it",
    "lr_schedule.png": "the learning rate each trial ran, per epoch (warmup, then cosine)",
    "batch_lr.png": "global batch × peak LR, coloured by the final ranking metric; the best ringed",
    "throughput_memory.png": "training throughput and peak memory against the per-GPU batch",
    "noise_scale.png": "the gradient noise scale per epoch, and the predicted time to the same loss per global batch",
    "parallel_coordinates.png": "each finished and pruned trial's knobs (one axis each, its fANOVA importance under "
                                "its name) and its ranking metric at the budget they all reached, coloured by that "
                                "metric (brighter is better); the baseline dashed",
}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _colors(trials: list[RunRecord]) -> dict[str, tuple]:
    cmap = _pyplot().get_cmap("tab10" if len(trials) <= 10 else "tab20")
    return {t.trial_id: cmap(i % cmap.N) for i, t in enumerate(trials)}


def _curves(ax, trials: list[RunRecord], name: str, colors: dict, label, *, clock: str | None = None,
            best: RunRecord | None = None, start: tuple[float, float] | None = None) -> list[tuple]:
    """One line per trial: metric `name` per epoch, or against the metric `clock` (e.g. train_seconds) at the epochs
    that have both. `start`: a point before the first epoch (the LR before the first step); `best`: its line thick,
    the others thin; `label(trial)`: the legend's. Returns (trial, last x, last y) of each trial drawn."""
    ends = []
    for t in trials:
        curve = t.history.get(name, {})
        times = t.history.get(clock, {}) if clock else None
        epochs = sorted(e for e in curve if times is None or e in times)
        if not epochs:
            continue
        xs = [times[e] for e in epochs] if times is not None else epochs
        ys = [curve[e] for e in epochs]
        if start is not None:
            xs, ys = [start[0], *xs], [start[1], *ys]
        width = {} if best is None else {"linewidth": 2.5 if t is best else 1.2}
        ax.plot(xs, ys, marker=".", color=colors[t.trial_id], label=label(t), **width)
        ends.append((t, xs[-1], ys[-1]))
    return ends


def _mark_ends(ax, ends: list[tuple], colors: dict, failed: bool = True) -> None:
    """× where ASHA pruned a trial; with `failed`, X and the failure's kind where one failed."""
    for t, x, y in ends:
        if t.status == PRUNED:
            ax.scatter(x, y, marker="x", s=70, color=colors[t.trial_id], zorder=3)
        elif failed and t.status == FAILED:
            ax.scatter(x, y, marker="X", s=90, color="black", zorder=3)
            ax.annotate(t.failure or "failed", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)


LEGEND_ROWS = 20  # a legend beside a plot holds this many trials (the figure's height); the rest are counted


def _axes(ax, xlabel: str, ylabel: str, title: str, legend: bool = True, **title_kw) -> None:
    """Labels, title, a light grid, and the legend outside on the right: the first LEGEND_ROWS - 1 trials and how
    many more (a legend taller than the figure is cut, and tight_layout gives up on the whole figure)."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, **title_kw)
    ax.grid(alpha=0.3, which="both")
    handles, labels = ax.get_legend_handles_labels()
    if legend and handles:
        if len(handles) > LEGEND_ROWS:
            more = len(handles) - (LEGEND_ROWS - 1)
            handles = [*handles[:LEGEND_ROWS - 1], _pyplot().Line2D([], [], linestyle="none")]
            labels = [*labels[:LEGEND_ROWS - 1], f"… {more} more (report.html's table)"]
        ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)


def sweep_plots(record: SweepRecord, ranked: list[RunRecord], advice, importance, labels: dict[str, str],
                folder: Path) -> list[str]:
    """The sweep's plots (PLOTS) into `folder`; returns the file names written (noise_scale.png only where a trial
    measured B_noise, parallel_coordinates.png only with an importance). `ranked`: the trials that rank, best first
    (report.table.ranked); `advice`: noise.Recommendation or None; `importance`: report.importance.Importance or
    None; `labels`: {trial id: its settings} for the legends (report.importance.trial_labels)."""
    plt = _pyplot()
    colors = _colors(record.trials)
    label = lambda t: labels[t.trial_id]  # noqa: E731
    best = ranked[0] if ranked else None
    figures = {
        "metric_curves.png": _metric_curves(plt, record, best, colors, label),
        "metric_time.png": _metric_time(plt, record, best, colors, label),
        "lr_schedule.png": _lr_schedule(plt, record, colors, label),
        "batch_lr.png": _batch_lr(plt, record, ranked, label),
        "throughput_memory.png": _throughput_memory(plt, record, colors),
        "noise_scale.png": _noise_scale(plt, record, advice, colors, label),
        "parallel_coordinates.png": _parallel_coordinates(plt, importance, label),
    }
    written = []
    for name, fig in figures.items():
        if fig is not None:
            fig.tight_layout()
            fig.savefig(folder / name, dpi=110)
            plt.close(fig)
            written.append(name)
    return written


def _metric_curves(plt, record: SweepRecord, best, colors, label):
    fig, ax = plt.subplots(figsize=(9, 4.8))
    _mark_ends(ax, _curves(ax, record.trials, record.metric, colors, label, best=best), colors)
    _axes(ax, "epoch", record.metric,
          f"{record.experiment}: {record.metric} per epoch (× pruned by ASHA, X failed; thick: best)")
    return fig


def _metric_time(plt, record: SweepRecord, best, colors, label):
    """The ranking metric against training seconds: what the time users pay buys."""
    fig, ax = plt.subplots(figsize=(9, 4.8))
    ends = _curves(ax, record.trials, record.metric, colors,
                   lambda t: f"{label(t)} (global {t.params.get(M.global_batch_size, '?')})", clock=M.train_seconds,
                   best=best)
    _mark_ends(ax, ends, colors, failed=False)
    if record.target is not None:
        for t, _, _ in ends:
            if t.last(M.time_to_target_s) is not None:
                ax.scatter(t.last(M.time_to_target_s), record.target[1], marker="o", s=45, color=colors[t.trial_id],
                           zorder=4)
        ax.axhline(record.target[1], color="grey", linestyle="--", label=f"target {record.target_label()}")
    _axes(ax, "training seconds (start-up excluded)", record.metric,
          f"{record.metric} against training seconds (× pruned; ● reached the target; thick: best)")
    return fig


def _lr_schedule(plt, record: SweepRecord, colors, label):
    fig, ax = plt.subplots(figsize=(9, 4.8))
    _curves(ax, record.trials, M.lr, colors, label, start=(0, 0.0))
    _axes(ax, "epoch (LR at the epoch's end; 0 = before the first step)", "learning rate",
          "LR schedule run by each trial: linear warmup, then cosine to the floor")
    return fig


def _batch_lr(plt, record: SweepRecord, ranked: list[RunRecord], label):
    """Global batch × peak LR of the ranked trials, coloured by the final metric; the best ringed, failures X."""
    fig, ax = plt.subplots(figsize=(7.5, 5))
    if ranked:
        best = ranked[0]
        sc = ax.scatter([t.number(M.global_batch_size) for t in ranked], [t.number(M.peak_lr) for t in ranked],
                        c=[t.last(record.metric) for t in ranked], s=70,
                        cmap="viridis_r" if record.mode == "min" else "viridis", edgecolors="grey", zorder=2)
        fig.colorbar(sc, ax=ax, label=f"final {record.metric}")
        ax.scatter([best.number(M.global_batch_size)], [best.number(M.peak_lr)], s=260, facecolors="none",
                   edgecolors="red", linewidths=2, label=f"best: {label(best)}", zorder=3)
        failed = [t for t in record.trials if t.status == FAILED and t.number(M.global_batch_size)]
        if failed:
            ax.scatter([t.number(M.global_batch_size) for t in failed], [t.number(M.peak_lr) for t in failed],
                       marker="X", color="black", s=60, label="failed")
        ax.legend(loc="best", fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    _axes(ax, "global batch (samples per optimizer step)", "peak learning rate", "which batch and LR region wins",
          legend=False)
    return fig


def _throughput_memory(plt, record: SweepRecord, colors):
    """Throughput and peak memory (GPU reserved, else the worker's RSS on CPU) against the per-GPU micro-batch."""
    trials = record.trials
    gpu = any((t.last(M.peak_mem_allocated_gb) or 0) > 0 for t in trials)
    mem_key, mem_label = ((M.peak_mem_reserved_gb, "peak GPU memory reserved (GiB)") if gpu
                          else (M.rss_gb, "worker resident memory (GiB, CPU)"))
    fig, (ax_rate, ax_mem) = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, key, label in ((ax_rate, M.samples_per_s, "samples/s (global)"), (ax_mem, mem_key, mem_label)):
        measured = [t for t in trials if t.last(key) is not None]
        ax.scatter([t.number(M.micro_batch_size) or t.number(M.per_gpu_batch_size) for t in measured],
                   [t.last(key) for t in measured], color=[colors[t.trial_id] for t in measured], s=50)
        ax.set_xscale("log", base=2)
        _axes(ax, "per-GPU micro-batch (samples per forward/backward on one rank)", label,
              f"{'throughput' if ax is ax_rate else 'memory'}, last epoch of each trial", legend=False)
    return fig


def _noise_scale(plt, record: SweepRecord, advice, colors, label):
    """B_noise per epoch, and the recommendation's predicted cost per global batch; None: no trial measured it."""
    if not any(t.history.get(M.grad_noise_scale) for t in record.trials):
        return None
    fig, (ax_noise, ax_time) = plt.subplots(1, 2, figsize=(12, 4.5))
    _curves(ax_noise, record.trials, M.grad_noise_scale, colors, label)
    ax_noise.set_yscale("log")
    _axes(ax_noise, "epoch", "B_noise (samples)", "gradient noise scale per epoch (grows as training proceeds)")
    if advice is None:
        ax_time.set_axis_off()
        ax_time.text(0.5, 0.5, "no recommendation: no throughput per batch", ha="center", va="center")
        return fig
    xs = [c.global_batch for c in advice.candidates]
    fewest = min(c.samples for c in advice.candidates)
    ax_time.plot(xs, [c.time for c in advice.candidates], marker="o", label="time× (from samples/s)")
    ax_time.plot(xs, [c.samples / fewest for c in advice.candidates], linestyle="--",
                 label="samples× (vs the smallest)")
    ax_time.axvline(advice.noise_scale, color="grey", linestyle=":",
                    label=f"B_noise ≈ {in_samples(advice.noise_scale)}")
    ax_time.set_xscale("log", base=2)
    _axes(ax_time, "global batch", "relative to the least (1), each batch's LR assumed tuned",
          f"predicted cost to the same loss ({advice.source})", legend=False, fontsize=9)
    ax_time.legend(fontsize=8, loc="best")
    return fig


def _parallel_coordinates(plt, importance, label):
    """One vertical axis per searched knob (its range from the spec; log for loguniform, one tick per choice) and
    one for the metric at the common budget; each compared trial a line coloured by that metric."""
    if importance is None:
        return None
    from matplotlib.colors import Normalize

    imp, knobs = importance, importance.knobs
    values = [v for _, _, v in imp.points]
    low, high = min(values), max(values)
    span = (high - low) or 1.0
    cmap = _pyplot().get_cmap("viridis_r" if imp.mode == "min" else "viridis")  # the better, the brighter
    norm = Normalize(low, high if high > low else low + 1.0)

    def position(knob, value) -> float:
        if knob.kind == "choice":
            return knob.values.index(value) / max(len(knob.values) - 1, 1)
        lo, hi = float(knob.values[0]), float(knob.values[1])
        if hi == lo:
            return 0.5
        if knob.log:
            return (math.log(value) - math.log(lo)) / (math.log(hi) - math.log(lo))
        return (value - lo) / (hi - lo)

    fig, ax = plt.subplots(figsize=(10, 5))
    xs = list(range(len(knobs) + 1))
    worst_first = sorted(imp.points, key=lambda p: -p[2] if imp.mode == "min" else p[2])  # the best drawn on top
    for t, knob_values, value in worst_first:
        ys = [position(k, knob_values[k.name]) for k in knobs] + [(value - low) / span]
        ax.plot(xs, ys, color=cmap(norm(value)), marker="o", markersize=4, alpha=0.9,
                linewidth=2.5 if t.baseline else 1.4, linestyle="--" if t.baseline else "-",
                label=label(t) if t.baseline else None, zorder=3 if t.baseline else 2)
    for i, knob in enumerate(knobs):
        ax.axvline(i, color="grey", linewidth=0.8, zorder=1)
        ticks = (list(knob.values) if knob.kind == "choice" else
                 [float(knob.values[0]), float(knob.values[1])])
        for tick in ticks:
            ax.annotate(knob.show(tick), (i, position(knob, tick)), textcoords="offset points", xytext=(-4, 0),
                        ha="right", va="center", fontsize=8, color="dimgrey")
    ax.axvline(len(knobs), color="grey", linewidth=0.8, zorder=1)
    for tick in (low, high):
        ax.annotate(f"{tick:.4g}", (len(knobs), (tick - low) / span), textcoords="offset points", xytext=(4, 0),
                    ha="left", va="center", fontsize=8, color="dimgrey")
    ax.set_xticks(xs, [f"{k.name}\n{imp.importance.get(k.name, 0.0):.0%} importance" for k in knobs]
                  + [f"{imp.metric}\nat {imp.at}"])
    ax.set_yticks([])
    ax.set_xlim(-0.6, len(knobs) + 0.6)
    fig.colorbar(_pyplot().cm.ScalarMappable(norm=norm, cmap=cmap), ax=ax, label=f"{imp.metric} at {imp.at}")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper left", bbox_to_anchor=(0.0, -0.16), fontsize=8, frameon=False)
    ax.set_title(f"knobs against {imp.metric} at {imp.at}: {len(imp.points)} finished and pruned trials "
                 f"(dashed: the baseline)", fontsize=10)
    return fig


TRIAL_KEY = "raysweep-trial"  # a trial PNG's text entry: trial_key of what it shows


def trial_key(t: RunRecord, metric: str, label: str) -> str:
    """What `trial_plot` draws a trial from, hashed: its run, outcome, settings and every curve. Two equal keys are
    the same picture."""
    drawn = [t.run_id, t.trial_id, t.status, metric, label, t.params.get(M.global_batch_size),
             t.params.get(M.peak_lr), t.history]
    return hashlib.sha256(json.dumps(drawn, sort_keys=True, default=str).encode()).hexdigest()


def drawn_key(png: bytes) -> str | None:
    """The trial_key a PNG was drawn from; None for any other file (an earlier raysweep's PNG, not a PNG)."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(png)) as image:
            return image.text.get(TRIAL_KEY)
    except (OSError, ValueError, SyntaxError):  # PIL's errors for a file that is not an image it can read
        return None


def trial_plot(t: RunRecord, metric: str, label: str, path: Path) -> None:
    """One trial's curves: losses, accuracies, LR (and B_noise where measured); `label`: its settings. The PNG
    names what it was drawn from (TRIAL_KEY)."""
    plt = _pyplot()
    path.parent.mkdir(parents=True, exist_ok=True)
    panels = [("loss", (M.train_loss, M.val_loss)), ("accuracy", (M.val_exact_acc, M.val_char_acc)),
              ("learning rate", (M.lr,))]
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
    final = t.last(metric)
    fig.suptitle(f"trial {t.trial_id} ({label}): {t.status} at epoch {t.epoch}, "
                 f"global batch {t.params.get(M.global_batch_size, '?')}, peak LR {t.number(M.peak_lr) or 0:.2e}; "
                 f"final {metric} {final if final is not None else float('nan'):.4g}")
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={TRIAL_KEY: trial_key(t, metric, label)})
    plt.close(fig)


def probe_plot(result, path: Path) -> None:
    """The probe's table as a PNG (`result`: probe.ProbeResult): peak memory and images/s per per-GPU batch, red
    where it ran out of memory, the memory limit after the margin dashed."""
    plt = _pyplot()
    fig, (ax_mem, ax_rate) = plt.subplots(1, 2, figsize=(10, 4))
    xs = [r.per_gpu_batch_size for r in result.rows]
    colors = ["tab:green" if r.fits else "tab:red" for r in result.rows]
    for ax, key, label in ((ax_mem, result.memory_key, "peak memory (GiB)"), (ax_rate, "images_per_s", "images/s")):
        ax.scatter(xs, [getattr(r, key) for r in result.rows], c=colors)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("per-GPU batch")
        ax.set_ylabel(label)
    ax_mem.axhline(result.limit_gb, color="grey", linestyle="--", label="limit after margin")
    ax_mem.legend()
    fig.suptitle(f"probe: {result.world_size} × {result.device_name}, {result.precision} (red: OOM)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
