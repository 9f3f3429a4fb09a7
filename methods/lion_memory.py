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
        """One weight at a time: the float32 update beside the gradient's float32 copy and the
        momentum's (bf16-true, bfloat16 states), then beside what adding it takes: nothing
        into a float32 weight; `add_update`'s weight copy with a compensation; into a bfloat16
        weight in place, a CPU's float32 copies of the weight and of the sum (CUDA casts as
        it goes)."""
        t, largest = run.train, max(numel(s) for s in shapes.values())
        if t.precision != "bf16-true":
            return 4 * largest  # the update alone
        making = 3 if t.state_dtype == "bfloat16" else 2  # gradient, (momentum,) update
        if t.update_compensation != "none":
            return 4 * max(making, 2) * largest  # add_update: the weight's copy beside it
        in_place = 3 if run.device == "cpu" else 1  # a CPU copies weight and sum; CUDA none
        return 4 * max(making, in_place) * largest

    def estimate(self, shapes: Shapes, run: RunConfig) -> MemoryEstimate:
        w = widths(run)
        sizes = [numel(s) for s in shapes.values()]
        states = (w.state + w.compensation) * sum(sizes)
        return MemoryEstimate(w.weight * sum(sizes), grad_bytes(sizes, run, self.steps), states)
