import pytest
import torch

from raysweep.model import CaptchaCNN, keep_mask

from seed_loop import copy_weights, seed_model


def test_output_shape_and_flat_size_from_image_size():
    for h, w, flat in ((60, 160, 64 * 7 * 20), (24, 64, 64 * 3 * 8)):
        model = CaptchaCNN(h, w, length=4, num_classes=36, dropout=0.5)
        assert model.fc1.in_features == flat
        assert model(torch.rand(2, 1, h, w)).shape == (2, 4 * 36)


def test_architecture_is_three_blocks_then_two_linears():
    model = CaptchaCNN(60, 160, 4, 36)
    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    assert [(c.in_channels, c.out_channels, c.kernel_size, c.padding) for c in convs] == [
        (1, 32, (3, 3), (1, 1)), (32, 64, (3, 3), (1, 1)), (64, 64, (3, 3), (1, 1))]
    assert [(m.out_features) for m in model.modules() if isinstance(m, torch.nn.Linear)] == [1024, 4 * 36]
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in seed_model(60, 160, 4, 36).parameters())


def _pair(dropout, channels_last):
    torch.manual_seed(0)
    ours = CaptchaCNN(24, 64, 4, 36, dropout)
    seed = seed_model(24, 64, 4, 36, dropout)
    copy_weights(ours, seed)
    if channels_last:
        ours = ours.to(memory_format=torch.channels_last)
    return ours, seed


@pytest.mark.parametrize("channels_last", [False, True])
def test_same_function_and_gradients_as_the_seed_model_under_the_same_masks(channels_last):
    """Our fused dropout+ReLU (scale after the pool) equals nn.Dropout → nn.ReLU given the same masks."""
    ours, seed = _pair(0.5, channels_last)
    x = torch.rand(8, 1, 24, 64)
    masks = []  # our model draws its masks through keep_mask: record them, replay them in the seed's
    import raysweep.model as model_module

    real = model_module.keep_mask
    model_module.keep_mask = lambda t, p: (lambda k: (masks.append(k), k)[1])(real(t, p))
    try:
        out_ours = ours(x)
    finally:
        model_module.keep_mask = real
    replay = iter(masks)
    hooks = [m.register_forward_hook(lambda mod, a, o: o * next(replay).to(o.dtype) * 2.0)
             for m in seed if isinstance(m, torch.nn.Dropout)]
    for m in seed:
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0  # identity; the hook applies the recorded mask and the 1/(1-p) scale
    out_seed = seed(x)
    for h in hooks:
        h.remove()
    torch.testing.assert_close(out_ours, out_seed, rtol=1e-5, atol=1e-5)
    out_ours.square().mean().backward()
    out_seed.square().mean().backward()
    for a, b in zip(ours.parameters(), seed.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6)


def test_eval_mode_matches_the_seed_model_exactly():
    ours, seed = _pair(0.5, True)
    ours.eval(), seed.eval()
    x = torch.rand(4, 1, 24, 64)
    torch.testing.assert_close(ours(x), seed(x))


@pytest.mark.parametrize("p", [0.5, 0.1, 0.25])
def test_keep_mask_rate_and_layout(p):
    torch.manual_seed(1)
    x = torch.empty(64, 32, 30, 40).to(memory_format=torch.channels_last)
    keep = keep_mask(x, p)
    assert keep.shape == x.shape and keep.stride() == x.stride() and keep.dtype == torch.bool
    n = keep.numel()  # 2.5 M draws: 5 standard deviations is under 0.0016
    assert abs(keep.float().mean().item() - (1 - p)) < 5 * ((p * (1 - p) / n) ** 0.5)
    torch.manual_seed(1)
    assert torch.equal(keep_mask(x, p), keep)  # replays under the same seed


def test_keep_mask_bits_are_independent_between_neighbours():
    """p = 0.5 spreads each random bit to one element: neighbours, inside a byte and across bytes, are independent."""
    torch.manual_seed(2)
    keep = keep_mask(torch.empty(2_000_000), 0.5).float()
    n = keep.numel()
    for lag in (1, 7, 8, 64):  # same byte, byte boundary, next byte, next int64
        both = (keep[:-lag] * keep[lag:]).mean().item()
        assert abs(both - 0.25) < 5 * (0.25 * 0.75 / n) ** 0.5, lag
    assert keep_mask(torch.empty(3, 5, 7), 0.5).shape == (3, 5, 7)  # sizes that are not a multiple of 64


def test_nchw_weight_gradient_conv_matches_conv2d():
    """The block whose conv computes its weight gradient in NCHW gives nn.Conv2d's output and gradients."""
    from raysweep.model import _ConvWeightGradNCHW

    torch.manual_seed(3)
    conv = torch.nn.Conv2d(32, 64, 3, padding=1).to(memory_format=torch.channels_last)
    x = torch.randn(4, 32, 10, 12).contiguous(memory_format=torch.channels_last).requires_grad_()
    grad = torch.randn(4, 64, 10, 12).contiguous(memory_format=torch.channels_last)
    ours = _ConvWeightGradNCHW.apply(x, conv.weight, conv.bias)
    got = torch.autograd.grad(ours, (x, conv.weight, conv.bias), grad)
    want = torch.autograd.grad(conv(x), (x, conv.weight, conv.bias), grad)
    torch.testing.assert_close(ours, conv(x))
    # Both against float64: two fp32 kernels sum in different orders. On an AVX-512 CPU the NCHW weight
    # gradient was 8e-7 of its scale off the float64 one, PyTorch's channels_last kernel 2.4e-7; a wrong
    # index or a lost term would be off by a sizeable share of the scale.
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, conv.weight, conv.bias))
    exact = torch.autograd.grad(torch.nn.functional.conv2d(x64, w64, b64, padding=1), (x64, w64, b64), grad.double())
    for g, w, e in zip(got, want, exact, strict=True):
        bound = 1e-5 * float(e.abs().max())
        torch.testing.assert_close(g.double(), e, rtol=0, atol=bound)
        torch.testing.assert_close(w.double(), e, rtol=0, atol=bound)  # the bound PyTorch's own kernel meets
    assert got[1].is_contiguous(memory_format=torch.channels_last)  # like the weight, for the fused optimizer
    block = CaptchaCNN(24, 64, 4, 36).features[1]
    assert block.weight_grad_nchw and not CaptchaCNN(24, 64, 4, 36).features[0].weight_grad_nchw


@pytest.mark.parametrize("autocast", [False, True])
def test_one_channel_convolution_as_shifted_multiply_adds_is_conv2d(autocast):
    """What the compiled CUDA path runs for the first convolution: conv2d's values and gradients."""
    from raysweep.model import conv3x3_one_channel

    torch.manual_seed(0)
    conv = torch.nn.Conv2d(1, 32, 3, padding=1)
    x = torch.rand(4, 1, 24, 64)
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        ours, theirs = conv3x3_one_channel(x, conv.weight, conv.bias), conv(x)
    assert ours.dtype == theirs.dtype and ours.is_contiguous(memory_format=torch.channels_last)
    tol = dict(rtol=2e-2, atol=2e-2) if autocast else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours, theirs, **tol)
    grad = torch.rand_like(theirs)
    mine = torch.autograd.grad(ours, (conv.weight, conv.bias), grad)
    reference = torch.autograd.grad(theirs, (conv.weight, conv.bias), grad)
    for a, b in zip(mine, reference, strict=True):
        torch.testing.assert_close(a, b, **({"rtol": 5e-2, "atol": 5e-1} if autocast else {"rtol": 1e-4, "atol": 1e-4}))


def test_the_plain_path_computes_the_cpu_path_function():
    """CUDA's model path (plain ops) and the CPU's kernels: the same outputs and gradients (no dropout, fp32)."""
    outputs = {}
    for path in ("cpu", "plain"):
        torch.manual_seed(0)
        model = CaptchaCNN(24, 64, 4, 36, dropout=0.0, path=path).to(memory_format=torch.channels_last)
        out = model(torch.rand(8, 1, 24, 64, generator=torch.Generator().manual_seed(1)))
        out.square().mean().backward()
        outputs[path] = (out, [p.grad for p in model.parameters()])
    torch.testing.assert_close(outputs["plain"][0], outputs["cpu"][0], rtol=1e-5, atol=1e-6)
    for a, b in zip(outputs["plain"][1], outputs["cpu"][1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_random_bits_are_fair_independent_and_laid_out_like_their_tensor():
    from raysweep.model import random_bits_like

    torch.manual_seed(3)
    x = torch.empty(64, 32, 30, 40).to(memory_format=torch.channels_last)
    bits = random_bits_like(x)
    assert bits.shape == x.shape and bits.stride() == x.stride() and set(bits.unique().tolist()) == {0, 1}
    flat = random_bits_like(torch.empty(2_000_003)).double()
    n = flat.numel()
    assert abs(flat.mean().item() - 0.5) < 5 * (0.25 / n) ** 0.5
    for lag in (1, 15, 16, 17):  # inside one 16-bit draw, across draws
        both = (flat[:-lag] * flat[lag:]).mean().item()
        assert abs(both - 0.25) < 5 * (0.25 * 0.75 / n) ** 0.5, lag
