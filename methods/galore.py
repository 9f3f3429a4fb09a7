"""GaLore (Zhao et al., 2024): full-parameter training whose optimizer states are low-rank.

Every weight trains; only the targeted matrices' gradients are projected (the optimizer lives
in methods/galore_optim.py; its bytes in methods/galore_memory.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import torch
from pydantic import Field
from torch import nn

from harness.config import Strict
from harness.config.tuning import tunable
from harness.methods.base import Groups, Method, Terms, register, unpaged
from harness.methods.full import AdamConfig
from harness.methods.galore_optim import GaLoreOptimizer
from harness.methods.golore_optim import GoLoreOptimizer
from harness.methods.surgery import TARGETS, target_matrix
from harness.modifiers.compensation import own_optimizer_kwargs
from harness.modifiers.optimizer import unwrap

if TYPE_CHECKING:
    from harness.config import RunConfig


class ProjectionConfig(AdamConfig):
    """What GaLore and Q-GaLore share: which weights are projected, how, and how often."""

    rank: int = Field(128, ge=1, description="r: the projected gradient's rank")
    betas: tuple[float, float] = Field((0.9, 0.999), description="moment decay rates")
    update_proj_gap: int = tunable(
        200, values=[50, 100, 200, 500], ge=1, description="steps between SVDs (T)",
        source="around GaLore's T 200, arXiv 2403.03507 Table 2; its ablation varies T")
    scale: float = tunable(
        0.25, values=[0.125, 0.25, 0.5, 1.0], gt=0,
        description="α: multiplies the back-projected update",
        source="halves and doubles of GaLore's α 0.25, arXiv 2403.03507 Table 2")
    proj_type: Literal["std", "reverse_std", "left", "right", "full"] = Field(
        "std", description="side projected: std = the smaller one, full = both")
    target_modules: list[str] = Field(
        default_factory=lambda: list(TARGETS), min_length=1,
        description="a 2-D weight is projected when one of these is a component of its name")

    def targeted(self, name: str, shape: tuple[int, ...]) -> bool:
        """Whether the parameter `name` is a projected matrix (a target linear's weight)."""
        return target_matrix(name, shape, self.target_modules)


class ProjectionAfter(Strict):
    """GoLore (arXiv 2410.11289, Algorithm 1 and §6): from `step` on, refreshes draw the
    basis uniformly at random on the Stiefel manifold instead of from the gradient's SVD."""

    step: int = Field(ge=0, description="the first projection step whose refresh is random "
                      "(it takes effect at the first refresh at or after it)")
    kind: Literal["random"] = Field("random", description="random: GoLore's Stiefel draw")


class GaLoreConfig(ProjectionConfig):
    optimizer: Literal["adamw", "adam8bit", "adafactor"] = Field(
        "adamw", description="inner optimizer, also used at full rank for the other weights")
    moments: Literal["keep", "reset", "reproject"] = Field(
        "keep", description="moments when the subspace changes: keep (paper), zero, or rotate")
    svd: Literal["exact", "randomized"] = Field(
        "exact", description="randomized: range finder with power iterations, faster")
    min_8bit_size: int = Field(4096, ge=1, description="adam8bit: smaller states stay 32-bit")
    adafactor_beta1: float | None = Field(
        None, ge=0, lt=1, description="adafactor: first-moment decay (None: no first moment)")
    projection_after: ProjectionAfter | None = Field(
        None, description="GoLore (He et al., 2024): {step, kind: random}, random bases from "
        "that step on; None: SVD throughout (GaLore)")


@register("galore")
class GaLore(Method):
    summary = "GaLore: gradients projected to rank r, states there (AdamW, 8-bit, Adafactor)"
    Config = GaLoreConfig

    def check(self, run: RunConfig) -> Terms:
        """GaLore shards (methods/galore_optim.py): a refresh sends each gradient whole to the
        one rank computing its SVD and the bases back as tensors (P by rows, Q whole); between
        refreshes a right side projects this rank's rows, a left side reduce-scatters its r×n
        product (its moments by rows of r); 8-bit moments by rows where their shards are whole
        blocks (checked as the optimizer is built). Factored inner states do not split."""
        fsdp = None
        if self.config.optimizer == "adafactor":
            fsdp = ("optimizer adafactor's factored second moment averages over all rows, "
                    "which FSDP's row shards split; use optimizer: adamw, or train.parallel: ddp")
        return Terms(refusal=unpaged(run, "low-rank moments"), fsdp=fsdp)

    def groups(self, model: nn.Module, run: RunConfig) -> Groups:
        """Projected matrices, the other matrices, and vectors (never decayed)."""
        wd = run.train.weight_decay
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        projected = [p for n, p in named if self.config.targeted(n, tuple(p.shape))]
        ids = {id(p) for p in projected}
        rest = [p for _, p in named if id(p) not in ids]
        # GoLore: each projected weight its own group, whose seed tells its random draws apart
        mine = [{"params": [p], "rank": self.config.rank, "weight_decay": wd, "seed": i}
                for i, p in enumerate(projected)] if self._switch_step() is not None \
            else [{"params": projected, "rank": self.config.rank, "weight_decay": wd}]
        return [
            *mine,
            {"params": [p for p in rest if p.dim() >= 2], "weight_decay": wd},
            {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0},
        ]

    def _switch_step(self) -> int | None:
        """GoLore's switch step, where the config has one (Fira's and Q-GaLore's have not)."""
        after = getattr(self.config, "projection_after", None)
        return None if after is None else after.step

    def optimizer(self, groups: Groups, run: RunConfig) -> torch.optim.Optimizer:
        c, switch = self.config, self._switch_step()
        extra = {} if switch is None else {"switch_step": switch}
        return (GaLoreOptimizer if switch is None else GoLoreOptimizer)(
            groups, **extra, lr=run.train.lr, betas=c.betas, eps=c.eps, inner=c.optimizer,
            proj_type=c.proj_type, update_proj_gap=c.update_proj_gap, scale=c.scale,
            moments=c.moments, svd=c.svd, min_8bit_size=c.min_8bit_size,
            adafactor_beta1=c.adafactor_beta1, **own_optimizer_kwargs(run.train, chunked=True))

    def on_step(self, step: int, model: nn.Module,
                optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
        """An event only on steps that recomputed projections."""
        opts: list[GaLoreOptimizer] = unwrap(optimizer)  # type: ignore[assignment]
        attempts = sum(o.take_svd_attempts() for o in opts)
        if not attempts:
            return None
        return {"galore_svd": attempts,
                "svd_retries": sum(o.svd_retries for o in opts),
                "svd_failures": sum(o.svd_failures for o in opts)}
