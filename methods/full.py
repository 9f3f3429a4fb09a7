"""Full-rank AdamW: the baseline every other method is measured against."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from pydantic import Field

from harness.config import Strict
from harness.config.tuning import tunable
from harness.methods.base import Groups, Method, Terms, register
from harness.modifiers.compensation import pure_adamw
from harness.modifiers.offload import repaged_on_load

if TYPE_CHECKING:
    from harness.config import RunConfig


class AdamConfig(Strict):
    betas: tuple[float, float] = tunable(
        (0.9, 0.999), values=[(0.9, 0.95), (0.9, 0.98), (0.9, 0.999)],
        source="β2 as the 2025 studies tune AdamW's: arXiv 2509.02046, 2509.01440",
        description="moment decay rates")
    eps: float = Field(1e-8, gt=0, description="added to the second moment's root")


def adamw(groups: Groups, run: RunConfig, config: AdamConfig) -> torch.optim.Optimizer:
    """torch's fused AdamW (CPU and CUDA): the fastest baseline; bitsandbytes' paged AdamW
    (32-bit states) when the run asks for paged optimizer states; under bf16-true, the AdamW
    that honours train.state_dtype and train.update_compensation (modifiers/compensation.py)."""
    if run.train.precision == "bf16-true":
        return pure_adamw(groups, run.train, config.betas, config.eps)
    common = {"lr": run.train.lr, "betas": config.betas, "eps": config.eps}
    if run.memory.optimizer_offload == "paged":
        import bitsandbytes as bnb

        return repaged_on_load(bnb.optim.PagedAdamW(groups, **common))
    return torch.optim.AdamW(groups, **common, fused=True)


@register("full")
class Full(Method):
    summary = "AdamW on every parameter (torch, fused kernel)"
    Config = AdamConfig

    def check(self, run: RunConfig) -> Terms:
        return Terms(fsdp=None)  # torch's AdamW steps each rank's shard: elementwise

    def optimizer(self, groups: Groups, run: RunConfig) -> torch.optim.Optimizer:
        return adamw(groups, run, self.config)
