"""Fira (Chen et al., 2024): GaLore's low-rank Adam plus the gradient's residual outside the
subspace, scaled like the low-rank update, so every weight trains at full rank while the
moments stay low-rank.

For a projected m×n weight with gradient G and basis P (left; GQᵀ on the right): R = PᵀG, the
low-rank Adam update N = Adam(R) (GaLore's moments, methods/galore_optim.py), the norm-based
scaling φ = ‖N‖/(‖R‖ + 1e-8) per column of the full-size dimension (the norms run over the
rank dimension, as the reference's `norm_dim`), the residual S = φ ⊙ (G − α·PR), and
W ← W − lr·wd·W − lr·(α·PN + S). The norm-growth limiter keeps ‖S_t‖ ≤ γ·‖S_{t−1}‖, S_{t−1} as
limited, which costs one float32 scalar per matrix. The reference's choices kept (see
docs/fidelity.md#fira): the residual subtracts α·PR, not PR; the limiter compares norms before
Adam's bias correction, so the correction's growth over the first steps is not read as growth.
The residual needs the whole gradient: layer-wise under accumulation it accumulates in full.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Literal

import torch
from pydantic import Field
from torch import Tensor

from harness.config.tuning import tunable
from harness.distributed.rows import Rows
from harness.methods.base import Groups, Terms, register
from harness.methods.galore import GaLore, ProjectionConfig
from harness.methods.galore_optim import GaLoreOptimizer
from harness.methods.projection import (
    back_projected,
    project,
    project_back_,
)
from harness.modifiers.compensation import add_update, own_optimizer_kwargs

if TYPE_CHECKING:
    from harness.config import RunConfig

LIMITER = "fira_norm"  # state key: ‖S‖ of the last step, before bias correction (float32)
TINY = 1e-8  # the reference's guard in φ's and the limiter's denominators


class FiraConfig(ProjectionConfig):
    scale: float = tunable(
        0.25, values=[0.0625, 0.125, 0.25, 0.5], gt=0,
        description="α: multiplies PN, and PR in the residual G − α·PR",
        source="Fira's scripts' α: 0.25, and 0.0625 at 1B")
    proj_type: Literal["std", "reverse_std", "left", "right"] = Field(
        "std", description="side projected: std = the smaller one (one side: φ is per column)")
    optimizer: Literal["adamw", "adam8bit"] = Field(
        "adamw", description="inner optimizer, also used at full rank for the other weights")
    gamma: float = Field(1.01, ge=1, description="γ: the residual's norm grows at most γ× a step")
    min_8bit_size: int = Field(4096, ge=1, description="adam8bit: smaller states stay 32-bit")


@register("fira")
class Fira(GaLore):
    summary = "Fira: GaLore's low-rank Adam plus the residual G − PR, scaled by ‖Adam(R)‖/‖R‖"
    Config = FiraConfig

    def check(self, run: RunConfig) -> Terms:
        """Fira shards as GaLore does (methods/galore_optim.py); its residual is this rank's
        rows of G − α·PR, φ runs over the rank dimension (a left side's R is whole), and the
        limiter's ‖S‖ sums its squares over ranks."""
        fsdp = None
        if self.config.optimizer == "adam8bit":
            fsdp = ("optimizer adam8bit quantizes blocks of the flattened low-rank moments, "
                    "which FSDP's row shards would cut; use optimizer: adamw, or "
                    "train.parallel: ddp")
        return replace(super().check(run), fsdp=fsdp)

    def optimizer(self, groups: Groups, run: RunConfig) -> FiraOptimizer:
        c = self.config
        return FiraOptimizer(
            groups, lr=run.train.lr, betas=c.betas, eps=c.eps, inner=c.optimizer,
            proj_type=c.proj_type, update_proj_gap=c.update_proj_gap, scale=c.scale,
            gamma=c.gamma, min_8bit_size=c.min_8bit_size,
            **own_optimizer_kwargs(run.train, chunked=True))


class FiraOptimizer(GaLoreOptimizer):
    """GaLore's optimizer whose projected weights also get the limited, scaled residual."""

    def __init__(self, params: Iterable[Any], *, gamma: float = 1.01, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.gamma = gamma

    def fold(self, p: Tensor, last: bool) -> None:
        """Never a low-rank sum: the residual G − α·PR needs the whole summed gradient."""
        return None

    def _apply(self, group: dict[str, Any], params: list[Tensor], updates: list[Tensor],
               states: list[dict[str, Any]], sides: list[str], alpha: float,
               bases: list[dict[str, Any]] | None = None,
               held: list[Tensor | None] | None = None) -> None:
        """GaLore's update plus −lr·S, one weight at a time, so one full-size residual exists
        at once. A weight at a rank ≥ min(m, n) ("none") has nothing outside its subspace.
        Under fsdp `params`, `held` (G) and a left basis are this rank's rows."""
        if not group["rank"]:
            super()._apply(group, params, updates, states, sides, alpha, bases, held)
            return
        lr, wd = group["lr"], group["weight_decay"]
        bases, held = bases or states, held or [p.grad for p in params]
        for p, g, u, st, b, side in zip(params, held, updates, states, bases, sides,
                                        strict=True):
            s = None if side == "none" else self._residual(group, g, u, st, b, side)
            if not self.exact:  # in place, in the weights' dtype, as GaLore's fused path
                if wd:
                    p.mul_(1 - lr * wd)
                project_back_(p, u, b, side, alpha)
                if s is not None:
                    p.add_(s, alpha=-lr)
                continue
            full = back_projected(u, b, side).mul_(alpha)
            if s is not None:
                full.add_(s, alpha=-lr)
            add_update(p, full, self.compensation, st, lr * wd)
            del full, s  # not alive beside the next weight's: one weight's temporaries at once

    def _residual(self, group: dict[str, Any], g: Tensor, u: Tensor, st: dict[str, Any],
                  basis: dict[str, Any], side: str) -> Tensor:
        """S = φ ⊙ (G − α·PR), limited; `u` holds −N, Adam's update of R (bias-corrected).
        Under fsdp G is this rank's rows: a left side's R = PᵀG and ‖S‖ sum over ranks; φ
        runs over the rank dimension (a left side's whole R, a right side's own rows)."""
        dim = 0 if side == "left" else 1  # norms over the rank dimension
        r = project(g, basis, side)
        if side == "left" and self.sharded:
            Rows.total(r)
        phi = (torch.linalg.vector_norm(u, dim=dim, keepdim=True, dtype=torch.float32)
               / (torch.linalg.vector_norm(r, dim=dim, keepdim=True, dtype=torch.float32) + TINY))
        if side == "left":
            s = torch.addmm(g, basis["left"], r, alpha=-group["scale"])
        else:
            s = torch.addmm(g, r, basis["right"], alpha=-group["scale"])
        s.mul_(phi)
        # The reference's S carries no bias correction (its step size does): compare that one.
        b1, b2 = group["betas"]
        t = st["step"]
        norm = torch.linalg.vector_norm(s, dtype=torch.float32)
        if self.sharded:
            norm = Rows.total(norm.square()).sqrt()
        norm = norm * ((1 - b1**t) / math.sqrt(1 - b2**t))
        if LIMITER not in st:
            st[LIMITER] = norm
            return s
        limit = torch.clamp(norm / (st[LIMITER] + TINY), min=self.gamma) / self.gamma
        s.div_(limit)
        st[LIMITER] = norm / limit
        return s
