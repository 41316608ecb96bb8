"""The captcha CNN: 3 conv blocks, then two linear layers, one logit per (position, character).

Each block is Conv 3×3 → BatchNorm → Dropout → ReLU → MaxPool 2, as in the original model (ReLU and
dropout commute: relu(m·a) = m·relu(a) for a 0/1 mask m). Two paths compute that same function:

- **CUDA** (and any device but the CPU): plain ops (`relu`, `dropout`, `max_pool2d`) that Inductor fuses into
  BatchNorm's passes when the step is compiled (the default there). Under `torch.compile` a p = 0.5 mask is one
  random bit per element, spread by shifts that fuse into the same kernel, and the first convolution (one input
  channel) is nine shifted multiply-adds that Inductor fuses too: cuDNN ran it as a generic kernel and converted
  its tensors between NCHW and NHWC twice a step. The CPU tricks below are custom
  autograd functions and byte views that Inductor cannot lower on CUDA (`torch.bool is not supported by
  torch.iinfo`), and bought nothing there eagerly (40.0 k vs 41.2 k images/s, benchmarks/RESULTS.md).
- **CPU** (eager; benchmarks/loop_vs_seed.py measures each part):
  - dropout masks are drawn as random bits, not with `bernoulli_` (which took 38 % of a CPU step);
  - dropout and ReLU are one in-place pass over BatchNorm's output, whose backward does not need it,
    and one `threshold_backward` pass back (ReLU's own kernel: the output is 0 wherever either cut);
  - the 1/(1−p) dropout scale is applied after max-pooling, on 4× fewer values: for s > 0,
    maxpool(s·a) = s·maxpool(a), with the same argmax, so values and gradients are unchanged;
  - the second conv's weight gradient is computed in NCHW (the rest stays channels_last).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

_BIT_TABLES: dict[torch.device, torch.Tensor] = {}


def _bit_table(device: torch.device) -> torch.Tensor:
    """256 int64s: entry b holds the 8 bits of b, one per byte, as 0/1 (little-endian: bit k → byte k)."""
    if device not in _BIT_TABLES:
        bits = [[(b >> k) & 1 for k in range(8)] for b in range(256)]
        _BIT_TABLES[device] = torch.tensor(bits, dtype=torch.uint8).view(torch.int64).view(256).to(device)
    return _BIT_TABLES[device]


def keep_mask(x: torch.Tensor, p: float) -> torch.Tensor:
    """Bernoulli(1 − p) keep mask shaped (and laid out) like `x`, from uniform random bits.

    p = 0.5 (the model's default): one random bit per element, spread to one 0/1 byte each by a
    256-entry table lookup: 38 ms for 157 M elements here, against 290-550 ms for a random byte
    per element and a compare (and 796 ms for `bernoulli_`). Other p: exact when 256·p is a whole
    number (keep iff a byte < 256·(1 − p)); otherwise 16-bit thresholds, p to within 1/65536.
    Draws from torch's generator, so `torch.manual_seed` replays it.
    """
    n = x.numel()
    if p == 0.5:
        # the full int64 range: random_() alone leaves every 64th bit at 0
        raw = torch.empty((n + 63) // 64, dtype=torch.int64, device=x.device).random_(-(2**63), None)
        keep = torch.index_select(_bit_table(x.device), 0, raw.view(torch.uint8).int()).view(torch.uint8)[:n]
        keep = keep.view(torch.bool)  # the bytes are 0 or 1: a valid bool
    else:
        byte = (256 * p).is_integer()  # novermin: float.is_integer (vermin reads int's, 3.12)
        width = 1 if byte else 2
        raw = torch.empty((n * width + 7) // 8, dtype=torch.int64, device=x.device).random_(-(2**63), None)
        if byte:
            keep = raw.view(torch.uint8)[:n] < round(256 * (1 - p))
        else:
            keep = raw.view(torch.int16)[:n] < round(65536 * (1 - p)) - 32768
    return _like(keep, x)


class _MaskedReLU(torch.autograd.Function):
    """relu(x) with the dropped entries zeroed, in place on x; backward needs only the output."""

    @staticmethod
    def forward(ctx, x, keep):
        # × the mask's 0/1 bytes (a free view of the bool): 5× faster than masked_fill_ here, and
        # unlike a bool operand it makes no float copy of the mask
        x.mul_(keep.view(torch.uint8)).clamp_min_(0.0)
        ctx.mark_dirty(x)
        ctx.save_for_backward(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        # out == 0 exactly where the mask dropped or ReLU cut: one fused pass
        return torch.ops.aten.threshold_backward(grad, out, 0), None


def dropout_relu_(x: torch.Tensor, p: float) -> torch.Tensor:
    """relu(dropout(x)) without the 1/(1−p) scale (the caller applies it); overwrites x."""
    return _MaskedReLU.apply(x, keep_mask(x, p))


def random_bits_like(x: torch.Tensor) -> torch.Tensor:
    """0/1 int32s shaped (and laid out) like `x`: one uniform random bit per element, 16 bits per draw.

    Written in ops Inductor fuses: `randint` draws n/16 words (a sixteenth of the RNG work of one draw per
    element), and the shift-and-mask that spreads their bits is index arithmetic inside the consumer's kernel.
    """
    n = x.numel()
    words = torch.randint(0, 2**16, ((n + 15) // 16, 1), dtype=torch.int32, device=x.device)
    shifts = torch.arange(16, dtype=torch.int32, device=x.device)
    bits = ((words >> shifts) & 1).flatten()[:n]
    return _like(bits, x)


def _like(flat: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """`flat` (x.numel() values in x's memory order) viewed with x's shape and layout."""
    if x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last):
        n, c, h, w = x.shape
        return flat.view(n, h, w, c).permute(0, 3, 1, 2)  # same memory order as x: a streaming pass
    return flat.view(x.shape)


def conv3x3_one_channel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """`conv2d(x, weight, bias, padding=1)` for one input channel, as nine shifted multiply-adds (for Inductor to
    fuse; eagerly it would be nine passes). Under autocast the output has autocast's dtype, as the convolution's
    would; laid out NHWC, as cuDNN's was."""
    h, w = x.shape[-2:]
    padded = F.pad(x, (1, 1, 1, 1))
    out = bias.view(1, -1, 1, 1)
    for dh in range(3):
        for dw in range(3):
            out = out + padded[:, :, dh:dh + h, dw:dw + w] * weight[:, :, dh, dw].view(1, -1, 1, 1)
    if torch.is_autocast_enabled(x.device.type):
        out = out.to(torch.get_autocast_dtype(x.device.type))
    return out.contiguous(memory_format=torch.channels_last)


def plain_dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Dropout for the CUDA path: `F.dropout` (one fused kernel) when eager; when compiled at p = 0.5, the keep
    mask from `random_bits_like`, which Inductor fuses with the BatchNorm, ReLU and pooling around it."""
    if not training or p == 0:
        return x
    if p == 0.5 and torch.compiler.is_compiling():
        return x * random_bits_like(x).to(x.dtype) * 2.0
    return F.dropout(x, p, training=True)


class _ConvWeightGradNCHW(torch.autograd.Function):
    """conv2d(x, w, b, padding=1), with its weight gradient computed on NCHW copies of x and the gradient.

    oneDNN's channels_last weight-gradient kernel ran at half its NCHW speed on this project's AVX2
    CPU for the 32→64-channel conv at 30×80: 764 ms against 555 ms with both conversions included
    (batch 512, medians of 5), and the whole step 128 → 149 images/s (medians of 3; the 64→64 conv
    gained nothing, the 1→32 conv has no layout to change). Forward and input gradient stay
    channels_last, where they are fastest.
    """

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        return nn.functional.conv2d(x, weight, bias, padding=1)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        args = ([weight.shape[0]], [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.ops.aten.convolution_backward(grad, x, weight, *args, [True, False, False])[0]
        _, grad_w, grad_b = torch.ops.aten.convolution_backward(
            grad.contiguous(), x.contiguous(), weight.contiguous(), *args, [False, True, True])
        return grad_x, grad_w.contiguous(memory_format=_memory_format(weight)), grad_b


def _memory_format(t: torch.Tensor) -> torch.memory_format:
    return torch.contiguous_format if t.is_contiguous() else torch.channels_last


PATHS = ("cpu", "plain")  # CaptchaCNN(path=...): the CPU's kernels, or the plain ops (CUDA; None: by device)


def _use_cpu_path(path: str | None, x: torch.Tensor) -> bool:
    return path == "cpu" if path is not None else x.device.type == "cpu"


class ConvBlock(nn.Module):
    """Conv 3×3 pad 1 → BatchNorm → Dropout(p) → ReLU → MaxPool 2."""

    def __init__(self, in_channels: int, out_channels: int, dropout: float, weight_grad_nchw: bool = False,
                 path: str | None = None):
        super().__init__()
        self.path = path
        self.weight_grad_nchw = weight_grad_nchw  # CPU fp32 only: see _ConvWeightGradNCHW
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1)
        self.bn = nn.BatchNorm2d(out_channels)
        self.dropout = dropout
        self.pool = nn.MaxPool2d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not _use_cpu_path(self.path, x):  # the plain ops Inductor fuses (module docstring)
            conv = self.conv
            if conv.in_channels == 1 and torch.compiler.is_compiling():
                x = conv3x3_one_channel(x, conv.weight, conv.bias)
            else:
                x = conv(x)
            return self.pool(plain_dropout(torch.relu(self.bn(x)), self.dropout, self.training))
        conv = self.conv
        if (self.weight_grad_nchw and x.dtype == torch.float32 and torch.is_grad_enabled()
                and not x.is_contiguous() and not torch.is_autocast_enabled("cpu")):  # channels_last
            x = self.bn(_ConvWeightGradNCHW.apply(x, conv.weight, conv.bias))
        else:
            x = self.bn(conv(x))
        if not self.training or self.dropout == 0:
            return self.pool(torch.relu(x))
        # BatchNorm's backward reads its input, never its output, so the output may be overwritten
        return self.pool(dropout_relu_(x, self.dropout)).mul_(1.0 / (1.0 - self.dropout))


class CaptchaCNN(nn.Module):
    """Input (B, channels, H, W) floats in [0, 1]; output (B, length × num_classes) logits.

    `path`: "cpu" (the CPU's kernels) or "plain" (the ops Inductor fuses: CUDA's); None picks by the input's
    device. Both compute the same function; tests run the plain path on the CPU too."""

    def __init__(self, height: int, width: int, length: int, num_classes: int, dropout: float = 0.5,
                 path: str | None = None, channels: int = 1):
        super().__init__()
        if path not in (None, *PATHS):
            raise ValueError(f"path {path!r}: expected one of {PATHS} or None")
        self.length, self.num_classes, self.dropout, self.path = length, num_classes, dropout, path
        self.features = nn.Sequential(ConvBlock(channels, 32, dropout, path=path),
                                      ConvBlock(32, 64, dropout, weight_grad_nchw=True, path=path),
                                      ConvBlock(64, 64, dropout, path=path))
        # three 2× pools, each flooring: 60×160 → 30×80 → 15×40 → 7×20
        self.fc1 = nn.Linear(64 * (height // 8) * (width // 8), 1024)
        self.fc2 = nn.Linear(1024, length * num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(self.features(x).flatten(1))
        if not _use_cpu_path(self.path, h):
            h = plain_dropout(torch.relu(h), self.dropout, self.training)
        elif self.training and self.dropout > 0:
            h = dropout_relu_(h, self.dropout) * (1.0 / (1.0 - self.dropout))  # h is saved: scale out of place
        else:
            h = torch.relu(h)
        return self.fc2(h)


def captcha_cnn(image, dropout: float = 0.5, path: str | None = None) -> CaptchaCNN:
    """raysweep's CNN for images of `image` (config.ImageSpec), channels_last: the built-in model, and the first
    implementation of the model contract (raysweep/models.py). `model.dropout` is its `dropout`.

    NHWC is oneDNN's and cuDNN's fast conv layout (1.3× on the CPU step here, benchmarks/RESULTS.md).
    """
    model = CaptchaCNN(image.height, image.width, image.length, image.num_classes, dropout, path,
                       image.channels)
    return model.to(memory_format=torch.channels_last)
