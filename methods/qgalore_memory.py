"""Q-GaLore's bytes (methods/qgalore.py): INT8 codes (one byte a weight) with each group's
scale and zero point, INT4 bases, the lazy schedule's last singular vector per matrix, and the
float32 gradients of INT8 layers updated inside backward; `simulate: true` keeps float weights
and GaLore's arithmetic with the INT4 bases."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

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
    tensor_bytes,
)
from harness.methods.projection import lowrank_shape, side_of
from harness.methods.qgalore_optim import QGaLoreOptimizer, basis_shapes
from harness.methods.quant import int4_packed_bytes, int8_bytes
from harness.methods.widths import widths

if TYPE_CHECKING:
    from harness.config import RunConfig


@register_memory("qgalore")
class QGaLoreMemory(GaLoreMemory):
    @property
    def linears(self) -> str:  # type: ignore[override]
        return "float" if self.config.simulate else "quantized"

    def updated_alone(self, name: str, shape: tuple[int, ...], run: RunConfig) -> bool:
        return True  # its optimizer updates one weight at a time

    def estimate(self, shapes: Shapes, run: RunConfig) -> MemoryEstimate:
        c, w = self.config, widths(run)
        weights = state = extra = 0
        for name, full in shapes.items():
            shape, n = tuple(full), numel(full)
            if not c.targeted(name, shape):
                weights += w.weight * n
                state += state_bytes(shape, c.optimizer, c.min_8bit_size, None, w.state)
                state += w.compensation * n
                continue
            side = side_of(shape, c.proj_type, c.rank)
            state += state_bytes(lowrank_shape(shape, side, c.rank), c.optimizer,
                                 c.min_8bit_size, None, w.state)
            prev = 4 * {"left": shape[0], "full": shape[0], "right": shape[1]}.get(side, 0)
            if c.simulate:
                weights += w.weight * n
                state += w.compensation * n
                extra += w.weight * basis_numel(shape, side, c.rank) + prev
            else:
                weights += n
                extra += int8_bytes(shape, c.weight_group) - n + prev + sum(
                    int4_packed_bytes(s, c.proj_group)
                    for s in basis_shapes(shape, side, c.rank).values())
        if c.simulate:
            grads = grad_bytes([numel(s) for s in shapes.values()], run, self.steps)
        else:  # every update runs in backward; the INT8 layers' G is float32
            grads = int8_grad_bytes(shapes, c.targeted, run, self.steps)
        return MemoryEstimate(weights, grads, state, extra)

    def measure(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> MemoryEstimate:
        params = list(model.parameters())
        floats = sum(tensor_bytes(p) for p in params)
        if self.config.simulate:
            states = list(optimizer.state.values())
            skip = (*BASIS_KEYS, "lazy")
            return MemoryEstimate(
                weight_bytes=floats,
                grad_bytes=live_grad_bytes(params),
                optimizer_state_bytes=tensor_bytes(
                    [{k: v for k, v in s.items() if k not in skip} for s in states]),
                extra_bytes=tensor_bytes([[s.get(k) for k in BASIS_KEYS] + [s["lazy"]["prev"]]
                                          for s in states if "lazy" in s]))
        assert isinstance(optimizer, QGaLoreOptimizer)
        layers = optimizer.layers
        layer_states = [optimizer.layer_state[m] for m in layers]
        return MemoryEstimate(
            weight_bytes=floats + sum(tensor_bytes(m.codes) for m in layers),
            grad_bytes=live_grad_bytes(params),
            optimizer_state_bytes=tensor_bytes([st["moments"] for st in layer_states])
            + tensor_bytes([list(o.state.values()) for o in optimizer.inner.values()]),
            extra_bytes=tensor_bytes([[m.scale, m.zero, optimizer.gaps[m].prev] for m in layers])
            + tensor_bytes([st.get("basis") for st in layer_states]))
