"""APOLLO (Zhu et al., 2024): AdamW-like updates at nearly SGD's memory. Adam runs on a rank-r
random (or SVD) projection of each targeted gradient only to measure per-channel scaling
factors; the full gradient, scaled by them, is the update (methods/apollo_optim.py).

Every weight trains. The low-rank moments and the limiter's last norm are optimizer state; a
random projection is regenerated from its seed, so it costs no bytes, while an SVD basis is
stored (extra bytes, as GaLore's). APOLLO-Mini (rank 1, one factor per tensor) is the same
method with other settings, registered from methods/apollo_mini.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import torch
from pydantic import Field
from torch import nn

from harness.methods.apollo_optim import APOLLOOptimizer
from harness.methods.base import (
    TARGETS,
    Groups,
    MemoryEstimate,
    Shapes,
    grad_bytes,
    numel,
    register,
)
from harness.methods.full import AdamConfig
from harness.methods.galore import GaLore, basis_numel, state_bytes
from harness.methods.projection import lowrank_shape, side_of
from harness.methods.widths import widths
from harness.modifiers.compensation import own_optimizer_kwargs
from harness.modifiers.optimizer import unwrap

if TYPE_CHECKING:
    from harness.config import RunConfig

LIMITER_BYTES = 4  # the limiter's last update norm: one float32 per targeted matrix


class APOLLOCommon(AdamConfig):
    """What APOLLO and APOLLO-Mini share."""

    update_proj_gap: int = Field(200, ge=1, description="steps between projections (T)")
    proj: Literal["random", "svd"] = Field(
        "random", description="random: N(0, 1/r) from a seed, never stored; svd: GaLore's basis")
    limiter: bool = Field(True, description="Fira's norm-growth limiter on the scaled gradient")
    gamma: float = Field(1.01, gt=1, description="limiter: the update norm's largest growth")
    target_modules: list[str] = Field(
        default_factory=lambda: list(TARGETS), min_length=1,
        description="a 2-D weight is scaled when one of these is a component of its name")
    optimizer: Literal["adamw", "adam8bit"] = Field(
        "adamw", description="Adam's moments: 32-bit, or 8-bit blockwise (also off-target)")
    min_8bit_size: int = Field(4096, ge=1, description="adam8bit: smaller states stay 32-bit")


class APOLLOConfig(APOLLOCommon):
    rank: int = Field(256, ge=1, description="r: the auxiliary projection's rank")
    scale: float = Field(1.0, gt=0, description="the update is multiplied by √scale (α²)")
    scale_type: Literal["channel", "tensor"] = Field(
        "channel", description="one scaling factor per channel, or per matrix")


@register("apollo")
class APOLLO(GaLore):
    summary = "APOLLO: the gradient scaled per channel by Adam run on a rank-r random projection"
    Config = APOLLOConfig

    def shape_settings(self) -> tuple[int, str]:
        """The projection's rank and the scaling's granularity."""
        return self.config.rank, self.config.scale_type

    def projects(self, name: str, shape: tuple[int, ...]) -> bool:
        """A target matrix below full rank; at a rank ≥ min(m, n) AdamW updates it."""
        rank = self.shape_settings()[0]
        return self.targeted(name, shape) and side_of(shape, "std", rank) != "none"

    def param_groups(self, model: nn.Module, run: RunConfig) -> Groups:
        """One group per scaled matrix, with its projection seed (its 1-based place among
        the trained parameters, as the reference numbers them), so a layer-wise split keeps
        each seed; then the other matrices, then vectors (never decayed)."""
        wd, rank = run.train.weight_decay, self.shape_settings()[0]
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        groups: Groups = [{"params": [p], "rank": rank, "seed": i, "weight_decay": wd}
                          for i, (n, p) in enumerate(named, 1)
                          if self.projects(n, tuple(p.shape))]
        ids = {id(g["params"][0]) for g in groups}
        rest = [p for _, p in named if id(p) not in ids]
        return [*groups, {"params": [p for p in rest if p.dim() >= 2], "weight_decay": wd},
                {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}]

    def build_optimizer(self, groups: Groups, run: RunConfig) -> torch.optim.Optimizer:
        c, scale_type = self.config, self.shape_settings()[1]
        return APOLLOOptimizer(
            groups, lr=run.train.lr, betas=c.betas, eps=c.eps, inner=c.optimizer,
            update_proj_gap=c.update_proj_gap, scale=c.scale, proj=c.proj,
            scale_type=scale_type, limiter=c.limiter, gamma=c.gamma,
            min_8bit_size=c.min_8bit_size, **own_optimizer_kwargs(run.train))

    def on_step(self, step: int, model: nn.Module,
                optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
        """An event only on steps that made new projections."""
        opts: list[APOLLOOptimizer] = unwrap(optimizer)  # type: ignore[assignment]
        made = sum(o.take_refreshes() for o in opts)
        if not made:
            return None
        return {"apollo_projections": made, "svd_failures": sum(o.svd_failures for o in opts)}

    def estimate(self, shapes: Shapes, run: RunConfig) -> MemoryEstimate:
        c, w, rank = self.config, widths(run), self.shape_settings()[0]
        sizes = [numel(s) for s in shapes.values()]
        state, extra = w.compensation * sum(sizes), 0
        for name, full in shapes.items():
            shape = tuple(full)
            if self.projects(name, shape):
                side = side_of(shape, "std", rank)
                if c.proj == "svd":  # stored in the weights' dtype; a random one is not stored
                    extra += w.weight * basis_numel(shape, side, rank)
                shape = lowrank_shape(shape, side, rank)
                state += LIMITER_BYTES if c.limiter else 0
            state += state_bytes(shape, c.optimizer, c.min_8bit_size, None, w.state)
        return MemoryEstimate(w.weight * sum(sizes), grad_bytes(sizes, run, self.steps), state,
                              extra)
