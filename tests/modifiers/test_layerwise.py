"""harness/modifiers/layerwise.py: each parameter steps inside backward and drops its gradient,
only when the gradient is complete, clipped on its own; the schedule drives the inner groups."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from harness.modifiers.layerwise import LayerwiseOptimizer


def params(seed: int = 0) -> list[nn.Parameter]:
    torch.manual_seed(seed)
    return [nn.Parameter(torch.randn(5, 3)), nn.Parameter(torch.randn(3))]


def loss(ps: list[nn.Parameter], k: float = 1.0) -> torch.Tensor:
    return sum(((p * k).sin() * (i + 1)).sum() for i, p in enumerate(ps))


def adamw(p: nn.Parameter) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p], lr=0.05)


def test_updates_run_in_backward_and_match_the_plain_optimizer():
    ref, ours = params(), params()
    plain = torch.optim.AdamW(ref, lr=0.05)
    layerwise = LayerwiseOptimizer(ours, adamw, clip=None)
    for _ in range(3):
        loss(ref).backward()
        plain.step()
        plain.zero_grad()
        before = [p.detach().clone() for p in ours]
        loss(ours).backward()  # the update happens here
        assert all(p.grad is None for p in ours)  # freed at once
        assert all(not torch.equal(p, b) for p, b in zip(ours, before, strict=True))
        layerwise.step()  # nothing left to do
        layerwise.zero_grad()
    assert all(torch.allclose(a, b, atol=1e-7) for a, b in zip(ref, ours, strict=True))
    assert len(layerwise.state) == 2 and all(s["step"] == 3 for s in layerwise.state.values())


def test_accumulation_waits_for_the_last_micro_batch():
    ref, ours = params(), params()
    plain = torch.optim.AdamW(ref, lr=0.05)
    layerwise = LayerwiseOptimizer(ours, adamw, clip=None)
    for k in (1.0, 2.0):
        loss(ref, k).backward()
    plain.step()
    layerwise.sync = False
    loss(ours, 1.0).backward()
    assert all(p.grad is not None for p in ours)  # kept to accumulate, nothing stepped
    layerwise.sync = True
    loss(ours, 2.0).backward()
    assert all(p.grad is None for p in ours)
    assert all(torch.allclose(a, b, atol=1e-7) for a, b in zip(ref, ours, strict=True))


def test_each_gradient_is_clipped_on_its_own():
    a, b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    layerwise = LayerwiseOptimizer([a, b], lambda p: torch.optim.SGD([p], lr=1.0), clip=1.0)
    ((a * torch.tensor([3.0, 4.0])).sum() + (b * torch.tensor([0.3, 0.4])).sum()).backward()
    assert a.tolist() == pytest.approx([-0.6, -0.8], rel=1e-5)  # norm 5, clipped to 1
    assert b.tolist() == pytest.approx([-0.3, -0.4], rel=1e-6)  # norm 0.5, untouched
    assert layerwise.clip == 1.0


def test_param_groups_are_the_inner_ones_and_state_round_trips():
    ours = params()
    layerwise = LayerwiseOptimizer(ours, adamw, clip=None)
    groups = layerwise.param_groups
    assert len(groups) == 2 and [g["params"] for g in groups] == [[ours[0]], [ours[1]]]
    for g in groups:
        g["lr"] = 0.0  # as the LR scheduler sets it: it reaches every inner optimizer
    before = [p.detach().clone() for p in ours]
    loss(ours).backward()
    assert all(torch.equal(p, b) for p, b in zip(ours, before, strict=True))
    saved = layerwise.state_dict()
    assert len(saved["inner"]) == 2
    other = params(seed=1)
    again = LayerwiseOptimizer(other, adamw, clip=None)
    again.load_state_dict(saved)
    assert [g["lr"] for g in again.param_groups] == [0.0, 0.0]
    assert all(int(s["step"]) == 1 for s in again.state.values())


def test_a_dropped_optimizer_and_its_parameters_are_freed():
    """The hooks sit on the parameters' C++ side, out of the cycle collector's sight: a hook
    holding the optimizer strongly kept it, its states and every parameter alive for good."""
    import gc
    import weakref

    ps = params()
    opt = LayerwiseOptimizer(ps, adamw, clip=None)
    loss(ps).backward()
    refs = [weakref.ref(opt), *(weakref.ref(p) for p in ps)]
    del ps, opt
    gc.collect()
    assert [r() for r in refs] == [None] * len(refs)
