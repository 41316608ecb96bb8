"""The sweep's summary table, defined once: its rows (the ranked trials, each with its deltas against the baseline)
and its columns (header, value, format), with the one rule for a missing value. console.py prints it as text,
report/page.py writes it into report.html, and summary.json is its values (`SummaryRow.as_dict`).

Plain Python on metrics.py's records: the console imports it, so it never imports matplotlib or MLflow.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from raysweep.metrics import FAILED, RunRecord, SweepRecord, outcome_counts, rank
from raysweep.metrics import names as M
from raysweep.noise import in_samples

MISSING = "-"  # a cell without a value, on the console and in report.html alike
SAMPLES = "samples"  # fmt's spec for B_noise, in samples: noise.in_samples


def fmt(value, spec: str = ".4g", signed: bool = False) -> str:
    """A table cell: MISSING for a missing value, a float by `spec` (with its sign where `signed`: a delta; SAMPLES:
    noise.in_samples), anything else as its text."""
    if value is None or value == "":
        return MISSING
    if isinstance(value, float):
        return in_samples(value) if spec == SAMPLES else format(value, ("+" if signed else "") + spec)
    return str(value)


def format_table(columns, rows) -> str:
    """Text columns, each as wide as its widest cell, two spaces apart (`rows`: lists of cells)."""
    widths = [max(len(str(c)), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(columns)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def counted(trials) -> str:
    """How the trials stand, e.g. `3 finished, 1 pruned` (metrics.outcome_counts; the outcomes with none left out)."""
    return ", ".join(f"{n} {outcome}" for outcome, n in outcome_counts(trials).items() if n)


@dataclass(frozen=True)
class SummaryRow:
    """One ranked trial: its record, the ranking metric's last value, and its deltas against the baseline."""

    trial: RunRecord
    value: float | None  # the ranking metric, last epoch
    delta: float | None  # against the baseline (None: no baseline, or this is it)
    delta_wall_s: float | None
    delta_samples_per_s: float | None

    def as_dict(self, metric: str) -> dict:
        """The row as summary.json holds it: every column with a `key`, in order."""
        return {c.key: c.value(self) for c in columns(metric) if c.key}


@dataclass(frozen=True)
class Column:
    """One column of the summary table: its header, its value in a row, and how the value prints."""

    header: str | None  # on the console and in report.html; None: a field of summary.json alone
    value: Callable[[SummaryRow], Any]
    spec: str = ".4g"  # format spec of a number (fmt)
    signed: bool = False  # a delta against the baseline: printed with its sign
    key: str | None = None  # its field in summary.json; None: printed only
    target_only: bool = False  # printed only where the sweep has a target (summary.json always holds it)
    title: str | None = None  # its header in report.html, where the page has room to spell it out (else `header`)

    @property
    def html_title(self) -> str | None:
        return self.title or self.header

    def text(self, row: SummaryRow) -> str:
        return fmt(self.value(row), self.spec, self.signed)


def _param(name: str) -> Callable[[SummaryRow], float | None]:
    return lambda row: row.trial.number(name)


def _last(name: str) -> Callable[[SummaryRow], float | None]:
    return lambda row: row.trial.last(name)


def columns(metric: str, target_label: str = "") -> tuple[Column, ...]:
    """The summary table's columns in order (`metric`: the ranking metric; `target_label`: SweepRecord.target_label,
    the time-to-target column's header). Spec "" prints a float as its param was logged (str)."""
    return (
        Column("trial", lambda row: row.trial.trial_id + (" (baseline)" if row.trial.baseline else "")),
        Column(None, lambda row: row.trial.trial_id, key="trial_id"),
        Column(None, lambda row: row.trial.run_id, key="run_id"),
        Column(None, lambda row: row.trial.status, key="status"),
        Column(None, lambda row: row.trial.baseline, key="baseline"),
        Column("per_gpu", _param(M.per_gpu_batch_size), ".0f", key=M.per_gpu_batch_size, title="per-GPU"),
        Column("global", _param(M.global_batch_size), ".0f", key=M.global_batch_size),
        Column("base_lr", _param(M.base_lr), ".2e", key=M.base_lr, title="base LR"),
        Column("peak_lr", _param(M.peak_lr), ".2e", key=M.peak_lr, title="peak LR"),
        Column("warmup", _param(M.warmup_epochs), ""),
        Column("wd", _param(M.weight_decay), ".1e"),
        Column("epoch", lambda row: row.trial.epoch, key=M.epoch),
        Column(metric, lambda row: row.value, key=metric),
        Column(f"Δ{metric}", lambda row: row.delta, signed=True, key=f"delta_{metric}", title=f"Δ {metric}"),
        Column("wall_s", lambda row: row.trial.wall_s, ".0f", key="wall_s", title="wall s"),
        Column("Δwall_s", lambda row: row.delta_wall_s, ".0f", signed=True, key="delta_wall_s",
               title="Δ wall s"),
        Column("samples/s", _last(M.samples_per_s), ",.0f", key=M.samples_per_s),
        Column("Δsamples/s", lambda row: row.delta_samples_per_s, ",.0f", signed=True,
               key=f"delta_{M.samples_per_s}"),
        Column("b_noise", _last(M.grad_noise_scale), SAMPLES, key=M.grad_noise_scale),
        Column("train_s", _last(M.train_seconds), ".1f", key=M.train_seconds, title="train s"),
        Column(None, _param(M.resolved_epochs), key=M.resolved_epochs),
        Column(f"to {target_label} s", _last(M.time_to_target_s), ".1f", key=M.time_to_target_s, target_only=True,
               title=f"time to {target_label} (s)"),
        Column(None, _last(M.epochs_to_target), key=M.epochs_to_target),
        Column(None, _last(M.samples_to_target), key=M.samples_to_target),
    )


def shown(record: SweepRecord) -> list[Column]:
    """The columns a sweep's table prints (the console and report.html): the trial's first."""
    return [c for c in columns(record.metric, record.target_label())
            if c.header is not None and (record.target is not None or not c.target_only)]


def ranked(record: SweepRecord) -> list[RunRecord]:
    """Trials that did not fail, best first: by the metric, or with a target by time_to_target_s and then the rest
    by the metric (metrics.rank, as the sweep's own summary)."""
    return rank([t for t in record.trials if t.status != FAILED], RunRecord.last, record.metric, record.mode,
                record.target is not None)


def summary_rows(record: SweepRecord) -> tuple[list[SummaryRow], RunRecord | None]:
    """The ranked trials as rows, each with its deltas against the baseline; and the baseline (None: none ran)."""
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
            minus(t.last(M.samples_per_s), base.last(M.samples_per_s)) if base else None))
    return rows, baseline
