"""APOLLO's bytes (methods/apollo.py): the low-rank moments and the limiter's last norm are
optimizer state; a random projection is regenerated from its seed (no bytes), an SVD basis is
stored (extra bytes, as GaLore's). `int8_weights` counts as Q-GaLore's: one byte a code plus
each group's scale and zero point, and the float32 gradients that exist at once."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from harness.methods.apollo_int8_optim import APOLLOInt8Optimizer
from harness.methods.base import register_memory
from harness.methods.galore_memory import GaLoreMemory, basis_numel, state_bytes
from harness.methods.galore_state import BASIS_KEYS
from harness.methods.memory import (
    MemoryEstimate,
    Shapes,
    grad_bytes,
    int8_grad_bytes,
    live_grad_bytes,
    numel,
    row_share,
    tensor_bytes,
)
from harness.methods.projection import lowrank_shape, side_of
from harness.methods.quant import int8_bytes
from harness.methods.widths import widths

if TYPE_CHECKING:
    from harness.config import RunConfig

LIMITER_BYTES = 4  # the limiter's last update norm: one float32 per targeted matrix


@register_memory("apollo")
class APOLLOMemory(GaLoreMemory):
    @property
    def linears(self) -> str:  # type: ignore[override]
        return "quantized" if self.config.int8_weights else "float"

    def updated_alone(self, name: str, shape: tuple[int, ...], run: RunConfig) -> bool:
        """INT8 weights' optimizer updates one weight at a time; else as GaLore's."""
        return self.config.int8_weights or super().updated_alone(name, shape, run)

    def estimate(self, shapes: Shapes, run: RunConfig) -> MemoryEstimate:
        return self.estimate_sharded(shapes, run, 1)

    def estimate_sharded(self, shapes: Shapes, run: RunConfig, world: int) -> MemoryEstimate:
        """Under fsdp (`world` > 1; never with int8_weights) weights, gradients and the moments
        of a right side or an unprojected tensor by this rank's rows, a left side's r×n moments
        whole on every rank."""
        c, w = self.config, widths(run)
        rank = c.projection()[0]
        sizes = [numel(row_share(s, world)) for s in shapes.values()]
        weights, state, extra = w.weight * sum(sizes), w.compensation * sum(sizes), 0
        for name, full in shapes.items():
            shape, side = tuple(full), "none"
            if c.projects(name, shape):
                side = side_of(shape, "std", rank)
                if c.proj == "svd":  # stored in the weights' dtype; a random one is not stored
                    extra += w.weight * basis_numel(shape, side, rank)
                if c.int8_weights:  # codes, each group's scale and zero; no compensation
                    weights -= (w.weight - 1) * numel(shape)
                    state -= w.compensation * numel(shape)
                    extra += int8_bytes(shape, c.weight_group) - numel(shape)
                shape = lowrank_shape(shape, side, rank)
                state += LIMITER_BYTES if c.limiter else 0
            if side in ("right", "none"):
                shape = row_share(shape, world)
            state += state_bytes(shape, c.optimizer, c.min_8bit_size, None, w.state)
        if c.int8_weights:  # every update runs in backward; the INT8 layers' G is float32
            grads = int8_grad_bytes(shapes, c.projects, run, self.steps)
        else:
            grads = grad_bytes(sizes, run, self.steps)
        return MemoryEstimate(weights, grads, state, extra)

    def measure(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> MemoryEstimate:
        if not isinstance(optimizer, APOLLOInt8Optimizer):
            return super().measure(model, optimizer)
        params, layers = list(model.parameters()), optimizer.layers
        inner = [st for o in optimizer.inner.values() for st in o.state.values()]
        states = [optimizer.layer_state[m] for m in layers] + inner
        return MemoryEstimate(
            weight_bytes=tensor_bytes(params) + tensor_bytes([m.codes for m in layers]),
            grad_bytes=live_grad_bytes(params),
            optimizer_state_bytes=tensor_bytes([{k: v for k, v in st.items() if k not in BASIS_KEYS}
                                                for st in states]),
            extra_bytes=tensor_bytes([[m.scale, m.zero] for m in layers])
            + tensor_bytes([[st.get(k) for k in BASIS_KEYS] for st in states]))
