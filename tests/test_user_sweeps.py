"""Users' models through Ray: each example network (examples/models/) swept from a folder outside the package, to
the answer at its end; the answer depends on the network; a module that imports on the driver and not on a node
ends the sweep in one line naming the module and the node, before any trial.

On the session's local cluster the workers start in another folder than the test (Ray puts the driver's working
directory, the repository, on their path: ray/_private/worker.py, `code_paths`), so a model in `tmp_path` imports
on a worker only because the sweep shipped it (raysweep/usercode.py)."""

from __future__ import annotations

import json
import shutil

import pytest

from raysweep.cli import main

from conftest import EXAMPLE_MODELS, tiny_spec, write_spec

pytestmark = [pytest.mark.ray, pytest.mark.timeout(420)]

# three trials at two batches, every one to its end (grace = max_t): each network's B_noise from all its trials
SWEEP = dict(
    data={"width": 64, "height": 24, "synthetic": {"train_size": 384, "val_size": 64, "seed": 0}},
    train={"epochs": 3, "reference_batch_size": 64},
    search={"per_gpu_batch_size": {"choice": [16, 32], "default": 16}, "base_lr": 2.0e-3, "warmup_epochs": 0,
            "weight_decay": 1.0e-4},
    tune={"num_samples": 3, "asha": {"grace_period": 3}},
)


def _sweep(tmp_path, capsys, example: str, **model) -> tuple[dict, str, object]:
    """`raysweep tune` of examples/models/<example>.py copied into a folder of its own with its spec: (answer.json,
    the console, the MLflow client and parent run)."""
    from mlflow.tracking import MlflowClient

    folder = tmp_path / example
    folder.mkdir()
    shutil.copy(EXAMPLE_MODELS / f"{example}.py", folder / f"user_{example}.py")
    spec = tiny_spec(folder, name=example, **SWEEP, model={"factory": f"user_{example}:build", **model})
    path = write_spec(folder, spec)
    assert main(["tune", str(path), "--progress-every", "60"]) == 0
    out = capsys.readouterr().out
    answer = json.loads((folder / "results" / example / "report" / "answer.json").read_text())
    client = MlflowClient(f"sqlite:///{folder / 'mlflow.db'}")
    (parent,) = [r for r in client.search_runs([client.get_experiment_by_name(example).experiment_id])
                 if "mlflow.parentRunId" not in r.data.tags]
    return answer, out, (client, parent)


def _b_noise(client, parent) -> list[float]:
    """Every trial's measured B_noise, each epoch's (the DDP ranks' communication hook)."""
    children = client.search_runs([parent.info.experiment_id],
                                  filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    return [m.value for c in children for m in client.get_metric_history(c.info.run_id, "grad_noise_scale")]


def test_each_example_network_sweeps_from_a_folder_of_its_own_to_an_answer_for_that_network(ray_cluster, tmp_path,
                                                                                          capsys):
    from raysweep.config import ImageSpec
    from raysweep.models import resolve

    noise = {}
    for example in ("resnet", "crnn"):
        answer, out, (client, parent) = _sweep(tmp_path, capsys, example, kwargs={"width": 8})
        factory = f"user_{example}:build"
        image = ImageSpec(width=64, height=24, length=4, num_classes=36)
        counted = sum(p.numel() for p in resolve(factory, [tmp_path / example])(image, width=8).parameters())
        # the plan line, the answer's block, answer.json and both runs name the network and its size
        assert f"; model {factory}(width=8): {counted:,} trainable parameters" in out
        assert f"  model:    {factory}(width=8), {counted:,} trainable parameters" in out
        assert answer["model"] == {"factory": factory, "kwargs": {"width": 8}, "parameters": counted}
        assert parent.data.params["model.factory"] == factory and parent.data.params["model.parameters"] == str(counted)
        best = client.get_run(parent.data.tags["best_trial_run_id"]) if "best_trial_run_id" in parent.data.tags \
            else None
        children = client.search_runs([parent.info.experiment_id],
                                      filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
        # what the ranks built, counted by them, is what the driver checked
        assert {c.data.params["model.parameters"] for c in children} == {str(counted)}, best
        assert {c.data.params["model.kwargs"] for c in children} == {json.dumps({"width": 8})}
        noise[example] = _b_noise(client, parent)
        assert noise[example] and all(v > 0 for v in noise[example]), noise
    # the answer depends on the network: on one task, at the same batches, the two measure other noise scales
    # (medians over every trial's epochs; each network's own spread is far narrower than the gap)
    med = {k: sorted(v)[len(v) // 2] for k, v in noise.items()}
    ratio = max(med.values()) / min(med.values())
    print("B_noise medians:", med, "ratio", ratio, "all:", noise)
    assert ratio >= 2, (med, noise)


def test_a_module_that_imports_on_the_driver_and_not_on_a_node_ends_the_sweep_in_one_line(ray_cluster, tmp_path,
                                                                                          capsys):
    """mynet.py imports helper.py beside it: on the driver (the spec's folder is on its path) but not where only
    mynet.py was shipped. One line names the module and the node; no trial starts."""
    folder = tmp_path / "proj"
    folder.mkdir()
    (folder / "helper_beside.py").write_text("WIDTH = 8\n")
    (folder / "mynet_alone.py").write_text(
        "import helper_beside\n"
        "from user_tiny_net import tiny as build\n")
    shutil.copy(EXAMPLE_MODELS.parents[1] / "tests" / "user_models.py", folder / "user_tiny_net.py")
    path = write_spec(folder, tiny_spec(folder, model={"factory": "mynet_alone:build"}))
    assert main(["tune", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert "model.factory: 'mynet_alone:build': importing 'mynet_alone' failed: No module named 'helper_beside'" in err
    assert "[on node " in err and "; it imported on the driver]" in err, err
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{folder / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("t")
    assert experiment is None or not client.search_runs([experiment.experiment_id])  # no sweep, no trial
