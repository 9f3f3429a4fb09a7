"""FRUGAL's bytes (methods/frugal.py): GaLore's arithmetic with each split matrix's own rank
r = ⌊ρ·min(m, n)⌋; the state-free part keeps nothing."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from harness.methods.base import register_memory
from harness.methods.galore_memory import GaLoreMemory, basis_numel, state_bytes
from harness.methods.memory import MemoryEstimate, Shapes, grad_bytes, numel, row_share
from harness.methods.projection import lowrank_shape, side_of
from harness.methods.widths import widths

if TYPE_CHECKING:
    from harness.config import RunConfig


@register_memory("frugal")
class FrugalMemory(GaLoreMemory):
    bench: ClassVar[dict[str, Any]] = {}  # its defaults: no `rank` (the density sets it)

    def estimate_sharded(self, shapes: Shapes, run: RunConfig, world: int) -> MemoryEstimate:
        """Per split matrix: its basis (P by this rank's rows, Q whole) and the r-rank AdamW
        moments (a left side's by rows of r); the other tensors' AdamW moments by rows."""
        c, w = self.config, widths(run)
        sizes = [numel(row_share(s, world)) for s in shapes.values()]
        state, extra = w.compensation * sum(sizes), 0
        for name, full in shapes.items():
            shape = tuple(full)
            if c.targeted(name, shape):
                rank = c.rank_of(shape)
                side = side_of(shape, c.proj_type, rank)
                extra += w.weight * basis_numel(shape, side, rank, world)
                shape = lowrank_shape(shape, side, rank)
            state += state_bytes(row_share(shape, world), "adamw", 0, None, w.state)
        return MemoryEstimate(w.weight * sum(sizes), grad_bytes(sizes, run, self.steps), state,
                              extra)
