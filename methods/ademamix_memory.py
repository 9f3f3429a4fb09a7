"""AdEMAMix's bytes (methods/ademamix.py): three moments of every trained element (fast EMA,
second moment, slow EMA) at the state width, plus Kahan buffers; its step counts are Python
integers."""

from __future__ import annotations

from typing import TYPE_CHECKING

from harness.methods.base import register_memory
from harness.methods.memory import Memory, MemoryEstimate, Shapes, grad_bytes, numel
from harness.methods.widths import widths

if TYPE_CHECKING:
    from harness.config import RunConfig


@register_memory("ademamix")
class AdEMAMixMemory(Memory):
    def update_bytes(self, shapes: Shapes, run: RunConfig) -> int:
        """Its own optimizer computes each update in float32, one weight at a time: two float32
        tensors of the largest weight's size alive at once (the denominator and the update;
        under bf16-true the update and the weight's copy), four with bfloat16 moments (the
        three moments' float32 copies and the denominator)."""
        bf16_states = run.train.precision == "bf16-true" and run.train.state_dtype == "bfloat16"
        return 4 * (4 if bf16_states else 2) * max(numel(s) for s in shapes.values())

    def estimate(self, shapes: Shapes, run: RunConfig) -> MemoryEstimate:
        w = widths(run)
        sizes = [numel(s) for s in shapes.values()]
        states = (3 * w.state + w.compensation) * sum(sizes)
        return MemoryEstimate(w.weight * sum(sizes), grad_bytes(sizes, run, self.steps), states)
