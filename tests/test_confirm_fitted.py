"""`tune --confirm`'s second recipe for real: where the sweep's checked fit predicts a better LR at the answer's batch
than its best trial's, both recipes train on the same seeds and the answer keeps whichever measured better.

A real sweep on this machine's tiny task never gives the fit the evidence to beat both rules, so the sweep here is
tests/answer_world.py's made-up one (the best LR moving with the budget, an asymmetric bowl with a cliff, ASHA
on noisy values), written into a real MLflow store as `tune` writes one. What runs after it is what `tune --confirm`
runs (confirm.run_with_fitted): two real confirmations on the local Ray cluster, each recipe for its whole budget on
seeds 1 and 2, then the store, answer.json and report read back."""

from __future__ import annotations

import json
import math

import pytest
from answer_world import world, write_world

TRIALS, SEED = 40, 5  # a world whose checked fit puts the best LR at the answer's batch 0.57× the best trial's
SPEC = """name: w
storage_path: {tmp}/results
data: {{width: 64, height: 24, synthetic: {{train_size: 384, val_size: 64, seed: 0}}}}
scaling: {{num_workers: 2, use_gpu: false, cpus_per_worker: 1}}
train: {{epochs: 500, time_budget_s: 4, reference_batch_size: 64, lr_rule: sqrt, min_lr: 1.0e-6}}
search:
  per_gpu_batch_size: {{choice: [16, 32, 64, 128], default: 32}}
  base_lr: {{loguniform: [1.0e-4, 1.0e-2], default: 1.0e-3}}
  warmup_epochs: 1
  weight_decay: {{loguniform: [1.0e-5, 1.0e-2], default: 1.0e-4}}
tune:
  num_samples: 60
  metric: val_loss
  asha: {{grace_period: 0.4, reduction_factor: 3, unit: seconds}}
mlflow: {{tracking_uri: "sqlite:///{tmp}/mlflow.db"}}
"""
@pytest.mark.ray
@pytest.mark.timeout(420)
def test_tune_confirm_trains_the_fitted_recipe_beside_the_best_trials_and_keeps_the_better(ray_cluster, tmp_path,
                                                                                         capsys):
    from raysweep import confirm
    from raysweep.config import load_config
    from raysweep.tracking import load_sweep

    text = SPEC.format(tmp=tmp_path)
    path = tmp_path / "w.yaml"
    path.write_text(text)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    parent = write_world(world(n=TRIALS, seed=SEED, budget_s=4.0, spec=text), uri, str(tmp_path / "artifacts"))
    config = load_config(path)

    # the premise, read back from the store: the answer is the best trial's, and the fit predicts another LR there
    _, before = confirm.answer_for(config, None)
    best, fitted = before.recipe, before.better
    assert before.trial_id is not None and fitted is not None, before.notes
    assert fitted.global_batch == best.global_batch and not math.isclose(fitted.peak_lr, best.peak_lr, rel_tol=0.2)

    assert confirm.run_with_fitted(config, seeds=(1, 2), progress_every_s=30) == 0
    out = capsys.readouterr().out
    assert (f"the checked fit predicts a better recipe at global batch {best.global_batch}: peak LR "
            f"{fitted.peak_lr:.2e}; it runs next, on the same seeds") in out
    # what the fitted recipe's confirmation is held against is said to be the best trial's value, not its own
    assert f"predicted: {before.expected.source}: the best trial's, which the fitted recipe is predicted to beat" in out

    # two complete confirmations of the sweep on seeds 1 and 2, one per recipe, each seed trained as its recipe says
    record = load_sweep(uri, "w", parent)
    by_lr = {round(c.peak_lr / best.peak_lr, 6): c for c in record.confirmations}
    assert len(record.confirmations) == 2 and set(by_lr) == {1.0, round(fitted.peak_lr / best.peak_lr, 6)}
    ours, theirs = by_lr[1.0], by_lr[round(fitted.peak_lr / best.peak_lr, 6)]
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    for c, recipe in ((ours, best), (theirs, fitted)):
        assert c.complete and c.global_batch == best.global_batch
        assert sorted(r["seed"] for r in c.finished) == [1, 2]
        seeds = client.search_runs([record.experiment_id], filter_string=f"tags.mlflow.parentRunId = "
                                                                        f"'{c.parent_run_id}'")
        assert len(seeds) == 2
        for run in seeds:  # what the workers logged they trained: the recipe's batch, LR and decay
            p = run.data.params
            assert int(p["global_batch_size"]) == recipe.global_batch
            assert float(p["peak_lr"]) == pytest.approx(recipe.peak_lr, rel=1e-6)
            assert float(p["weight_decay"]) == pytest.approx(recipe.weight_decay, rel=1e-6)
        assert c.measured("value") == pytest.approx(sum(r.data.metrics["val_loss"] for r in seeds) / 2)

    # the answer keeps whichever measured better, says which and by how much, the same in answer.json
    a, f = ours.measured("value"), theirs.measured("value")
    _, after = confirm.answer_for(config, None)
    gain = (a - f) / a
    said = json.loads((tmp_path / "results" / "w" / "report" / "answer.json").read_text())
    if f < a:
        assert after.recipe == fitted and after.trial_id is None
        assert after.confirmed.parent_run_id == theirs.parent_run_id
        assert after.notes[-1].endswith(f"({gain:.1%} better): the fitted recipe is the answer"), after.notes
        assert after.confirm_command.endswith("--fitted")
    else:
        assert after.recipe == best and after.trial_id == before.trial_id and after.better is None
        assert after.notes[-1].endswith(f"({-gain:.1%} worse): the best trial's recipe is kept"), after.notes
    assert f"measured val_loss {f:.4g} against the best trial's recipe's {a:.4g}" in after.notes[-1]
    assert said["peak_lr"] == pytest.approx(after.recipe.peak_lr) and said["notes"][-1] == after.notes[-1]
