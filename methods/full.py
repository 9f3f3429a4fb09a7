"""Full-rank AdamW: the baseline every other method is measured against."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from pydantic import Field
from torch import nn

from harness.config import Strict
from harness.methods.base import MemoryEstimate, Method, Shapes, decay_groups, numel, register

if TYPE_CHECKING:
    from harness.config import RunConfig


class AdamConfig(Strict):
    betas: tuple[float, float] = Field((0.9, 0.999), description="moment decay rates")
    eps: float = Field(1e-8, gt=0, description="added to the second moment's root")


def adamw(model: nn.Module, run: RunConfig, config: AdamConfig) -> torch.optim.Optimizer:
    """torch's fused AdamW (CPU and CUDA) over the trainable parameters: the fastest baseline."""
    return torch.optim.AdamW(
        decay_groups(model, run.train.weight_decay),
        lr=run.train.lr,
        betas=config.betas,
        eps=config.eps,
        fused=True,
    )


@register("full")
class Full(Method):
    summary = "AdamW on every parameter (torch, fused kernel)"
    Config = AdamConfig

    def optimizer(self, model: nn.Module, run: RunConfig) -> torch.optim.Optimizer:
        return adamw(model, run, self.config)

    def estimate(self, shapes: Shapes, run: RunConfig) -> MemoryEstimate:
        n = sum(numel(s) for s in shapes.values())
        # fp32 master weights and grads (bf16 is autocast); two fp32 moments and a step each.
        return MemoryEstimate(4 * n, 4 * n, 8 * n + 4 * len(shapes))
