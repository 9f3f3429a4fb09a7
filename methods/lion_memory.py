"""Lion's bytes (methods/lion.py): one momentum per trained element at the state width, half
of AdamW's, and its Kahan buffer under bf16-true."""

from __future__ import annotations

from typing import TYPE_CHECKING

from harness.methods.base import register_memory
from harness.methods.memory import Memory, MemoryEstimate, Shapes, grad_bytes, numel
from harness.methods.widths import widths

if TYPE_CHECKING:
    from harness.config import RunConfig


@register_memory("lion")
class LionMemory(Memory):
    def update_bytes(self, shapes: Shapes, run: RunConfig) -> int:
        """bf16-true: one weight at a time, the gradient's float32 copy and the update (and the
        momentum's float32 copy when it is bfloat16), then the update and the weight's copy
        (`add_update`)."""
        if run.train.precision != "bf16-true":
            return 0
        copies = 2 if run.train.state_dtype == "float32" else 3
        return 4 * copies * max(numel(s) for s in shapes.values())

    def estimate(self, shapes: Shapes, run: RunConfig) -> MemoryEstimate:
        w = widths(run)
        sizes = [numel(s) for s in shapes.values()]
        states = (w.state + w.compensation) * sum(sizes)
        return MemoryEstimate(w.weight * sum(sizes), grad_bytes(sizes, run, self.steps), states)
