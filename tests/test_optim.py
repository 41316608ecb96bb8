import math

import pytest
import torch

from raysweep.model import CaptchaCNN
from raysweep.optim import build_optimizer, build_scheduler, lr_at, param_groups, scaled_lr

PEAK, FLOOR, W, T = 1e-3, 1e-5, 10, 110


def test_scaled_lr_rules():
    assert scaled_lr(2e-4, 3072, 256, "sqrt") == pytest.approx(2e-4 * math.sqrt(12))
    assert scaled_lr(2e-4, 3072, 256, "linear") == pytest.approx(2.4e-3)
    assert scaled_lr(2e-4, 3072, 256, "none") == 2e-4
    assert scaled_lr(1e-3, 256, 256, "sqrt") == 1e-3


def test_schedule_points_against_the_formula():
    assert lr_at(0, PEAK, FLOOR, W, T) == pytest.approx(PEAK / W)  # first step already moves
    assert lr_at(W - 1, PEAK, FLOOR, W, T) == pytest.approx(PEAK)  # end of warmup: peak
    assert lr_at(W, PEAK, FLOOR, W, T) == pytest.approx(PEAK)  # cosine starts at peak
    mid = W + (T - W) // 2
    assert lr_at(mid, PEAK, FLOOR, W, T) == pytest.approx(FLOOR + (PEAK - FLOOR) / 2)
    last = T - 1
    expected = FLOOR + (PEAK - FLOOR) * 0.5 * (1 + math.cos(math.pi * (last - W) / (T - W)))
    assert lr_at(last, PEAK, FLOOR, W, T) == pytest.approx(expected)
    assert lr_at(T, PEAK, FLOOR, W, T) == FLOOR and lr_at(T + 50, PEAK, FLOOR, W, T) == FLOOR


def test_no_warmup_starts_at_peak():
    assert lr_at(0, PEAK, FLOOR, 0, T) == pytest.approx(PEAK)


def test_floor_never_above_peak():
    assert lr_at(T, 1e-7, 1e-6, 0, T) == 1e-7


def test_torch_scheduler_follows_lr_at_every_step():
    model = torch.nn.Linear(4, 2)
    opt = build_optimizer(model, PEAK, 0.01, "cpu")
    sched = build_scheduler(opt, PEAK, FLOOR, W, T)
    seen = []
    for _ in range(T + 3):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([lr_at(s, PEAK, FLOOR, W, T) for s in range(T + 3)], rel=1e-9)


def test_scheduler_state_round_trips_with_weights_only(tmp_path):
    model = torch.nn.Linear(4, 2)
    opt = build_optimizer(model, PEAK, 0.01, "cpu")
    sched = build_scheduler(opt, PEAK, FLOOR, W, T)
    for _ in range(7):
        opt.step()
        sched.step()
    torch.save({"s": sched.state_dict(), "o": opt.state_dict()}, tmp_path / "x.pt")
    state = torch.load(tmp_path / "x.pt", weights_only=True)
    sched2 = build_scheduler(build_optimizer(model, PEAK, 0.01, "cpu"), PEAK, FLOOR, W, T)
    sched2.load_state_dict(state["s"])
    assert sched2.last_epoch == 7 and sched2.get_last_lr() == sched.get_last_lr()


def test_no_weight_decay_on_biases_and_norm_weights():
    model = CaptchaCNN(24, 64, 4, 36)
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"])
    bn = model.features[0].bn
    ids = {id(p) for p in no_decay["params"]}
    assert id(bn.weight) in ids and id(bn.bias) in ids and id(model.fc1.bias) in ids
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
