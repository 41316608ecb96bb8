"""A report rebuilt over an earlier one (`confirm`, `tune --resume`, `raysweep report`) draws again only the trials
that changed: each trial's PNG names what it was drawn from (report/plots.py, trial_key). And the legends beside the
curves hold a sweep of any size."""

from __future__ import annotations

import warnings

from answer_world import world, write_world


def test_a_rebuilt_report_draws_again_only_the_trials_that_changed(tmp_path, monkeypatch):
    from mlflow import MlflowClient
    from mlflow.entities import Metric

    from raysweep import report
    from raysweep.tracking import load_sweep

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    write_world(world(n=12), uri, str(tmp_path / "artifacts"))
    drawn, draw = [], report.trial_plot
    monkeypatch.setattr(report, "trial_plot", lambda t, *args: (drawn.append(t.trial_id), draw(t, *args)))
    out = tmp_path / "report"

    def rebuilt() -> dict[str, bytes]:
        drawn.clear()
        report.publish(load_sweep(uri, "w"), str(out), "w.yaml")
        return {p.stem: p.read_bytes() for p in (out / "trials").iterdir()}

    record = load_sweep(uri, "w")
    trials = [t.trial_id for t in record.trials if t.history]
    first = rebuilt()
    assert sorted(drawn) == sorted(trials) == sorted(first)
    assert rebuilt() == first and drawn == []  # nothing changed: every PNG kept, none drawn
    client = MlflowClient(uri)
    for t in record.trials:  # and each is on its trial's MLflow run, as a drawn one is
        assert f"{t.trial_id}.png" in {a.path for a in client.list_artifacts(t.run_id)}

    # a trial that reports one more epoch is drawn again, alone, and its new picture differs
    moved = next(t for t in record.trials if t.status == "pruned")
    client.log_batch(moved.run_id, metrics=[Metric("val_loss", 0.25, 0, moved.epoch + 1)])
    again = rebuilt()
    assert drawn == [moved.trial_id] and again[moved.trial_id] != first[moved.trial_id]
    assert {k: v for k, v in again.items() if k != moved.trial_id} == {
        k: v for k, v in first.items() if k != moved.trial_id}

    # a PNG under a trial's name that was drawn from something else (here another trial's) is drawn again
    one, other = [t for t in trials if t != moved.trial_id][:2]
    (out / "trials" / f"{one}.png").write_bytes(first[other])
    (out / "trials" / f"{other}.png").write_bytes(b"not a PNG")
    assert rebuilt()[one] == first[one] and sorted(drawn) == sorted([one, other])


def test_a_legend_beside_the_curves_holds_a_sweep_of_any_size():
    """With 60 trials the legend outgrew the figure: its labels were cut, and tight_layout gave up on the whole figure
    (noise_scale.png of a 60-trial sweep). The legend now lists 19 and counts the rest."""
    from raysweep.report.plots import LEGEND_ROWS, _axes, _pyplot

    plt = _pyplot()
    fig, (ax, _) = plt.subplots(1, 2, figsize=(12, 4.5))  # noise_scale.png's shape
    for i in range(60):
        ax.plot([1, 2], [i, i + 1], marker=".", label=f"b128 lr{i + 1:.1f}e-4 wd2.8e-3")
    _axes(ax, "epoch", "B_noise (samples)", "gradient noise scale per epoch")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "Tight layout not applied"
        fig.tight_layout()
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    plt.close(fig)
    assert len(labels) == LEGEND_ROWS and labels[-1] == f"… {60 - LEGEND_ROWS + 1} more (report.html's table)"
    assert labels[:2] == ["b128 lr1.0e-4 wd2.8e-3", "b128 lr2.0e-4 wd2.8e-3"]
