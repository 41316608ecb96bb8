"""The sweep report, from the MLflow store alone: the summary table with the baseline delta, the plots,
each trial's curves, the time-to-target recommendation and one self-contained report.html.

`tune` builds it at the end of every sweep; `python -m raysweep report` rebuilds it for any sweep in a
store (one that ran on a cluster, an interrupted one) without starting Ray. Reads go through
tracking.load_sweep, writes through tracking.log_report (imported where they run: the console imports table.py,
and with it this file); this package only computes and draws:

- table.py: the summary table (rows, columns, the missing-value rule), which the console prints too;
- plots.py: every PNG (the sweep's, each trial's, the probe's);
- importance.py: which knob mattered (fANOVA at a budget every compared trial reached), and trials named by their
  settings;
- page.py: report.html;
- here: what the report computes (the answer: raysweep/answer/; the recommendation and how it held), building it,
  publishing it into a folder of its own (`claim_folder`), and the `report` subcommand.
"""

from __future__ import annotations

import dataclasses
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

from raysweep import layout, storage
from raysweep.answer import ANSWER_FILE, Answer, answer_of
from raysweep.errors import UserError
from raysweep.metrics import RunRecord, SweepRecord
from raysweep.metrics import names as M
from raysweep.noise import Held, Recommendation, held_against, recommend
from raysweep.report import page
from raysweep.report.importance import Importance, knob_importance, trial_labels
from raysweep.report.plots import PLOTS, drawn_key, sweep_plots, trial_key, trial_plot
from raysweep.report.table import SummaryRow, ranked, summary_rows

__all__ = ["ANSWER_FILE", "PLOTS", "REPORT_MARKER", "Importance", "SummaryRow", "SweepReport", "build", "claim_folder",
           "foreign_files", "held", "publish", "ranked", "recommendation", "run", "summary_rows"]


@dataclass(frozen=True)
class SweepReport:
    record: SweepRecord
    answer: Answer | None  # the sweep's one answer (raysweep/answer/); None when no trial ranked
    rows: list[SummaryRow]  # ranked, best first (failed trials and those without the metric left out)
    baseline: RunRecord | None
    recommendation: Recommendation | None
    held: list[Held]  # the recommendation against the sweep's measured times to the target, per global batch
    importance: Importance | None  # which knob mattered (report/importance.py); None with too few trials
    folder: str  # where the files are
    files: list[str]  # file names in `folder`: plots and report.html


def held(record: SweepRecord, advice: Recommendation | None) -> list[Held]:
    """The recommendation's B_noise held against the sweep: per global batch, its fastest trial to the target
    (noise.held_against); [] without a target, a B_noise, or two batches that reached it."""
    if advice is None or record.target is None:
        return []
    best: dict[int, tuple[str, float, float]] = {}
    for t in record.trials:
        batch, seconds = t.number(M.global_batch_size), t.last(M.time_to_target_s)
        samples = t.last(M.samples_to_target)
        if batch and seconds and samples and (int(batch) not in best or seconds < best[int(batch)][1]):
            best[int(batch)] = (t.trial_id, seconds, samples)
    return held_against(advice.noise_scale, best)


def recommendation(record: SweepRecord) -> Recommendation | None:
    """B_noise from the best trial's last epoch (else the median of the trials' last values); throughput per
    global batch = the median last `samples_per_s` of its trials. None when no trial measured B_noise."""
    best = ranked(record)
    measured = [t for t in (best or record.trials) if t.last(M.grad_noise_scale)]
    if not measured:
        return None
    if best and measured[0] is best[0]:
        noise, source = best[0].last(M.grad_noise_scale), f"best trial {best[0].trial_id}, epoch {best[0].epoch}"
    else:
        noise = statistics.median(t.last(M.grad_noise_scale) for t in measured)
        source = f"median of {len(measured)} trials' last epochs"
    rates: dict[int, list[float]] = {}
    for t in record.trials:
        batch, rate = t.number(M.global_batch_size), t.last(M.samples_per_s)
        if batch and rate:
            rates.setdefault(int(batch), []).append(rate)
    return recommend(noise, {b: statistics.median(r) for b, r in rates.items()}, source)


def build(record: SweepRecord, folder: Path, ui_base: str = "http://127.0.0.1:5000",
          spec_args: str | None = None, earlier: str | None = None) -> tuple[SweepReport, dict]:
    """Write answer.json, the plots, the per-trial PNGs (under trials/) and report.html into `folder`. `spec_args`:
    the spec file and overrides (config.SweepConfig.command_args), for the answer's confirm command; `earlier`: a
    report's location (a folder or URI) whose trial PNGs are kept where their trial did not change (`trial_pngs`).
    Returns the report and {child run id: its PNG} for tracking.log_report."""
    import json

    folder.mkdir(parents=True, exist_ok=True)
    rows, baseline = summary_rows(record)
    advice = recommendation(record)
    answer = answer_of(record, spec_args, advice)
    if answer is not None:
        (folder / ANSWER_FILE).write_text(json.dumps(answer.as_json(), indent=1) + "\n")
    checked = held(record, advice)
    importance = knob_importance(record)
    labels = trial_labels(record)
    files = sweep_plots(record, [row.trial for row in rows], advice, importance, labels, folder)
    trial_pngs = {t.run_id: _trial_png(t, record.metric, labels[t.trial_id], folder, earlier)
                  for t in record.trials if t.history}
    report = SweepReport(record, answer, rows, baseline, advice, checked, importance, str(folder), files)
    (folder / "report.html").write_text(page.render(report, ui_base))
    written = [ANSWER_FILE] if answer is not None else []
    return dataclasses.replace(report, files=[*files, "report.html", *written]), trial_pngs


def _trial_png(t: RunRecord, metric: str, label: str, folder: Path, earlier: str | None) -> Path:
    """A trial's PNG under `folder`/trials: the `earlier` report's where it was drawn from what the trial is now
    (plots.trial_key), else drawn."""
    path = folder / "trials" / f"{t.trial_id}.png"
    kept = storage.read_bytes(storage.join(earlier, "trials", path.name)) if earlier else None
    if kept is not None and drawn_key(kept) == trial_key(t, metric, label):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(kept)
    else:
        trial_plot(t, metric, label, path)
    return path


REPORT_MARKER = ".raysweep-report"  # in a local report folder: raysweep wrote the folder (claim_folder)


def publish(record: SweepRecord, location: str, spec_args: str | None = None) -> SweepReport:
    """Build the report into `location` (a folder, or a URI under shared storage) and log it to MLflow: the
    files and summary.json on the parent run, each trial's PNG on its child run, the answer (answer.* params and
    metrics), the recommendation and the knobs' importance. `spec_args`: as for `build`.

    The report is built in a folder of its own, so that MLflow gets the report's files and nothing else, then
    copied to `location`; a local folder must be new, empty or a report raysweep wrote (`claim_folder`)."""
    import shutil
    import tempfile

    from raysweep import tracking

    local = not storage.is_uri(location)
    if local:
        claim_folder(Path(location))
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        report, trial_pngs = build(record, folder, spec_args=spec_args, earlier=location)
        tracking.log_report(record.tracking_uri, record, folder, trial_pngs,
                            [row.as_dict(record.metric) for row in report.rows])
        if report.answer is not None:
            tracking.log_answer(record.tracking_uri, record.parent_run_id, report.answer)
        if report.recommendation is not None:
            tracking.log_recommendation(record.tracking_uri, record.parent_run_id, report.recommendation)
        if report.importance is not None:
            tracking.log_importance(record.tracking_uri, record.parent_run_id, report.importance.as_dict())
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
    top = {REPORT_MARKER, "report.html", ANSWER_FILE, *PLOTS}
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
    from raysweep import console, tracking
    from raysweep.answer import console as answer_console

    if (spec is None) == (experiment is None):
        raise UserError("report: give a spec (e.g. search_spaces/quickstart.yaml) or --experiment NAME, not both")
    from raysweep.config import MlflowSection, load_config

    if spec is not None:
        config = load_config(spec, overrides, sweep=False, trial=False)  # it reads a store: nothing to train
        experiment, retry_s = config.experiment_name, config.mlflow.retry_s
        uri = tracking.resolve_tracking_uri(tracking_uri or config.mlflow.tracking_uri)
        default_out = storage.join(storage.resolve(config.storage_path), config.name, layout.REPORT)
    else:
        uri, retry_s = tracking.resolve_tracking_uri(tracking_uri), MlflowSection().retry_s
        default_out = str(Path("raysweep_report", experiment).resolve())
    record = tracking.read_sweep(uri, experiment, retry_s)
    report = publish(record, out or default_out, config.command_args if spec is not None else None)
    console.print_report(report)
    answer_console.print_answer(report.answer)
    return 0
