"""GaLore's bytes (methods/galore.py): projection bases count as extra bytes, the low-rank
moments (and the full-rank ones of unprojected tensors) as optimizer state. Fira, Q-GaLore and
APOLLO build on this arithmetic."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from harness.methods.adam8bit_memory import adam8bit_state_bytes
from harness.methods.base import register_memory
from harness.methods.galore_state import BASIS_KEYS
from harness.methods.memory import (
    Memory,
    MemoryEstimate,
    Shapes,
    grad_bytes,
    live_grad_bytes,
    numel,
    row_share,
    tensor_bytes,
)
from harness.methods.projection import lowrank_shape, side_of
from harness.methods.widths import widths

if TYPE_CHECKING:
    from harness.config import RunConfig


@register_memory("galore")
class GaLoreMemory(Memory):
    bench: ClassVar[dict[str, Any]] = {"rank": 16}
    whole_chunks = True  # the unprojected path's fused kernel: whole tensors in a chunk
    variants: ClassVar[dict[str, dict[str, Any]]] = {
        "galore_8bit_layerwise": {"method": "galore", "rank": 16, "optimizer": "adam8bit"}}

    def updated_alone(self, name: str, shape: tuple[int, ...], run: RunConfig) -> bool:
        """Projected weights, and every weight of an inner optimizer other than AdamW (whose
        unprojected updates alone go by chunks)."""
        return self.config.targeted(name, shape) or self.config.optimizer != "adamw"

    def estimate(self, shapes: Shapes, run: RunConfig) -> MemoryEstimate:
        return self.estimate_sharded(shapes, run, 1)

    def estimate_sharded(self, shapes: Shapes, run: RunConfig, world: int) -> MemoryEstimate:
        """Weights, gradients, the moments of a right side (or an unprojected tensor) and a left
        basis P by this rank's rows, a left side's r×n moments by rows of their r; a right
        basis Q whole on every rank (each rank's rows of G take all of Q)."""
        c, w = self.config, widths(run)
        sizes = [numel(row_share(s, world)) for s in shapes.values()]
        state, extra = w.compensation * sum(sizes), 0
        for name, full in shapes.items():
            shape, side = tuple(full), "none"
            if c.targeted(name, shape):  # the basis is kept in the weights' dtype
                side = side_of(shape, c.proj_type, c.rank)
                extra += w.weight * basis_numel(shape, side, c.rank, world)
                shape = lowrank_shape(shape, side, c.rank)
            least = c.min_8bit_size if numel(shape) < c.min_8bit_size else 0  # by the whole
            if side != "full":  # a left side's by its r rows (reduce-scattered R)
                shape = row_share(shape, world)
            state += state_bytes(shape, c.optimizer, least,
                                 getattr(c, "adafactor_beta1", None), w.state)  # Fira: none
        return MemoryEstimate(w.weight * sum(sizes), grad_bytes(sizes, run, self.steps), state,
                              extra)

    def measure(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> MemoryEstimate:
        params = list(model.parameters())
        states = list(optimizer.state.values())
        moments = [{k: v for k, v in s.items() if k not in BASIS_KEYS} for s in states]
        return MemoryEstimate(
            weight_bytes=sum(tensor_bytes(p) for p in params),
            grad_bytes=live_grad_bytes(params),
            optimizer_state_bytes=tensor_bytes(moments),
            extra_bytes=tensor_bytes([s.get(k) for s in states for k in BASIS_KEYS]),
        )


def basis_numel(shape: tuple[int, ...], side: str, rank: int, world: int = 1) -> int:
    """Elements of a `shape` weight's bases that rank 0 keeps under fsdp over `world` ranks
    (1: unsharded): its rows of a left basis P (m×r), a right one Q (r×n) whole."""
    m, n = row_share(shape, world)[0], shape[1]
    return {"none": 0, "left": m * rank, "right": rank * n, "full": (m + n) * rank}[side]


def state_bytes(shape: tuple[int, ...], inner: str, min_8bit_size: int,
                beta1: float | None, width: int = 4) -> int:
    """Bytes of the moments the inner optimizer keeps for a gradient (or projection) of `shape`,
    32-bit ones at `width` bytes an element (8-bit ones stay 8-bit)."""
    n = math.prod(shape)
    if inner == "adafactor":
        sq = width * (n // shape[-1] + n // shape[-2]) if len(shape) >= 2 else width * n
        return sq + (width * n if beta1 is not None else 0)
    if inner == "adam8bit":
        return adam8bit_state_bytes(n, min_8bit_size, width)
    return 2 * width * n
