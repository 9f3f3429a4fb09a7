"""Low-rank weights W = B·A, trained from scratch: the GaLore paper's Low-rank baseline (Table 2).

Each target linear's full-rank weight is replaced by two trained factors, A (r × in) and
B (out × r), so a matrix costs (m + n)·r parameters, gradients and Adam moments instead of
m·n (GaLore Table 1). Unlike LoRA there is no frozen W behind the factors: the model can only
ever express rank-r maps in those layers, which is why the paper's low-rank runs trail
full-rank pretraining.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from harness.errors import UserError
from harness.methods.base import register
from harness.methods.full import AdamConfig, Full
from harness.methods.surgery import TARGETS, replace_linears, target_linears

if TYPE_CHECKING:
    from harness.config import RunConfig


class LowRankConfig(AdamConfig):
    rank: int = Field(128, ge=1, description="rank r of W = B·A in each target linear")
    target_modules: list[str] = Field(
        list(TARGETS),  # pydantic copies it for each config
        min_length=1,
        description="linears (by last name component) factored into B·A",
    )


class LowRankLinear(nn.Module):
    """x ↦ (x Aᵀ) Bᵀ (+ bias): a rank-r linear with no full-rank weight behind it.

    Factors are Gaussian with equal std s, s² = σ/√r, so that Var((BA)ᵢⱼ) = r·s⁴ = σ², the
    variance of the full-rank init it replaces: activations keep the scale the base model was
    designed for, and both factors get gradient from step 1 (a zero B would stall A's first
    step). A truncated SVD of the random init would cost an SVD per matrix and keep only part
    of its norm (a Gaussian matrix's spectrum is flat), shrinking activations at every layer.
    """

    def __init__(self, linear: nn.Linear, rank: int, std: float) -> None:
        super().__init__()
        w = linear.weight
        s = math.sqrt(std / math.sqrt(rank))
        kw = {"device": w.device, "dtype": w.dtype}
        self.A = nn.Parameter(torch.randn(rank, linear.in_features, **kw) * s)
        self.B = nn.Parameter(torch.randn(linear.out_features, rank, **kw) * s)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(x, self.A), self.B, self.bias)

    def extra_repr(self) -> str:
        rank, in_features = self.A.shape
        return f"in_features={in_features}, out_features={self.B.shape[0]}, rank={rank}"


@register("lowrank")
class LowRank(Full):
    summary = "W = B·A of rank r in attention/MLP linears, trained from scratch with AdamW"
    Config = LowRankConfig

    def prepare(self, model: nn.Module, run: RunConfig) -> nn.Module:
        std = getattr(getattr(model, "config", None), "initializer_range", 0.02)
        targets = target_linears(model, self.config.target_modules)
        check_found(self.config, {name.rsplit(".", 1)[-1] for name, _ in targets})
        for name, linear in targets:
            model.set_submodule(name, LowRankLinear(linear, self.config.rank, std))
        return model

    def export(self, model: nn.Module) -> nn.Module:
        """Each factored linear as the full-rank one it stands for: W = B·A."""
        return replace_linears(model, LowRankLinear, lambda m: m.B @ m.A)


def check_found(config: LowRankConfig, found: set[str]) -> None:
    """Refuse target names that no linear of the model has: nothing would be factored."""
    missing = sorted(set(config.target_modules) - found)
    if missing:
        raise UserError(f"method.target_modules: no linear named {', '.join(missing)} in the model")
