"""harness/modifiers/optimizer.py: the method's optimizer wrapped as the memory modifiers ask,
with the settings of each group kept, and unwrapped again for counting."""

from __future__ import annotations

import torch
from conftest import micro_run

from harness.methods.resolve import load_run
from harness.modifiers.layerwise import LayerwiseOptimizer
from harness.modifiers.offload import HostOffloadOptimizer
from harness.modifiers.optimizer import make_optimizer, unwrap


def groups():
    torch.manual_seed(0)
    matrix, vector = torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))
    return [{"params": [matrix], "weight_decay": 0.1}, {"params": [vector], "weight_decay": 0.0}]


def build(gs):
    return torch.optim.AdamW(gs, lr=0.01)


def run(**memory):
    return load_run({**micro_run(grad_clip=0.5), "memory": memory})


def test_no_modifier_is_the_methods_own_optimizer():
    optimizer = make_optimizer(groups(), build, run())
    assert type(optimizer) is torch.optim.AdamW and unwrap(optimizer) == [optimizer]
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]


def test_host_offload_wraps_the_method_optimizer():
    optimizer = make_optimizer(groups(), build, run(optimizer_offload="host"))
    assert isinstance(optimizer, HostOffloadOptimizer)
    assert unwrap(optimizer) == [optimizer.inner] and type(optimizer.inner) is torch.optim.AdamW
    assert [g["weight_decay"] for g in optimizer.inner.param_groups] == [0.1, 0.0]


def test_layerwise_builds_one_optimizer_per_parameter_with_its_groups_settings():
    gs = groups()
    optimizer = make_optimizer(gs, build, run(layerwise=True))
    assert isinstance(optimizer, LayerwiseOptimizer) and optimizer.clip == 0.5
    inner = unwrap(optimizer)
    assert len(inner) == 2 and all(type(o) is torch.optim.AdamW for o in inner)
    assert [o.param_groups[0]["weight_decay"] for o in inner] == [0.1, 0.0]
    assert [o.param_groups[0]["params"] for o in inner] == [gs[0]["params"], gs[1]["params"]]


def test_layerwise_with_host_offload_nests_both():
    optimizer = make_optimizer(groups(), build, run(layerwise=True, optimizer_offload="host"))
    assert isinstance(optimizer, LayerwiseOptimizer)
    assert all(isinstance(o, HostOffloadOptimizer) for o in optimizer.inner.values())
    inner = unwrap(optimizer)
    assert len(inner) == 2 and all(type(o) is torch.optim.AdamW for o in inner)
