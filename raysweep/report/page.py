"""report.html: one self-contained file (the plots inlined as base64) that a browser opens from disk.

The summary table's columns come from report/table.py, as the console's do; only the page's own cells are here
(the rank, the trial as a link to its MLflow run, its status).
"""

from __future__ import annotations

import base64
import html
from pathlib import Path

from raysweep.noise import in_samples
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
{_answer(report, run_url)}
<h2>The sweep</h2>
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


def _answer(report, run_url: str) -> str:
    """The sweep's one answer (answer.Answer), first on the page: the recipe, what it expects, the trials behind it,
    the LR for other batches, the confirmation."""
    a = report.answer
    if a is None:
        return "<h2 id='answer'>The answer</h2><p>None: no trial finished or was pruned.</p>"
    r, e, fit = a.recipe, a.expected, a.lr_fit
    kind = ("predicted (not yet run)" if a.trial_id is None and a.predicted else
            "predicted: its trial did not run the whole budget" if a.predicted else "ran" if a.trial_id else
            "the fitted recipe, confirmed better than the best trial's")
    rows = [("model", f"<b>{html.escape(r.model_line)}</b> (the recipe is this network's)"),
            ("global batch", f"<b>{r.global_batch}</b> = per-GPU {r.per_gpu_batch_size} × {r.num_workers} workers × "
                             f"{r.grad_accum_steps} accumulation"),
            ("peak LR", f"<b>{r.peak_lr:.3e}</b> (base_lr {r.base_lr:.3e} at reference batch {r.reference_batch_size}, "
                        f"{html.escape(r.lr_rule)} rule)"),
            ("warmup", f"<b>{r.warmup_epochs:g}</b> epoch{'' if r.warmup_epochs == 1 else 's'}"),
            ("weight decay", f"<b>{r.weight_decay:.3e}</b> (AdamW)"),
            ("schedule", html.escape(r.schedule)), ("precision, clip", f"{html.escape(r.precision)}, {r.grad_clip}")]
    expects = f"{html.escape(e.metric)} {fmt(e.value)}" if e.value is not None else ""
    if e.time_to_target_s is not None:
        expects += f"; the target in {e.time_to_target_s:.1f} training seconds"
    if e.samples is not None:
        expects += f"; after {e.samples:,.0f} training samples" + (f" (≈ {e.seconds:.1f} s)" if e.seconds else "")
    rows.append(("expects", f"{expects} at {html.escape(e.at)} <small>({html.escape(e.source)})</small>"))
    if a.trial_id is not None:
        links = ", ".join(f"{html.escape(t['trial_id'])} ({html.escape(t['role'])}, batch {t['global_batch']}, "
                          f"{html.escape(e.metric)} {fmt(t.get(e.metric))})" for t in a.trials[:6])
        rows.append(("the trials behind it", links))
    if fit.fitted:
        rows.append(("LR for other batches", f"best peak LR ∝ B<sup>{fit.exponent:.2f}</sup>, 90 % interval "
                                             f"{fit.interval[0]:.2f} to {fit.interval[1]:.2f}: "
                                             f"<b>{html.escape(fit.supports)}</b> ({html.escape(fit.reason)})"))
    else:
        rows.append(("LR for other batches", f"not fitted: {html.escape(fit.reason)}"))
    from raysweep.answer.console import used_words

    rows.append(("another batch", html.escape(used_words(fit))))
    for note in a.notes:
        rows.append(("note", html.escape(note)))
    if a.confirmed is not None:
        from raysweep.answer.console import confirmation_line

        rows.append(("confirmed", html.escape(confirmation_line(a.confirmed))))
    rows.append(("confirm it", f"<code>{html.escape(a.confirm_command)}</code> (two seeds, the whole budget, "
                               f"outside ASHA)"))
    cells = "".join(f"<tr><th style='text-align:left'>{k}</th><td style='text-align:left'>{v}</td></tr>"
                    for k, v in rows)
    return (f"<h2 id='answer'>The answer ({kind})</h2><p>What to train with: the sweep's best trial, ranked as the "
            f"table below ranks them; <code>answer.json</code> beside this page holds it whole.</p>"
            f"<table id='answer'>{cells}</table>")


def _advice(report) -> str:
    """The noise scale's prediction per global batch (noise.Recommendation), evidence beside the answer, and, with a
    target, how it held against the sweep."""
    out = ""
    if report.recommendation is not None:
        rec = report.recommendation
        cells = "".join(f"<tr><td>{c.global_batch}</td><td>{c.samples_per_s:,.0f}</td><td>{c.samples:.2f}</td>"
                        f"<td>{c.steps:.2f}</td><td>{c.time:.2f}</td></tr>" for c in rec.candidates)
        out = (f"<h2>What the noise scale predicts</h2><p>Gradient noise scale B<sub>noise</sub> ≈ "
               f"{in_samples(rec.noise_scale)} samples ({html.escape(rec.source)}). Predicted cost to reach the same "
               f"loss at each global batch the sweep measured, with its LR tuned: samples ∝ 1 + B/B<sub>noise</sub>, "
               f"steps ∝ 1 + B<sub>noise</sub>/B, time ∝ samples ÷ samples/s (1 = the least). Growth stops paying "
               f"near B ≈ {in_samples(rec.noise_scale)}. Evidence, not the answer: <code>raysweep answer SPEC --batch N"
               f"</code> predicts a recipe for any batch, and <code>raysweep confirm SPEC --batch N</code> measures "
               f"it.</p><table><tr><th>global batch</th><th>samples/s</th><th>samples×</th><th>steps×</th>"
               f"<th>time×</th></tr>{cells}</table>")
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
