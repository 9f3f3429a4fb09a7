"""APOLLO on INT8 weights: the APOLLO paper's 7B recipe (APOLLO-Mini, INT8 weights, layer-wise
updates) with Q-GaLore's weight machinery.

Each targeted linear is a quant.Int8Linear (INT8 codes, no float weight). Its gradient G reaches
`_receive` inside backward and is summed there over micro-batches (APOLLO scales the full G, so
unlike Q-GaLore it cannot accumulate in low rank); on the last one it is averaged over ranks,
clipped on its own when `clip` is set, and APOLLOScaling gives its factor s from the layer's
rank-r moments and limiter; W ← W - lr·s·G - lr·wd·W goes onto the codes by stochastic rounding
from a seeded generator whose state is checkpointed. Its moments follow `state_dtype`; the
codes take stochastic rounding, never `compensation`. Every other parameter trains with AdamW
(APOLLOOptimizer without a rank) in its own post-accumulate-grad hook, as LayerwiseOptimizer
runs it; the scheduler drives every group's LR.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from harness import distributed
from harness.methods.apollo_optim import APOLLOOptimizer, APOLLOScaling
from harness.methods.qgalore_optim import on_device
from harness.methods.quant import Int8Linear
from harness.modifiers.layerwise import LayerwiseOptimizer


class APOLLOInt8Optimizer(LayerwiseOptimizer):
    """INT8 layers scaled APOLLO's way inside their backward; the rest AdamW, layer-wise.
    `seeds`: each layer's first projection seed (the float method's numbering)."""

    def __init__(self, layers: list[Int8Linear], seeds: list[int], params: list[nn.Parameter],
                 *, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                 inner: str, min_8bit_size: int, rank: int, update_proj_gap: int, scale: float,
                 proj: str, scale_type: str, limiter: bool, gamma: float, clip: float | None,
                 seed: int, state_dtype: torch.dtype | None = None,
                 compensation: str = "none") -> None:
        def make(p: nn.Parameter) -> APOLLOOptimizer:  # decay on matrices only
            decay = weight_decay if p.dim() >= 2 else 0.0
            return APOLLOOptimizer([{"params": [p], "weight_decay": decay}], lr=lr, betas=betas,
                                   eps=eps, inner=inner, min_8bit_size=min_8bit_size,
                                   state_dtype=state_dtype, compensation=compensation)

        super().__init__(params, make, clip)
        self.group: dict[str, Any] = {
            "params": [], "lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
            "rank": rank, "update_proj_gap": update_proj_gap, "scale": scale, "proj": proj,
            "scale_type": scale_type}
        # G is float32 (no float weight to follow): moments in state_dtype, else the weights'
        self.scaling = APOLLOScaling(inner, min_8bit_size, limiter, gamma,
                                     state_dtype or next((p.dtype for p in params), None))
        self.layers = layers
        self.layer_state: dict[Int8Linear, dict[str, Any]] = {
            m: {"seed": s} for m, s in zip(layers, seeds, strict=True)}
        self.pending: dict[Int8Linear, Tensor] = {}  # G summed over this step's micro-batches
        device = layers[0].codes.device if layers else torch.device("cpu")
        self.generator = torch.Generator(device).manual_seed(seed)
        for m in layers:
            m.grad_hook = self._receive

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return [self.group, *super().param_groups]

    @property
    def state(self) -> dict[Any, Any]:  # type: ignore[override]
        return {**super().state, **self.layer_state}

    def _receive(self, m: Int8Linear, g: Tensor) -> None:
        acc = self.pending.get(m)
        self.pending[m] = g if acc is None else acc.add_(g)
        if self.sync:
            g = distributed.all_sum(self.pending.pop(m)).div_(distributed.world_size())
            self._step_layer(m, g)

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

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self.pending.clear()

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(),
                "group": {k: v for k, v in self.group.items() if k != "params"},
                "layers": [self.layer_state[m] for m in self.layers],
                "generator": self.generator.get_state(),
                "svd_failures": self.scaling.svd_failures}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.group.update(state_dict["group"])
        for m, st in zip(self.layers, state_dict["layers"], strict=True):
            self.layer_state[m] = on_device(st, m.codes.device)
        self.generator.set_state(state_dict["generator"])
        self.scaling.svd_failures = state_dict["svd_failures"]
