"""harness/modifiers/precision.py: autocast over fp32 weights, fp16's loss scaling with skipped
overflow steps read in one go, clipping on unscaled gradients, and the scaler's state."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from harness.config import LossScaleConfig, TrainConfig
from harness.modifiers.precision import Precision

CPU = torch.device("cpu")


def sgd_param(value: list[float]) -> tuple[nn.Parameter, torch.optim.Optimizer]:
    p = nn.Parameter(torch.tensor(value))
    return p, torch.optim.SGD([p], lr=1.0)


def test_fp32_is_plain_backward_and_step():
    precision = Precision(TrainConfig(), CPU)
    assert precision.dtype is None and precision.scaler is None
    p, opt = sgd_param([1.0, 2.0])
    with precision.autocast():
        loss = (p * torch.tensor([3.0, 4.0])).sum()
    assert loss.dtype == torch.float32
    precision.backward(loss)
    assert p.grad.tolist() == [3.0, 4.0]
    precision.step(opt, [p], clip=None, step=1)
    assert p.tolist() == [-2.0, -2.0]
    assert precision.settle() == [] and precision.log() == {} and precision.state_dict() == {}


def test_clipping_scales_the_gradient_to_the_norm():
    precision = Precision(TrainConfig(), CPU)
    p, opt = sgd_param([0.0, 0.0])
    precision.backward((p * torch.tensor([3.0, 4.0])).sum())  # norm 5
    precision.step(opt, [p], clip=1.0, step=1)
    assert p.tolist() == pytest.approx([-0.6, -0.8], rel=1e-5)


@pytest.mark.parametrize(("name", "dtype"), [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_autocast_runs_linears_in_half_precision_over_fp32_weights(name, dtype):
    precision = Precision(TrainConfig(precision=name), CPU)
    linear = nn.Linear(8, 4)
    with precision.autocast():
        out = linear(torch.randn(2, 8))
    assert out.dtype == dtype and linear.weight.dtype == torch.float32
    assert linear(torch.randn(2, 8)).dtype == torch.float32  # outside the context


def fp16(**scale) -> Precision:
    config = TrainConfig(precision="fp16", loss_scale=LossScaleConfig(**scale))
    return Precision(config, CPU)


def test_fp16_scales_the_loss_and_steps_on_unscaled_gradients():
    precision = fp16(init=2.0**10, growth_interval=100)
    p, opt = sgd_param([1.0, 1.0])
    precision.backward((p * torch.tensor([0.5, -0.25])).sum())
    assert p.grad.tolist() == [512.0, -256.0]  # scaled by 2^10
    precision.step(opt, [p], clip=None, step=1)
    assert p.tolist() == [0.5, 1.25]  # the update saw the true gradient
    assert precision.settle() == [] and precision.skipped == 0
    assert precision.log() == {"loss_scale": 2.0**10, "skipped_steps": 0}


def test_an_overflow_skips_the_step_backs_off_and_is_read_later():
    precision = fp16(init=2.0**10, backoff_factor=0.25, growth_interval=100)
    p, opt = sgd_param([1.0, 1.0])
    for step in (1, 2, 3):
        precision.backward((p * torch.tensor([1.0, 1.0])).sum())
        if step != 3:
            p.grad[0] = float("inf")  # steps 1 and 2 overflow
        precision.step(opt, [p], clip=1.0, step=step)
        opt.zero_grad()
    assert len(precision.overflows) == 3  # nothing was read while stepping
    assert precision.settle() == [1, 2] and precision.skipped == 2
    assert precision.settle() == [] and precision.overflows == []
    assert precision.log() == {"loss_scale": 2.0**10 * 0.25**2, "skipped_steps": 2}
    norm = 2**0.5  # only step 3 moved p: the clipped unit-norm gradient
    assert p.tolist() == pytest.approx([1 - 1 / norm, 1 - 1 / norm], rel=1e-5)


def test_the_scale_grows_after_the_interval_and_its_state_round_trips():
    precision = fp16(init=4.0, growth_factor=2.0, growth_interval=2)
    p, opt = sgd_param([1.0])
    for step in (1, 2, 3):
        precision.backward(p.sum())
        precision.step(opt, [p], clip=None, step=step)
        opt.zero_grad()
    precision.settle()
    assert precision.log()["loss_scale"] == 8.0
    state = precision.state_dict()
    again = fp16(init=4.0, growth_factor=2.0, growth_interval=2)
    again.load_state_dict(state)
    assert again.log() == precision.log()
    again.backward(p.sum())
    again.step(opt, [p], clip=None, step=4)  # the fourth clean step: the count was restored
    assert again.log()["loss_scale"] == 16.0
    plain = Precision(TrainConfig(), CPU)
    plain.load_state_dict(state)  # a run without fp16 ignores a scaler's state
    assert plain.log() == {}
