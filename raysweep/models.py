"""The model contract: the spec names a factory, the loop trains what it returns (docs/your-model.md).

    factory(image: ImageSpec, **model.kwargs) -> torch.nn.Module

`image` (config.ImageSpec) says what the images are and what to predict: `channels` (1 grayscale, 3 RGB),
`height`, `width` (pixels), `length` (characters per captcha) and `num_classes` (characters in the charset). The
module maps float images (N, channels, height, width) in [0, 1] to logits for every (position, character):
(N, length, num_classes), or the same flattened, (N, length × num_classes). The batch comes in the layout of the
model's own convolution weights: contiguous NCHW, PyTorch's default, or NHWC for a model made channels_last (as
raysweep's CNN makes itself: worker/shard.wants_channels_last). The loss is raysweep's (a sigmoid cross-entropy per
class, `nn.MultiLabelSoftMarginLoss`, on one-hot targets); so are the loop, the schedule, the optimizer, the
precision, DDP, compile and CUDA graphs, the probe and the noise meter (worker/).

The factory is named in the spec as `model.factory: "package.module:function"` (a built-in by its name:
`captcha_cnn`, raysweep's CNN and the default). Torch is imported only where a model is built: the config
validates a factory's name without it.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from raysweep.config.sections import BUILTIN_MODELS as BUILTIN
from raysweep.config.sections import DEFAULT_MODEL as DEFAULT
from raysweep.errors import UserError

if TYPE_CHECKING:
    from torch import nn

    from raysweep.config import ImageSpec, ModelConfig

CHECK_IMAGES = 2  # the check's forward pass: two images (BatchNorm in training mode needs more than one)
NAMED = 5  # parameters named in one error line, at most


class ModelFactory(Protocol):
    """What `model.factory` names: called with the image spec and model.kwargs, returns the module to train."""

    def __call__(self, image: ImageSpec, /, **kwargs: Any) -> nn.Module: ...


class ModelCodeError(RuntimeError):
    """A factory that imports on the driver does not import where a rank runs (raised on the worker)."""


@dataclass(frozen=True)
class ModelFacts:
    """What the check found: the model's name, its size and its output, for the plan line, MLflow and answer.json."""

    name: str  # model.factory as given (a built-in's name for the CNN)
    kwargs: dict
    parameters: int  # trainable parameters
    output: tuple[int, ...]  # what the forward of CHECK_IMAGES images returned

    def params(self) -> dict[str, str]:
        """As MLflow params (metrics.MODEL_FACTORY, ...): a sweep's parent run names the model it trains."""
        import json

        from raysweep.metrics import MODEL_FACTORY, MODEL_KWARGS, MODEL_PARAMETERS

        return {MODEL_FACTORY: self.name, MODEL_KWARGS: json.dumps(self.kwargs, sort_keys=True),
                MODEL_PARAMETERS: str(self.parameters)}

    def line(self) -> str:
        kwargs = ", ".join(f"{k}={v!r}" for k, v in self.kwargs.items())
        return f"{self.name}({kwargs}): {self.parameters:,} trainable parameters"


def target(factory: str | None) -> tuple[str, str]:
    """(module, attribute path) of a factory string (a built-in's name stands for its own)."""
    module, _, attr = BUILTIN.get(factory or DEFAULT, factory).partition(":")
    return module, attr


def resolve(factory: str | None, search: Sequence[Path] = ()) -> ModelFactory:
    """The function `factory` names, imported (with `search` folders first on sys.path). Raises UserError: one line
    naming what is wrong (the module not found and where it was looked for, an import that raised, a name that is
    missing or not callable)."""
    module_name, attr = target(factory)
    for folder in reversed([str(f) for f in search]):
        if folder not in sys.path:
            sys.path.insert(0, folder)
    key = f"model.factory: {factory!r}"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and (module_name == e.name or module_name.startswith(e.name + ".")):
            where = ", ".join(str(f) for f in search)
            raise UserError(f"{key}: no module named {module_name!r} (looked in {where + ', ' if where else ''}and the "
                            f"installed packages); run from the folder that holds it, put it beside the spec, or "
                            f"install it") from None
        raise UserError(f"{key}: importing {module_name!r} failed: {e} (install {e.name!r} here and on every node)") \
            from None
    except Exception as e:  # the user's module raised at import (a SyntaxError, an error at its top level)
        raise UserError(f"{key}: importing {module_name!r} raised {_one_line(e)}") from None
    found: Any = module
    for part in attr.split("."):
        if not hasattr(found, part):
            names = sorted(n for n, v in vars(module).items() if inspect.isfunction(v) and not n.startswith("_")
                           and getattr(v, "__module__", None) == module.__name__)[:10]  # its own functions
            raise UserError(f"{key}: module {module_name!r} ({getattr(module, '__file__', '?')}) has no {attr!r}"
                            f"{'; it has ' + ', '.join(names) if names else ''}")
        found = getattr(found, part)
    if not callable(found):
        raise UserError(f"{key}: {attr!r} in {module_name!r} is not callable (a {type(found).__name__!r}); name the "
                        f"function that makes the model")
    return found


def build(model: ModelConfig, image: ImageSpec, path: str | None = None) -> nn.Module:
    """The module `model` names, for images of `image`, as its factory makes it (on the CPU). `path`: the built-in
    CNN's path (model.CaptchaCNN: the CPU's kernels or the ops CUDA compiles; tests run CUDA's on a CPU)."""
    kwargs = model.factory_kwargs()
    if path is not None:
        if not model.builtin:
            raise ValueError(f"path {path!r} is the built-in CNN's; {model.name} takes no path")
        kwargs["path"] = path
    module = resolve(model.factory)(image, **kwargs)
    size_lazy(module, image)
    return module


def size_lazy(module: nn.Module, image: ImageSpec) -> None:
    """Size a module's lazy layers (nn.LazyConv2d, nn.LazyLinear, ...: torch/nn/modules/lazy.py) by one forward of
    CHECK_IMAGES blank images, as PyTorch asks before DDP, an optimizer or `numel` may see them. In eval mode and
    without autograd, so no running statistic moves and no dropout draws; each submodule's mode is then as the
    factory left it. The lazy layers' initialisation draws from torch's RNG, as a sized layer's does in its
    constructor: the trial's seed makes it the same on every rank. A module without lazy layers is not touched."""
    import torch
    from torch.nn.parameter import is_lazy

    from raysweep.worker.shard import model_input, wants_channels_last

    if not any(is_lazy(t) for t in (*module.parameters(), *module.buffers())):
        return
    modes = [(m, m.training) for m in module.modules()]
    stored = _stored(image)
    x = model_input(torch.zeros(stored, dtype=torch.uint8), wants_channels_last(module))
    try:
        module.eval()
        with torch.no_grad():
            module(x)
    finally:
        for m, training in modes:
            m.training = training


def _stored(image: ImageSpec) -> tuple[int, ...]:
    """CHECK_IMAGES images as the data path stores them: uint8 (N, H, W), or (N, H, W, C) for colour."""
    return (CHECK_IMAGES, image.height, image.width) + ((image.channels,) if image.channels > 1 else ())


def count_parameters(module: nn.Module) -> int:
    """Trainable parameters (elements of those with requires_grad)."""
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def check(model: ModelConfig, image: ImageSpec, search: Sequence[Path] = ()) -> ModelFacts:
    """Before Ray: import the factory, build the model on the CPU, and train it one step's forward and backward
    on CHECK_IMAGES random images, as the loop does. Raises UserError, one line for each thing that would end every
    trial: a factory that raises, something that is not an nn.Module, a forward that raises or returns the wrong
    shape, no trainable parameter, a parameter left without a gradient (DDP refuses it on its second step) unless
    model.find_unused_parameters is set; and one line if this environment has no torch."""
    try:
        import torch
        from torch import nn
    except ImportError as e:
        raise UserError(f"the model check needs torch, and this Python ({sys.executable}) cannot import it: "
                        f"{_one_line(e)}; install it first: pip install torch==2.13.0 (the README's first "
                        f"command)") from None

    from raysweep.worker.shard import model_input, wants_channels_last

    factory = resolve(model.factory, search)
    key = f"model.factory: {model.name!r}"
    kwargs = model.factory_kwargs()
    try:
        with torch.random.fork_rng(devices=[]):
            module = factory(image, **kwargs)
    except Exception as e:
        raise UserError(f"{key}: the factory raised {_one_line(e)} (called with the image spec and model.kwargs "
                        f"{kwargs})") from None
    if not isinstance(module, nn.Module):
        raise UserError(f"{key}: the factory returned a {type(module).__name__}, not a torch.nn.Module")
    shape = (CHECK_IMAGES, image.channels, image.height, image.width)

    def forward(fn):
        try:
            with torch.random.fork_rng(devices=[]):
                return fn()
        except Exception as e:
            layout = "channels_last" if wants_channels_last(module) else "NCHW"
            raise UserError(f"{key}: its forward on {CHECK_IMAGES} images of shape {shape} (float in [0, 1], "
                            f"{layout}) raised {_one_line(e)}") from None

    forward(lambda: size_lazy(module, image))  # as models.build does: lazy layers sized before anything counts them
    trainable = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    if not trainable:
        raise UserError(f"{key}: the model has no trainable parameters (none with requires_grad): there is nothing "
                        f"to train")
    stored = _stored(image)
    x = model_input(torch.randint(0, 256, stored, dtype=torch.uint8), wants_channels_last(module))  # as the loop does
    module.train()
    out = forward(lambda: module(x))
    if not isinstance(out, torch.Tensor):
        raise UserError(f"{key}: its forward returned a {type(out).__name__}; expected a tensor of logits "
                        f"({CHECK_IMAGES}, {image.length}, {image.num_classes}) or ({CHECK_IMAGES}, "
                        f"{image.length * image.num_classes})")
    wanted = ((CHECK_IMAGES, image.length, image.num_classes), (CHECK_IMAGES, image.length * image.num_classes))
    if tuple(out.shape) not in wanted:
        raise UserError(f"{key}: its forward on images of shape {shape} returned logits of shape {tuple(out.shape)}; "
                        f"expected {wanted[0]} or {wanted[1]} (data.length {image.length} positions × "
                        f"{image.num_classes} characters of data.charset)")
    if not out.requires_grad:
        raise UserError(f"{key}: its logits do not depend on any trainable parameter (no gradient can reach them)")
    out.float().square().mean().backward()
    unused = [n for n, p in trainable if p.grad is None]
    if unused and not model.find_unused_parameters:
        more = " ..." if len(unused) > NAMED else ""
        raise UserError(f"{key}: {len(unused)} trainable parameter(s) get no gradient from the forward: "
                        f"{', '.join(unused[:NAMED])}{more}; DDP refuses that on its second step: remove them or "
                        f"freeze them (requires_grad_(False)), or set model.find_unused_parameters: true (a pass over "
                        f"the autograd graph every step)")
    return ModelFacts(model.name, kwargs, count_parameters(module), tuple(out.shape))


def check_spec_model(config) -> ModelFacts:
    """`check` for a whole spec (config.SweepConfig): its model, image and search path; the error line starts with
    the spec file. `tune`, `train`, `confirm`, `probe` and `check` call it before Ray starts."""
    try:
        return check(config.model, config.trials.image, config.model_search_path)
    except UserError as e:
        raise UserError(f"{config.source}: {e}") from None


def code_to_ship(model: ModelConfig) -> list[str]:
    """The user's code the workers need: the top-level package (a folder) or module (a .py file) of the factory's
    module, unless it is raysweep's or installed (in site-packages or the standard library: every node installs
    those, as it installs torch). Call after `resolve` (the module is imported)."""
    if model.builtin:
        return []
    module_name, _ = target(model.factory)
    top = sys.modules.get(module_name.split(".")[0])
    if top is None:
        return []
    paths = list(getattr(top, "__path__", None) or [])  # a package: its folder (a namespace package may have several)
    file = getattr(top, "__file__", None)
    if not paths and file:
        paths = [file]
    elif paths and file:
        paths = [str(Path(file).parent)]
    return [p for p in (str(Path(p).resolve()) for p in paths) if not _installed(p)][:1]


def _installed(path: str) -> bool:
    import site
    import sysconfig

    roots = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    roots.update(site.getsitepackages() if hasattr(site, "getsitepackages") else [])
    roots.add(site.getusersitepackages())
    roots.add(str(Path(__file__).resolve().parent))  # raysweep itself
    return any(Path(path).is_relative_to(Path(r).resolve()) for r in roots if r)


def node_label(address: str, node_id: str) -> str:
    """A Ray node as a line names it: its address and the start of its id (one machine's raylets share an IP)."""
    return f"{address} (node {node_id[:8]})"


def resolve_on_worker(model: ModelConfig, address: str, node_id: str) -> None:
    """On a node of the cluster (a rank's set-up, usercode.check_on_nodes): the factory imports here too (its code
    shipped with the sweep: usercode.py), else a ModelCodeError naming the module and the node."""
    try:
        resolve(model.factory)
    except UserError as e:
        raise ModelCodeError(f"{e} [on node {node_label(address, node_id)}; it imported on the driver]") from None


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text[:300]}" if text else type(e).__name__

