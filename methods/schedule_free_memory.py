"""Schedule-Free AdamW's bytes (methods/schedule_free.py): z and the second moment of every
trained element, in the weights' dtype (schedulefree keeps no step tensor: its counters are
the groups' numbers)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from harness.methods.base import register_memory
from harness.methods.memory import Memory, MemoryEstimate, Shapes, grad_bytes, numel
from harness.methods.widths import widths

if TYPE_CHECKING:
    from harness.config import RunConfig


@register_memory("schedule_free")
class ScheduleFreeMemory(Memory):
    def update_bytes(self, shapes: Shapes, run: RunConfig) -> int:
        """The package's foreach step makes the denominators of every tensor it steps at once
        (`torch._foreach_div`), at the weights' width: all of them, or one layer-wise."""
        sizes = [numel(s) for s in shapes.values()]
        return widths(run).weight * (max(sizes) if run.memory.layerwise else sum(sizes))

    def estimate(self, shapes: Shapes, run: RunConfig) -> MemoryEstimate:
        """Two states per element at the weight's width (bf16-true is refused)."""
        w = widths(run)
        n = sum(numel(s) for s in shapes.values())
        return MemoryEstimate(w.weight * n, grad_bytes([numel(s) for s in shapes.values()],
                                                       run, self.steps), 2 * w.weight * n)
