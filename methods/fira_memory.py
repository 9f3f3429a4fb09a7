"""Fira's bytes (methods/fira.py): GaLore's, plus the norm-growth limiter's float32 scalar per
projected matrix."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from harness.methods.base import register_memory
from harness.methods.galore_memory import GaLoreMemory
from harness.methods.memory import MemoryEstimate, Shapes
from harness.methods.projection import side_of

if TYPE_CHECKING:
    from harness.config import RunConfig

LIMITER_BYTES = 4  # ‖S‖ of the last step: one float32 per projected matrix


@register_memory("fira")
class FiraMemory(GaLoreMemory):
    def estimate_sharded(self, shapes: Shapes, run: RunConfig, world: int) -> MemoryEstimate:
        """GaLore's bytes (mr basis, 2nr moments) plus the limiter's scalar per projected
        matrix (whole on every rank under fsdp)."""
        c, base = self.config, super().estimate_sharded(shapes, run, world)
        projected = sum(1 for name, full in shapes.items() if c.targeted(name, tuple(full))
                        and side_of(tuple(full), c.proj_type, c.rank) != "none")
        return replace(base, optimizer_state_bytes=base.optimizer_state_bytes
                       + LIMITER_BYTES * projected)
