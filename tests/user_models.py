"""Models of a user's own, as factories (raysweep/models.py's contract), for the tests: ones that train, and the
mistakes the check before Ray must name in one line. Named in specs as "user_models:<factory>" (tests/ is on the
path of the test process; a sweep ships this file to its workers like any user's module)."""

from __future__ import annotations

import torch
from torch import nn


class TinyNet(nn.Module):
    """conv → ReLU → pool → linear: the smallest model of the contract, (N, length, classes) logits."""

    def __init__(self, image, hidden: int = 8):
        super().__init__()
        self.length, self.classes = image.length, image.num_classes
        self.conv = nn.Conv2d(image.channels, hidden, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d((2, 2 * image.length))
        self.fc = nn.Linear(hidden * 4 * image.length, image.length * image.num_classes)

    def forward(self, x):
        h = self.pool(torch.relu(self.conv(x))).flatten(1)
        return self.fc(h).reshape(-1, self.length, self.classes)


def tiny(image, hidden: int = 8):
    return TinyNet(image, hidden)


def _twice(x: torch.Tensor) -> torch.Tensor:
    """A custom op with no fake (meta) implementation: eager runs it, torch.compile cannot trace it (Dynamo raises
    "There was no fake impl registered"), as with a user's own C++/CUDA op."""
    return x * 2


# Defined once per process. tests/test_models.py imports this file afresh, and a second torch.library.custom_op of the
# same name replaces the first (get_library_allowing_overwrite in torch/_library/custom_ops.py): the registration the
# earlier import's models and Dynamo's caches were made with is destroyed. Suspected, not shown, of what crashed the
# test process now and then while Dynamo or eager called the op in test_slot_memory.py's compile-failed case (a
# segfault, std::bad_alloc, "schema_.has_value() INTERNAL ASSERT FAILED"), only after test_models.py in one process.
if hasattr(torch.ops.raysweep_tests, "twice"):
    twice = torch.ops.raysweep_tests.twice
else:
    twice = torch.library.custom_op("raysweep_tests::twice", _twice, mutates_args=())
    twice.register_autograd(lambda ctx, grad: grad * 2)


class Uncompilable(TinyNet):
    def forward(self, x):
        return twice(super().forward(x))


def uncompilable(image):
    return Uncompilable(image)


class HostSyncing(TinyNet):
    """Reads a value back to the host in its forward (`.item()`): it trains, compiles (Dynamo breaks the graph
    there), and cannot be captured as a CUDA graph."""

    def forward(self, x):
        scale = 1.0 + 0.0 * float(x.mean().item())
        return super().forward(x) * scale


def host_syncing(image):
    return HostSyncing(image)


class WithUnused(TinyNet):
    def __init__(self, image):
        super().__init__(image)
        self.spare = nn.Linear(4, 4)  # never called: no gradient, and DDP refuses that on its second step


def with_unused(image):
    return WithUnused(image)


class LazyNet(nn.Module):
    """Its sizes are PyTorch's to infer: lazy layers (nn.LazyConv2d, nn.LazyBatchNorm2d, nn.LazyLinear) hold
    uninitialized parameters until the first forward, and DDP, optimizers and `numel` refuse those
    (torch/nn/modules/lazy.py)."""

    def __init__(self, image, hidden: int = 8):
        super().__init__()
        self.length, self.classes = image.length, image.num_classes
        self.body = nn.Sequential(nn.LazyConv2d(hidden, 3, padding=1), nn.LazyBatchNorm2d(), nn.ReLU(),
                                  nn.AdaptiveAvgPool2d((2, 2 * image.length)), nn.Flatten(),
                                  nn.LazyLinear(image.length * image.num_classes))

    def forward(self, x):
        return self.body(x).reshape(-1, self.length, self.classes)


def lazy(image, hidden: int = 8):
    return LazyNet(image, hidden)


def returns_a_list(image):
    return [TinyNet(image)]


def raises(image, depth: int = 3):
    raise ValueError(f"depth {depth} is too deep for {image.height}-pixel images")


def wrong_shape(image):
    class Flat(TinyNet):
        def forward(self, x):
            return super().forward(x)[:, :-1]  # one position short

    return Flat(image)


def frozen(image):
    return TinyNet(image).requires_grad_(False)


def breaks_in_forward(image):
    class Broken(TinyNet):
        def forward(self, x):
            return x.reshape(x.shape[0], -1) @ torch.ones(3)  # a matmul of the wrong size

    return Broken(image)


NOT_A_FUNCTION = 3
