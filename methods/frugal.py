"""FRUGAL (Zmushko, Beznosikov, Takáč & Horváth, 2024, "FRUGAL: Memory-Efficient Optimization
by Reducing State Overhead for Scalable Training", arXiv 2411.07837, ICML 2025): full-rank
updates from a gradient split in two. A state-full subspace, of density ρ, gets Adam with
moments there; the rest of the gradient, outside it, gets signSGD, which keeps no state.

For a targeted m×n weight with gradient G and an orthonormal basis P of r = ⌊ρ·min(m, n)⌋
columns on its smaller side (Q on the right: R = GQᵀ), refreshed every `update_proj_gap` steps
(T) from G's SVD (GaLore's projection) or drawn at random on the Stiefel manifold (GoLore's,
methods/golore_optim.py): R = PᵀG, N = Adam(R) (bias-corrected), and

    W ← W − lr·wd·W − lr·P·N − lr_free·sign(G − P·R)

(the paper's Algorithm 1 with FRUGAL(Adam, signSGD)). The embeddings, head and norms take
AdamW at full rank, as GaLore's. The Adam part, the bases' refresh, bf16-true and fsdp are
GaLore's (methods/galore_optim.py): under fsdp the free part is this rank's rows of
G − P·R, a left side's R summed over the ranks first, as Fira's residual. The free part needs
the whole gradient: layer-wise under accumulation it accumulates in full.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
from pydantic import Field
from torch import Tensor, nn

from harness.distributed.rows import Rows
from harness.methods.base import Groups, Terms, register, unpaged
from harness.methods.full import AdamConfig
from harness.methods.galore import GaLore
from harness.methods.golore_optim import GoLoreOptimizer
from harness.methods.projection import back_projected, project, project_back_
from harness.methods.surgery import TARGETS, target_matrix
from harness.modifiers.compensation import add_update, own_optimizer_kwargs

if TYPE_CHECKING:
    from harness.config import RunConfig


class FrugalConfig(AdamConfig):
    density: float = Field(
        0.25, gt=0, lt=1, description="ρ: the state-full share of each projected matrix, "
        "r = ⌊ρ·min(m, n)⌋ (the paper's pre-training tables: ρ = 0.25)")
    projection: Literal["svd", "random"] = Field(
        "svd", description="the state-full subspace: the gradient's top singular vectors "
        "(GaLore's, which the paper integrates) or a random orthonormal basis (GoLore's draw)")
    update_proj_gap: int = Field(200, ge=1, description="T: steps between subspace refreshes "
                                 "(GaLore's T = 200)")
    free_lr_scale: float = Field(
        1.0, gt=0, description="the state-free signSGD step's LR as a factor of train.lr "
        "(1: one LR for both parts, as the framework's update is written)")
    moments: Literal["reset", "keep", "reproject"] = Field(
        "reset", description="Adam's state when the subspace changes: reset (a fresh "
        "state-full optimizer for the new subspace), keep, or rotate into it")
    target_modules: list[str] = Field(
        default_factory=lambda: list(TARGETS), min_length=1,
        description="a 2-D weight is split when one of these is a component of its name")
    proj_type: ClassVar[str] = "std"  # the smaller side, as GaLore's
    optimizer: ClassVar[str] = "adamw"  # GaLore's companion reads both
    min_8bit_size: ClassVar[int] = 0

    def targeted(self, name: str, shape: tuple[int, ...]) -> bool:
        return target_matrix(name, shape, self.target_modules)

    def rank_of(self, shape: tuple[int, ...]) -> int:
        """r = ⌊ρ·min(m, n)⌋, at least 1."""
        return max(1, int(self.density * min(shape)))


class FrugalOptimizer(GoLoreOptimizer):
    """GaLore's low-rank Adam on the state-full subspace plus signSGD on the rest."""

    def __init__(self, params: Iterable[Any], *, free_lr_scale: float, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.free_lr_scale = free_lr_scale

    def fold(self, p: Tensor, last: bool) -> None:
        """Never a low-rank sum: the free part G − P·R needs the whole summed gradient."""
        return None

    def _apply(self, group: dict[str, Any], params: list[Tensor], updates: list[Tensor],
               states: list[dict[str, Any]], sides: list[str], alpha: float,
               bases: list[dict[str, Any]] | None = None,
               held: list[Tensor | None] | None = None) -> None:
        """GaLore's update of the state-full part plus −lr_free·sign(G − P·R), one weight at a
        time; `params`, `held` (G) and a left basis are this rank's rows under fsdp."""
        if not group["rank"]:
            super()._apply(group, params, updates, states, sides, alpha, bases, held)
            return
        lr, wd = group["lr"], group["weight_decay"]
        free_lr = lr * self.free_lr_scale
        bases, held = bases or states, held or [p.grad for p in params]
        for p, g, u, st, b, side in zip(params, held, updates, states, bases, sides,
                                        strict=True):
            free = None if side == "none" else self._free(g, b, side)
            if not self.exact:  # in place, in the weights' dtype, as GaLore's fused path
                if wd:
                    p.mul_(1 - lr * wd)
                project_back_(p, u, b, side, alpha)
                if free is not None:
                    p.add_(free, alpha=-free_lr)
                continue
            full = back_projected(u, b, side).mul_(alpha)
            if free is not None:
                full.add_(free, alpha=-free_lr)
            add_update(p, full, self.compensation, st, lr * wd)
            del full, free  # one weight's temporaries at once

    def _free(self, g: Tensor, basis: dict[str, Any], side: str) -> Tensor:
        """sign(G − P·PᵀG) (right: G − GQᵀQ); under fsdp a left side's PᵀG summed over ranks."""
        r = project(g, basis, side)
        if side == "left":
            if self.sharded:
                Rows.total(r)
            return torch.addmm(g, basis["left"], r, alpha=-1).sign_()
        return torch.addmm(g, r, basis["right"], alpha=-1).sign_()


@register("frugal")
class Frugal(GaLore):
    summary = "FRUGAL: Adam on a ρ-dense subspace of each matrix, signSGD on the rest"
    Config = FrugalConfig

    def check(self, run: RunConfig) -> Terms:
        """fsdp: GaLore's sharding, the free part by this rank's rows (module docstring)."""
        return Terms(refusal=unpaged(run, "low-rank moments"), fsdp=None)

    def groups(self, model: nn.Module, run: RunConfig) -> Groups:
        """Each split matrix its own group (its rank, its seed for random draws); the other
        matrices, and vectors (never decayed), at full rank."""
        wd, c = run.train.weight_decay, self.config
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        split = [p for n, p in named if c.targeted(n, tuple(p.shape))]
        ids = {id(p) for p in split}
        rest = [p for _, p in named if id(p) not in ids]
        return [
            *({"params": [p], "rank": c.rank_of(tuple(p.shape)), "weight_decay": wd, "seed": i}
              for i, p in enumerate(split)),
            {"params": [p for p in rest if p.dim() >= 2], "weight_decay": wd},
            {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0},
        ]

    def optimizer(self, groups: Groups, run: RunConfig) -> FrugalOptimizer:
        c = self.config
        return FrugalOptimizer(
            groups, lr=run.train.lr, betas=c.betas, eps=c.eps, inner="adamw",
            proj_type=c.proj_type, update_proj_gap=c.update_proj_gap, scale=1.0,
            moments=c.moments, free_lr_scale=c.free_lr_scale,
            switch_step=0 if c.projection == "random" else sys.maxsize,
            **own_optimizer_kwargs(run.train, chunked=True))
