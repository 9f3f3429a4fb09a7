"""Full-rank AdamW: the baseline every other method is measured against."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from pydantic import Field

from harness.config import Strict
from harness.methods.base import Groups, MemoryEstimate, Method, Shapes, grad_bytes, numel, register

if TYPE_CHECKING:
    from harness.config import RunConfig
    from harness.config.steps import Steps


class AdamConfig(Strict):
    betas: tuple[float, float] = Field((0.9, 0.999), description="moment decay rates")
    eps: float = Field(1e-8, gt=0, description="added to the second moment's root")


def adam_bytes(weight_bytes: int, trainable: list[int], run: RunConfig,
               steps: Steps) -> MemoryEstimate:
    """AdamW's bytes: fp32 gradients, two fp32 moments and a float32 step per trained tensor."""
    n = sum(trainable)
    grads = grad_bytes(trainable, run, steps)
    return MemoryEstimate(weight_bytes, grads, 8 * n + 4 * len(trainable))


def adamw(groups: Groups, run: RunConfig, config: AdamConfig) -> torch.optim.Optimizer:
    """torch's fused AdamW (CPU and CUDA): the fastest baseline; bitsandbytes' paged AdamW
    (32-bit states) when the run asks for paged optimizer states."""
    common = {"lr": run.train.lr, "betas": config.betas, "eps": config.eps}
    if run.memory.optimizer_offload == "paged":
        import bitsandbytes as bnb

        return bnb.optim.PagedAdamW(groups, **common)
    return torch.optim.AdamW(groups, **common, fused=True)


@register("full")
class Full(Method):
    summary = "AdamW on every parameter (torch, fused kernel)"
    Config = AdamConfig

    def build_optimizer(self, groups: Groups, run: RunConfig) -> torch.optim.Optimizer:
        return adamw(groups, run, self.config)

    def estimate(self, shapes: Shapes, run: RunConfig) -> MemoryEstimate:
        sizes = [numel(s) for s in shapes.values()]
        # fp32 master weights (bf16 is autocast)
        return adam_bytes(4 * sum(sizes), sizes, run, self.steps)
