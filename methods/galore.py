"""GaLore (Zhao et al., 2024): full-parameter training whose optimizer states are low-rank.

Every weight trains; only the targeted matrices' gradients are projected (the optimizer lives
in methods/galore_optim.py). Projection matrices are counted as extra bytes, the low-rank
moments as optimizer state.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Literal

import torch
from pydantic import Field
from torch import nn

from harness import distributed
from harness.methods.base import TARGETS, MemoryEstimate, Method, Shapes, numel, register
from harness.methods.full import AdamConfig
from harness.methods.galore_optim import (
    BASIS_KEYS,
    BLOCK,
    QMAP,
    GaLoreOptimizer,
    lowrank_shape,
    side_of,
)
from harness.methods.layerwise import LayerwiseOptimizer

if TYPE_CHECKING:
    from harness.config import RunConfig



class ProjectionConfig(AdamConfig):
    """What GaLore and Q-GaLore share: which weights are projected, how, and how often."""

    rank: int = Field(128, ge=1, description="r: the projected gradient's rank")
    update_proj_gap: int = Field(200, ge=1, description="steps between SVDs (T)")
    scale: float = Field(0.25, gt=0, description="α: multiplies the back-projected update")
    proj_type: Literal["std", "reverse_std", "left", "right", "full"] = Field(
        "std", description="side projected: std = the smaller one, full = both")
    target_modules: list[str] = Field(
        default_factory=lambda: list(TARGETS), min_length=1,
        description="a 2-D weight is projected when one of these is a component of its name")


class GaLoreConfig(ProjectionConfig):
    optimizer: Literal["adamw", "adam8bit", "adafactor"] = Field(
        "adamw", description="inner optimizer, also used at full rank for the other weights")
    moments: Literal["keep", "reset", "reproject"] = Field(
        "keep", description="moments when the subspace changes: keep (paper), zero, or rotate")
    svd: Literal["exact", "randomized"] = Field(
        "exact", description="randomized: range finder with power iterations, faster")
    layerwise: bool = Field(False, description="each weight's update runs inside backward")
    min_8bit_size: int = Field(4096, ge=1, description="adam8bit: smaller states stay 32-bit")
    adafactor_beta1: float | None = Field(
        None, ge=0, lt=1, description="adafactor: first-moment decay (None: no first moment)")


@register("galore")
class GaLore(Method):
    summary = "GaLore: gradients projected to rank r, states there (AdamW, 8-bit, Adafactor)"
    Config = GaLoreConfig

    def targeted(self, name: str, shape: tuple[int, ...]) -> bool:
        parts = name.split(".")
        return len(shape) == 2 and any(t in parts for t in self.config.target_modules)

    def optimizer(self, model: nn.Module, run: RunConfig) -> torch.optim.Optimizer:
        c, wd = self.config, run.train.weight_decay
        # Layer-wise gradient memory depends on the micro-batches each process accumulates.
        self._accumulation = max(1, run.train.accumulation // distributed.world_size())
        settings: dict[nn.Parameter, dict[str, Any]] = {}
        for name, p in model.named_parameters():
            if self.targeted(name, tuple(p.shape)):
                settings[p] = {"rank": c.rank, "weight_decay": wd}
            else:  # decay on matrices only, never on norms and biases
                settings[p] = {"weight_decay": wd if p.dim() >= 2 else 0.0}

        def make(params: list[nn.Parameter]) -> GaLoreOptimizer:
            kinds: dict[tuple, list[nn.Parameter]] = {}
            for p in params:
                kinds.setdefault(tuple(sorted(settings[p].items())), []).append(p)
            return GaLoreOptimizer(
                [{**dict(k), "params": ps} for k, ps in kinds.items()],
                lr=run.train.lr, betas=c.betas, eps=c.eps, inner=c.optimizer,
                proj_type=c.proj_type, update_proj_gap=c.update_proj_gap, scale=c.scale,
                moments=c.moments, svd=c.svd, min_8bit_size=c.min_8bit_size,
                adafactor_beta1=c.adafactor_beta1)

        params = list(settings)
        if c.layerwise:
            return LayerwiseOptimizer(params, lambda p: make([p]), run.train.grad_clip)
        return make(params)

    def on_step(self, step: int, model: nn.Module,
                optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
        """An event only on steps that recomputed projections."""
        opts = _galore_optimizers(optimizer)
        attempts = sum(o.take_svd_attempts() for o in opts)
        if not attempts:
            return None
        return {"galore_svd": attempts,
                "svd_retries": sum(o.svd_retries for o in opts),
                "svd_failures": sum(o.svd_failures for o in opts)}

    def estimate(self, shapes: Shapes, run: RunConfig) -> MemoryEstimate:
        c = self.config
        sizes = [numel(s) for s in shapes.values()]
        state = extra = 0
        for name, full in shapes.items():
            shape = tuple(full)
            if self.targeted(name, shape):
                side = side_of(shape, c.proj_type, c.rank)
                extra += 4 * basis_numel(shape, side, c.rank)
                shape = lowrank_shape(shape, side, c.rank)
            state += state_bytes(shape, c.optimizer, c.min_8bit_size, c.adafactor_beta1)
        grads = grad_bytes_of(sizes, c.layerwise, run.train.accumulation)
        return MemoryEstimate(4 * sum(sizes), grads, state, extra)

    def measure(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> MemoryEstimate:
        from harness.meter import tensor_bytes

        params = list(model.parameters())
        states = list(optimizer.state.values())
        moments = [{k: v for k, v in s.items() if k not in BASIS_KEYS} for s in states]
        if self.config.layerwise:  # gradients were freed inside backward: count what existed
            grads = grad_bytes_of([p.numel() for p in params], True, self._accumulation)
        else:
            grads = sum(tensor_bytes(p.grad) for p in params if p.grad is not None)
        return MemoryEstimate(
            weight_bytes=sum(tensor_bytes(p) for p in params),
            grad_bytes=grads,
            optimizer_state_bytes=tensor_bytes(moments),
            extra_bytes=tensor_bytes([s.get(k) for s in states for k in BASIS_KEYS]),
        )


def basis_numel(shape: tuple[int, ...], side: str, rank: int) -> int:
    m, n = shape
    return {"none": 0, "left": m * rank, "right": rank * n, "full": (m + n) * rank}[side]


def state_bytes(shape: tuple[int, ...], inner: str, min_8bit_size: int,
                beta1: float | None) -> int:
    """Bytes of the moments the inner optimizer keeps for a gradient (or projection) of `shape`."""
    n = math.prod(shape)
    if inner == "adafactor":
        sq = 4 * (n // shape[-1] + n // shape[-2]) if len(shape) >= 2 else 4 * n
        return sq + (4 * n if beta1 is not None else 0)
    if inner == "adam8bit" and n >= min_8bit_size:
        return 2 * (n + 4 * QMAP + 4 * math.ceil(n / BLOCK))
    return 8 * n


def grad_bytes_of(sizes: list[int], layerwise: bool, accumulation: int) -> int:
    """Layer-wise without accumulation holds one gradient at a time: the largest is the peak.
    With accumulation every gradient lives until the last micro-batch's backward."""
    if layerwise and accumulation == 1:
        return 4 * max(sizes)
    return 4 * sum(sizes)


def _galore_optimizers(optimizer: torch.optim.Optimizer) -> list[GaLoreOptimizer]:
    if getattr(optimizer, "layerwise", False):
        return list(optimizer.inner.values())  # type: ignore[attr-defined]
    return [optimizer]  # type: ignore[list-item]
