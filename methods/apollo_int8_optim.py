"""APOLLO on INT8 weights: the APOLLO paper's 7B recipe (APOLLO-Mini, INT8 weights, layer-wise
updates) with Q-GaLore's weight machinery.

Each targeted linear is a quant.Int8Linear (INT8 codes, no float weight), updated inside
backward as methods/int8_optim.py runs it. Its G is summed over micro-batches in full (APOLLO
scales G itself, so unlike Q-GaLore it cannot accumulate in low rank), clipped on its own when
`clip` is set, and APOLLOScaling gives its factor s from the layer's rank-r moments (in
`state_dtype`) and limiter; W ← W - lr·s·G - lr·wd·W goes onto the codes by stochastic
rounding. Every other parameter trains with AdamW (APOLLOOptimizer without a rank).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from harness.methods.apollo_optim import APOLLOOptimizer, APOLLOScaling
from harness.methods.int8_optim import Int8LayerwiseOptimizer, per_parameter
from harness.methods.quant import Int8Linear


class APOLLOInt8Optimizer(Int8LayerwiseOptimizer):
    """INT8 layers scaled APOLLO's way inside their backward; the rest AdamW, layer-wise.
    `seeds`: each layer's first projection seed (the float method's numbering)."""

    def __init__(self, layers: list[Int8Linear], seeds: list[int], params: list[nn.Parameter],
                 *, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                 inner: str, min_8bit_size: int, rank: int, update_proj_gap: int, scale: float,
                 proj: str, scale_type: str, limiter: bool, gamma: float, clip: float | None,
                 seed: int, state_dtype: torch.dtype | None = None,
                 compensation: str = "none") -> None:
        make = per_parameter(APOLLOOptimizer, weight_decay, lr=lr, betas=betas, eps=eps,
                             inner=inner, min_8bit_size=min_8bit_size, state_dtype=state_dtype,
                             compensation=compensation)
        group = {"params": [], "lr": lr, "betas": betas, "eps": eps,
                 "weight_decay": weight_decay, "rank": rank, "update_proj_gap": update_proj_gap,
                 "scale": scale, "proj": proj, "scale_type": scale_type}
        super().__init__(layers, {m: {"seed": s} for m, s in zip(layers, seeds, strict=True)},
                         params, make, group=group, clip=clip, seed=seed,
                         state_dtype=state_dtype)
        self.scaling = APOLLOScaling(inner, min_8bit_size, limiter, gamma, self.state_dtype)

    @torch.no_grad()
    def _step_layer(self, m: Int8Linear, g: Tensor) -> None:
        if self.clip:  # torch's rule, on this layer's gradient alone
            g.mul_((self.clip / (g.norm() + 1e-6)).clamp(max=1.0))
        (factor,) = self.scaling.factors(self.group, [g], [self.layer_state[m]])
        if factor is None:  # a first SVD failed: this layer waits for the next step
            return
        lr, wd = self.group["lr"], self.group["weight_decay"]
        delta = g.float().mul_(factor).mul_(-lr)
        if wd:  # decoupled, on the full weight
            delta.add_(m.dequantized(), alpha=-lr * wd)
        m.apply_update(delta, self.generator)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "svd_failures": self.scaling.svd_failures}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.scaling.svd_failures = state_dict["svd_failures"]
