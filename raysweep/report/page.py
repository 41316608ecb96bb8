"""report.html: one self-contained file (the plots inlined as base64) that a browser opens from disk.

The summary table's columns come from report/table.py, as the console's do; only the page's own cells are here
(the rank, the trial as a link to its MLflow run, its status).
"""

from __future__ import annotations

import base64
import html
from pathlib import Path

from raysweep.report.importance import MIN_TRIALS
from raysweep.report.plots import PLOTS
from raysweep.report.table import counted, fmt, shown

STYLE = """\
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; max-width: 1400px; }
table { border-collapse: collapse; margin: 1em 0; font-size: 14px; }
th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: right; }
th { background: #f0f0f0; } tr.baseline { background: #fff6d5; } tr.best { background: #e3f5e1; }
tr.other { color: #888; } figure { margin: 1.5em 0; } img { max-width: 100%; border: 1px solid #eee; }
figcaption { color: #555; font-size: 14px; } pre { background: #f7f7f7; padding: 1em; overflow: auto; }
"""


def render(report, ui_base: str) -> str:
    """The whole report.html (`report`: report.SweepReport; `ui_base`: the MLflow UI the trials link into)."""
    r, metric = report.record, report.record.metric
    run_url = f"{ui_base}/#/experiments/{r.experiment_id}/runs"
    ranking = (f"ranked by the time to <b>{html.escape(r.target_label())}</b> (training seconds, interpolated between "
               f"the epochs that straddle it), then the trials that never got there by <b>{metric}</b> ({r.mode})"
               if r.target else f"ranked by <b>{metric}</b> ({r.mode})")
    base = report.baseline
    base_line = (f"Baseline (the spec's defaults): <a href='{run_url}/{base.run_id}'>{html.escape(base.trial_id)}</a>, "
                 f"{metric} {fmt(base.last(metric))}." if base else "No baseline trial in this sweep.")
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>raysweep report: {html.escape(r.experiment)}</title>
<style>
{STYLE}</style></head><body>
<h1>Sweep {html.escape(r.parent_name)}</h1>
<p>Experiment <b>{html.escape(r.experiment)}</b> in <code>{html.escape(r.tracking_uri)}</code>:
{len(r.trials)} trials ({counted(r.trials)}), {ranking}.
<a href="{run_url}/{r.parent_run_id}">parent run in the MLflow UI</a>
(start <code>mlflow ui</code> on the store first).</p>
<p>{base_line} Δ columns are against it.</p>
<h2>Trials</h2>
{_summary(report, run_url)}
{_advice(report)}
{_importance(report)}
<h2>Plots</h2>
{_images(report)}
<h2>Spec</h2>
<pre>{html.escape(r.spec_text)}</pre>
</body></html>
"""


def _summary(report, run_url: str) -> str:
    """The summary table: the ranked trials (report/table.py's columns after the rank, the linked trial and its
    status), then the trials that did not rank, greyed, with their failure and error."""
    r, columns = report.record, shown(report.record)
    trial, figures = columns[0], columns[1:]
    head = "".join(f"<th>{html.escape(c.html_title)}</th>" for c in figures)
    lines = [f"<table id=\"summary\"><tr><th>#</th><th>{trial.header}</th><th>status</th>{head}</tr>"]
    for i, row in enumerate(report.rows, 1):
        t = row.trial
        cells = "".join(f"<td>{html.escape(c.text(row))}</td>" for c in figures)
        lines.append(f"<tr{' class=baseline' if t.baseline else ''}><td>{i}</td>"
                     f"<td><a href='{run_url}/{t.run_id}'>{html.escape(t.trial_id)}</a>"
                     f"{' (baseline)' if t.baseline else ''}</td><td>{t.status}</td>{cells}</tr>")
    ranked = {id(row.trial) for row in report.rows}
    for t in r.trials:
        if id(t) not in ranked:
            lines.append(f"<tr class=other><td></td><td><a href='{run_url}/{t.run_id}'>{html.escape(t.trial_id)}</a>"
                         f"</td><td>{t.status} {html.escape(t.failure or '')}</td>"
                         f"<td colspan={len(figures)}>{html.escape((t.error or '')[:200])}</td></tr>")
    return "\n".join(lines) + "</table>"


def _advice(report) -> str:
    """The batch size worth using (noise.Recommendation) and, with a target, how it held against the sweep."""
    out = ""
    if report.recommendation is not None:
        rec = report.recommendation
        cells = "".join(f"<tr{' class=best' if c is rec.fastest else ''}><td>{c.global_batch}</td>"
                        f"<td>{c.samples_per_s:,.0f}</td><td>{c.samples:.2f}</td><td>{c.steps:.2f}</td>"
                        f"<td>{c.time:.2f}</td></tr>" for c in rec.candidates)
        out = (f"<h2>Batch size worth using</h2><p>Gradient noise scale B<sub>noise</sub> ≈ {rec.noise_scale:,.0f} "
               f"samples ({html.escape(rec.source)}). Predicted cost to reach the same loss: samples ∝ 1 + "
               f"B/B<sub>noise</sub>, steps ∝ 1 + B<sub>noise</sub>/B, time ∝ samples ÷ samples/s. Fastest: global "
               f"batch <b>{rec.fastest.global_batch}</b>; growth stops paying near B ≈ {rec.noise_scale:,.0f}.</p>"
               f"<table><tr><th>global batch</th><th>samples/s</th><th>samples×</th><th>steps×</th><th>time×</th></tr>"
               f"{cells}</table>")
    if report.held:
        cells = "".join(f"<tr><td>{h.global_batch}</td><td>{html.escape(h.trial_id)}</td><td>{h.measured_s:.1f}</td>"
                        f"<td>{h.predicted_s:.1f}</td><td>{h.error:+.0%}</td><td>{h.measured_samples:,.0f}</td>"
                        f"<td>{h.predicted_samples:,.0f}</td></tr>" for h in report.held)
        out += (f"<h3 id='held'>The prediction held against this sweep</h3><p>Per global batch, the trial that "
                f"reached {html.escape(report.record.target_label())} soonest, beside what B<sub>noise</sub> "
                f"predicts (E<sub>min</sub> fitted to all these batches at once, so the errors show how well the "
                f"model's shape across batches holds).</p><table id='held'><tr><th>global batch</th><th>trial</th>"
                f"<th>measured s</th><th>predicted s</th><th>error</th><th>measured samples</th>"
                f"<th>predicted samples</th></tr>{cells}</table>")
    return out


def _importance(report) -> str:
    """Which knob mattered (report/importance.py): each searched knob's share, largest first."""
    imp = report.importance
    head = "<h2 id='importance'>Which knob mattered</h2>"
    if imp is None:
        return (f"{head}<p>Not computed: it needs a searched knob and {MIN_TRIALS} or more finished and pruned "
                f"trials.</p>")
    cells = "".join(f"<tr><td>{html.escape(name)}</td><td>{share:.0%}</td><td style='text-align:left'>"
                    f"<span style='display:inline-block;background:#4c72b0;height:10px;width:{share * 200:.0f}px'>"
                    f"</span></td></tr>" for name, share in imp.importance.items())
    return (f"{head}<p>Each searched knob's share of the variance of <b>{html.escape(imp.metric)}</b> at "
            f"<b>{html.escape(imp.at)}</b>, the budget all {len(imp.points)} finished and pruned trials reached "
            f"(fANOVA: a random forest fitted to knobs → metric, its variance split by knob). Shares from few trials "
            f"are rough: read them with the parallel-coordinates plot below.</p><table id='importance'>"
            f"<tr><th>knob</th><th>importance</th><th></th></tr>{cells}</table>")


def _images(report) -> str:
    """Every PNG of the report, inlined, with its caption (plots.PLOTS)."""
    folder, figures = Path(report.folder), []
    for name in report.files:
        data = base64.b64encode((folder / name).read_bytes()).decode()
        figures.append(f"<figure><img alt='{name}' src='data:image/png;base64,{data}'>"
                       f"<figcaption>{html.escape(PLOTS.get(name, name))}</figcaption></figure>")
    return "".join(figures)
