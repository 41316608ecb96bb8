"""The model plug-in without Ray: the spec's keys, the check before Ray (one line for each mistake a user's model
can make, nothing started), the colour channels, what is shipped to the workers, and users' models
(examples/models/, tests/user_models.py) through the rank code: DDP, the noise meter with and without BatchNorm,
unused parameters. The sweeps with them through Ray are in tests/test_user_sweeps.py."""

from __future__ import annotations

import math
import shutil
import sys

import numpy as np
import pytest
import torch

from raysweep.cli import main
from raysweep.config import ImageSpec, ModelConfig, load_config
from raysweep.models import check, code_to_ship, resolve

from conftest import EXAMPLE_MODELS, ROOT, tiny_spec, write_spec

TESTS = ROOT / "tests"
IMAGE = ImageSpec(width=64, height=24, length=4, num_classes=36)


def _check_line(tmp_path, capsys, *overrides) -> tuple[int, str]:
    """`raysweep check` on a tiny spec with `--set` overrides: its exit code and its error line (or stdout)."""
    path = write_spec(tmp_path, tiny_spec(tmp_path))
    args = ["check", str(path)]
    for item in overrides:
        args += ["--set", item]
    code = main(args)
    out, err = capsys.readouterr()
    return code, err.strip() or out


@pytest.fixture
def user_models(monkeypatch):
    """tests/ first on sys.path, as a user's working directory is, and user_models imported fresh."""
    monkeypatch.syspath_prepend(str(TESTS))
    monkeypatch.delitem(sys.modules, "user_models", raising=False)


@pytest.mark.parametrize("factory,message", [
    ("user_models:raises", r"the factory raised ValueError: depth 3 is too deep for 24-pixel images \(called with"),
    ("user_models:returns_a_list", r"the factory returned a list, not a torch.nn.Module"),
    ("user_models:frozen", r"the model has no trainable parameters"),
    ("user_models:wrong_shape", r"returned logits of shape \(2, 3, 36\); expected \(2, 4, 36\) or \(2, 144\) "
                                r"\(data.length 4 positions × 36 characters"),
    ("user_models:breaks_in_forward", r"its forward on 2 images of shape \(2, 1, 24, 64\) \(float in \[0, 1\], "
                                      r"NCHW\) raised RuntimeError: size mismatch"),
    ("user_models:with_unused", r"2 trainable parameter\(s\) get no gradient from the forward: spare.weight, "
                                r"spare.bias; DDP refuses .* model.find_unused_parameters: true"),
    ("user_models:NOT_A_FUNCTION", r"'NOT_A_FUNCTION' in 'user_models' is not callable \(a 'int'\)"),
    ("user_models:nothing_here", r"module 'user_models' \(.*user_models.py\) has no 'nothing_here'; it has .*tiny"),
    ("no_such_module:build", r"no module named 'no_such_module' \(looked in .*, and the installed packages\)"),
    ("user_models.sub:build", r"no module named 'user_models.sub'"),
])
def test_a_bad_model_is_one_line_naming_it_before_anything_starts(tmp_path, capsys, user_models, factory, message):
    code, line = _check_line(tmp_path, capsys, f"model.factory={factory}")
    assert code == 2 and "\n" not in line and "Traceback" not in line, line
    assert line.startswith(f"raysweep: error: {tmp_path / 'spec.yaml'} (--set model.factory={factory}): "
                           f"model.factory: '{factory}': "), line
    import re

    assert re.search(message, line), line


def test_tune_and_train_refuse_a_bad_model_before_ray(tmp_path, capsys, user_models):
    """The same check at the start of `tune` and `train` (and `probe`): one line, exit 2, no Ray, no store."""
    import ray

    path = write_spec(tmp_path, tiny_spec(tmp_path, model={"factory": "user_models:frozen"}))
    was_up = ray.is_initialized()
    for command in ("tune", "train", "probe"):
        assert main([command, str(path)]) == 2
        assert "the model has no trainable parameters" in capsys.readouterr().err
    assert ray.is_initialized() == was_up and not (tmp_path / "mlflow.db").exists()


@pytest.mark.parametrize("value,message", [
    ("mynet", "is not \"package.module:function\""), ("my-net:build", "is not \"package.module:function\""),
    ("'mynet:'", "is not \"package.module:function\""), ("':build'", "is not \"package.module:function\""),
])
def test_a_malformed_factory_is_the_specs_own_error(tmp_path, capsys, value, message):
    code, line = _check_line(tmp_path, capsys, f"model.factory={value}")
    assert code == 2 and "model.factory" in line and message in line and "captcha_cnn" in line, line


def test_dropout_is_the_built_in_cnns_and_keeps_working(tmp_path, capsys, user_models):
    code, line = _check_line(tmp_path, capsys, "model.factory=user_models:tiny", "model.dropout=0.2")
    assert code == 2 and "dropout is the built-in CNN's" in line and "model.kwargs" in line
    from raysweep.models import build

    assert build(ModelConfig(dropout=0.2), IMAGE).dropout == 0.2
    assert build(ModelConfig(), IMAGE).dropout == 0.5 == build(ModelConfig(factory="captcha_cnn"), IMAGE).dropout
    assert build(ModelConfig(kwargs={"dropout": 0.1}), IMAGE).dropout == 0.1
    code, line = _check_line(tmp_path, capsys, "model.dropout=0.2", "model.kwargs.dropout=0.1")
    assert code == 2 and "dropout is set twice" in line


def test_check_names_the_model_and_its_size(tmp_path, capsys, user_models):
    code, out = _check_line(tmp_path, capsys, "model.factory=user_models:tiny", "model.kwargs.hidden=4")
    model = resolve("user_models:tiny")(IMAGE, hidden=4)
    count = sum(p.numel() for p in model.parameters())
    line = f"# model: user_models:tiny(hidden=4): {count:,} trainable parameters; logits (2, 4, 36)"
    assert code == 0 and line in out
    code, out = _check_line(tmp_path, capsys)
    assert code == 0 and "# model: captcha_cnn(dropout=0.5): " in out


def _lazy_parameters(hidden: int) -> int:
    """user_models:lazy's trainable parameters once its first forward has sized them (1 channel, 24×64 images)."""
    conv, norm = hidden * 1 * 3 * 3 + hidden, 2 * hidden
    linear = (hidden * 2 * 2 * IMAGE.length + 1) * IMAGE.length * IMAGE.num_classes
    return conv + norm + linear


def test_a_model_with_lazy_layers_is_checked_and_counted_once_its_first_forward_sized_them(tmp_path, capsys,
                                                                                            user_models):
    """Lazy layers (nn.LazyConv2d, nn.LazyLinear, ...) have no size until a forward: the check counted them before
    it (a traceback from `numel`, exit 1). raysweep sizes them with one forward of two blank images, in eval mode,
    where the factory's model is built (models.build), so the check, DDP and the optimizer all see sized ones."""
    code, out = _check_line(tmp_path, capsys, "model.factory=user_models:lazy", "model.kwargs.hidden=4")
    line = f"# model: user_models:lazy(hidden=4): {_lazy_parameters(4):,} trainable parameters; logits (2, 4, 36)"
    assert code == 0 and line in out, out
    from raysweep.config import ModelConfig
    from raysweep.models import build

    torch.manual_seed(0)
    module = build(ModelConfig(factory="user_models:lazy", kwargs={"hidden": 4}), IMAGE)
    assert module.training and not any(isinstance(p, torch.nn.parameter.UninitializedParameter)
                                       for p in module.parameters())
    norm = module.body[1]
    assert norm.num_batches_tracked.item() == 0 and torch.equal(norm.running_mean, torch.zeros(4))  # eval: unmoved
    torch.manual_seed(0)
    again = build(ModelConfig(factory="user_models:lazy", kwargs={"hidden": 4}), IMAGE)
    assert all(torch.equal(a, b) for a, b in zip(module.state_dict().values(), again.state_dict().values()))


def test_a_factory_beside_the_spec_is_found_from_another_folder(tmp_path, capsys, monkeypatch):
    """The spec's folder is searched after the working directory: `raysweep tune ~/proj/spec.yaml` from elsewhere."""
    project = tmp_path / "proj"
    project.mkdir()
    shutil.copy(EXAMPLE_MODELS / "crnn.py", project / "crnn_beside.py")
    path = write_spec(project, tiny_spec(tmp_path, model={"factory": "crnn_beside:build", "kwargs": {"width": 4}}))
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the check puts the spec's folder on it
    assert main(["check", str(path)]) == 0
    assert "# model: crnn_beside:build(width=4): " in capsys.readouterr().out


def test_what_is_shipped_is_the_users_top_level_module_or_package_and_never_an_installed_one(tmp_path, monkeypatch):
    (tmp_path / "single.py").write_text("def build(image):\n    pass\n")
    package = tmp_path / "mypkg" / "nets"
    package.mkdir(parents=True)
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "wide.py").write_text("def build(image):\n    pass\n")
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    for name in ("single", "mypkg", "mypkg.nets", "mypkg.nets.wide"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    resolve("single:build")
    resolve("mypkg.nets.wide:build")
    assert code_to_ship(ModelConfig(factory="single:build")) == [str(tmp_path / "single.py")]
    assert code_to_ship(ModelConfig(factory="mypkg.nets.wide:build")) == [str(tmp_path / "mypkg")]
    resolve("json:loads")
    assert code_to_ship(ModelConfig(factory="json:loads")) == []  # the standard library: every node has it
    assert code_to_ship(ModelConfig(factory="raysweep.model:captcha_cnn")) == []  # raysweep itself
    assert code_to_ship(ModelConfig()) == []


# ---------------------------------------------------------------------------------------------
# Colour: data.channels


def test_rgb_images_reach_the_model_as_three_channels_and_are_cached_apart_from_gray(tmp_path):
    from raysweep.data.folder import read_folder
    from raysweep.data.synthetic import synthetic_split, write_captcha_folder
    from raysweep.model import captcha_cnn
    from raysweep.worker.shard import model_input

    charset = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    write_captcha_folder(tmp_path / "d", 6, charset, 4, 64, 24)
    gray = read_folder(tmp_path / "d", charset, 4, 64, 24)
    rgb = read_folder(tmp_path / "d", charset, 4, 64, 24, channels=3)
    assert gray.arrays.images.shape == (6, 24, 64) and rgb.arrays.images.shape == (6, 24, 64, 3)
    assert not rgb.facts.from_cache  # the gray cache is not the RGB one
    assert read_folder(tmp_path / "d", charset, 4, 64, 24).facts.from_cache
    again = read_folder(tmp_path / "d", charset, 4, 64, 24, channels=3)
    assert again.facts.from_cache and np.array_equal(again.arrays.images, rgb.arrays.images)
    # the captcha library draws in colour: RGB keeps what grayscale averages away
    assert (rgb.arrays.images[..., 0] != rgb.arrays.images[..., 2]).mean() > 0.1
    assert synthetic_split("train", 8, 0, charset, 4, 64, 24, channels=3).images.shape == (8, 24, 64, 3)
    x = model_input(torch.from_numpy(rgb.arrays.images))
    assert x.shape == (6, 3, 24, 64) and x.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(x[:, 1], torch.from_numpy(rgb.arrays.images[..., 1]).float() / 255)
    cnn = captcha_cnn(ImageSpec(width=64, height=24, length=4, num_classes=36, channels=3))
    assert cnn.features[0].conv.in_channels == 3 and cnn(x).shape == (6, 144)


def test_a_spec_with_three_channels_gives_its_model_three(tmp_path, capsys, user_models):
    path = write_spec(tmp_path, tiny_spec(tmp_path, data={"channels": 3}, model={"factory": "user_models:tiny"}))
    config = load_config(path)
    assert config.trials.image.channels == 3
    facts = check(config.model, config.trials.image)
    assert facts.output == (2, 4, 36)
    code, line = _check_line(tmp_path, capsys, "data.channels=2")
    assert code == 2 and "data.channels" in line


# ---------------------------------------------------------------------------------------------
# Users' models through the rank code: DDP over two gloo ranks, the noise meter, unused parameters


def _two_rank_epochs(rank: int, world: int, factory: str, kwargs: dict, find_unused: bool = False) -> dict:
    """Two epochs of a 2-rank DDP trial of `factory`: its losses and gradient noise measurements per epoch."""
    from torch import nn

    from raysweep.worker.run import TrainingRun

    from test_gpu import _data, _trial

    trial = _trial(batch=16, n=256, epochs=2, world=world)
    trial = trial.model_copy(update={"model": ModelConfig(factory=factory, kwargs=kwargs,
                                                          find_unused_parameters=find_unused)})
    run = TrainingRun.build(trial, _data(256), rank, world, torch.device("cpu"),
                            wrap=lambda m, **kw: nn.parallel.DistributedDataParallel(
                                m, **kw.get("parallel_strategy_kwargs", {})))
    epochs = [run.epoch(e) for e in (1, 2)]
    return {"losses": [m.train_loss for m in epochs], "noise": [m.grad_noise_scale for m in epochs],
            "sq_norm": [m.grad_sq_norm for m in epochs], "parameters": run.worker_params().model_parameters}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("factory", ["resnet:build", "crnn:build"])
def test_a_users_model_trains_under_ddp_with_the_noise_meter_with_and_without_batchnorm(factory, monkeypatch):
    """The residual net has BatchNorm (DDP broadcasts its buffers), the CRNN has none and a GRU: both train over two
    ranks, every rank sees the same reduced figures, and the noise meter's communication hook measures both."""
    from ranks import run_ranks

    monkeypatch.syspath_prepend(str(EXAMPLE_MODELS))
    ranks = run_ranks(_two_rank_epochs, 2, factory=factory, kwargs={"width": 8})
    assert ranks[0] == ranks[1]  # reduced: one value on every rank
    r = ranks[0]
    assert all(math.isfinite(v) for v in r["losses"]) and r["losses"][1] < r["losses"][0]
    assert all(v is not None and v > 0 for v in r["sq_norm"]), r
    assert all(v is not None and math.isfinite(v) for v in r["noise"]), r
    module = resolve(factory, [EXAMPLE_MODELS])(IMAGE, width=8)
    assert r["parameters"] == sum(p.numel() for p in module.parameters())


@pytest.mark.timeout(300)
def test_a_parameter_without_a_gradient_trains_under_ddp_with_find_unused_parameters(monkeypatch):
    """model.find_unused_parameters: true hands DDP its own option; the check refused the model without it."""
    from ranks import run_ranks

    monkeypatch.syspath_prepend(str(TESTS))
    r = run_ranks(_two_rank_epochs, 2, factory="user_models:with_unused", kwargs={}, find_unused=True)[0]
    assert all(math.isfinite(v) for v in r["losses"])


@pytest.mark.timeout(300)
def test_a_model_with_lazy_layers_trains_under_ddp(monkeypatch):
    """DDP refuses a module whose parameters are not yet sized (torch/nn/parallel/distributed.py), and AdamW would
    hold the unsized ones: the rank's model is sized before either sees it, the same on every rank."""
    from ranks import run_ranks

    monkeypatch.syspath_prepend(str(TESTS))
    ranks = run_ranks(_two_rank_epochs, 2, factory="user_models:lazy", kwargs={"hidden": 8})
    assert ranks[0] == ranks[1]
    r = ranks[0]
    assert all(math.isfinite(v) for v in r["losses"]) and r["losses"][1] < r["losses"][0], r
    assert all(v is not None and math.isfinite(v) for v in r["noise"]), r
    assert r["parameters"] == _lazy_parameters(8)


_STRIDED_1X1 = """
import sys
sys.path.insert(0, {examples!r})
import torch
from raysweep.config import ImageSpec, Knobs, ModelConfig, ScalingConfig, TrainConfig, TrialConfig
from raysweep.data import CaptchaArrays, CaptchaData
from raysweep.worker.run import TrainingRun
import numpy as np
trial = TrialConfig(
    knobs=Knobs(per_gpu_batch_size=16, base_lr=1e-3, warmup_epochs=0, weight_decay=1e-4, grad_accum_steps=1,
                lr_rule="none"),
    train=TrainConfig(epochs=1, precision="fp32"), model=ModelConfig(factory="resnet:build", kwargs={{"width": 8}}),
    scaling=ScalingConfig(num_workers=1), image=ImageSpec(width=160, height=60, length=4, num_classes=36),
    train_size=64)
rng = np.random.default_rng(0)
arrays = CaptchaArrays(rng.integers(0, 256, (64, 60, 160), dtype="uint8"), rng.integers(0, 36, (64, 4), dtype="uint8"))
run = TrainingRun.build(trial, CaptchaData(arrays, arrays, "random"), 0, 1, torch.device("cpu"))
run.fit_in_memory()
print("loss", run.epoch(1).train_loss)
"""


@pytest.mark.timeout(300)
def test_a_residual_network_with_strided_1x1_shortcuts_trains_on_the_cpu_without_corrupting_memory():
    """A 1×1 stride-2 convolution (every ResNet's shortcut) whose input is channels_last and has fewer channels than
    oneDNN's block: its weight gradient wrote past oneDNN's workspace on this CPU (uxlfoundation/oneDNN#6035, open),
    and the process died (`munmap_chunk(): invalid pointer`, a segfault) when raysweep handed every model its
    batches channels_last. A user's model now gets them in the layout of its own weights (NCHW unless it made
    itself channels_last). In a child process: the failure is the process's death."""
    import subprocess

    code = _STRIDED_1X1.format(examples=str(EXAMPLE_MODELS))
    for attempt in range(3):  # a heap corruption does not always kill at once: three chances to show it
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240,
                              env={**__import__("os").environ, "OMP_NUM_THREADS": "1"}, cwd=str(ROOT))
        assert done.returncode == 0, (attempt, done.returncode, done.stderr[-2000:])
        assert "loss" in done.stdout
