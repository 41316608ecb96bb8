import torch

from raysweep.model import CaptchaCNN


def test_output_shape_and_flat_size_from_image_size():
    for h, w, flat in ((60, 160, 64 * 7 * 20), (24, 64, 64 * 3 * 8)):
        model = CaptchaCNN(h, w, length=4, num_classes=36, dropout=0.5)
        assert model.head[1].in_features == flat
        out = model(torch.rand(2, 1, h, w))
        assert out.shape == (2, 4 * 36)


def test_architecture_is_three_blocks_then_two_linears():
    model = CaptchaCNN(60, 160, 4, 36)
    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    assert [(c.in_channels, c.out_channels, c.kernel_size, c.padding) for c in convs] == [
        (1, 32, (3, 3), (1, 1)), (32, 64, (3, 3), (1, 1)), (64, 64, (3, 3), (1, 1))]
    block = [type(m).__name__ for m in model.features[0]]
    assert block == ["Conv2d", "BatchNorm2d", "Dropout", "ReLU", "MaxPool2d"]
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert [(lin.out_features) for lin in linears] == [1024, 4 * 36]
