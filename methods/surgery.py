"""Module surgery the methods share: which linears a method targets, and swapping linears for
a method's own modules and back (an export's plain nn.Linear)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection
from typing import Any

import torch
from torch import nn

# The papers' targets for adapters, factors and projections: every attention and MLP linear.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def is_target(module: str, targets: Collection[str], anywhere: bool = False) -> bool:
    """Whether the linear named `module` is one of `targets`: by its last name component (peft's
    rule, which LoRA, QLoRA, ReLoRA and low-rank follow) or, `anywhere`, by any component
    (GaLore's and Q-GaLore's: `intermediate` selects intermediate.dense)."""
    return _is_target(module, tuple(targets), anywhere)


@functools.lru_cache(maxsize=65536)  # `harness plan` asks for each of a model's names per layout
def _is_target(module: str, targets: tuple[str, ...], anywhere: bool) -> bool:
    parts = module.split(".")
    return any(p in targets for p in parts) if anywhere else parts[-1] in targets


def target_matrix(name: str, shape: tuple[int, ...], targets: Collection[str]) -> bool:
    """Whether the parameter `name` is a 2-D weight of a target linear by any name component
    (GaLore's rule, and the methods built on it)."""
    return len(shape) == 2 and is_target(name.rpartition(".")[0], targets, anywhere=True)


def target_linears(model: nn.Module, targets: Collection[str],
                   anywhere: bool = False) -> list[tuple[str, nn.Linear]]:
    """The model's nn.Linear modules that `is_target`, with their names, in module order."""
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and is_target(name, targets, anywhere)]


def replace_linears(model: nn.Module, kind: type[nn.Module],
                    weight_of: Callable[[Any], torch.Tensor]) -> nn.Module:
    """Each `kind` module of `model` replaced by an nn.Linear holding `weight_of(module)`
    (out × in) and the module's bias: how an export turns a method's own linears back into the
    base model's."""
    for name, module in list(model.named_modules()):
        if isinstance(module, kind):
            model.set_submodule(name, plain_linear(weight_of(module), module.bias))
    return model


def plain_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """An nn.Linear holding copies of `weight` (out × in) and `bias`."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(weight.detach().clone())
    if bias is not None:
        linear.bias = nn.Parameter(bias.detach().clone())
    return linear
