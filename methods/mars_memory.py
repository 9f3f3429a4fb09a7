"""MARS's bytes (methods/mars.py): two moments per element at the state width, and on the
matrices (every tensor under `optimize_1d`) the previous gradient at the gradient's width."""

from __future__ import annotations

from typing import TYPE_CHECKING

from harness.methods.base import register_memory
from harness.methods.memory import Memory, MemoryEstimate, Shapes, grad_bytes, numel
from harness.methods.widths import widths

if TYPE_CHECKING:
    from harness.config import RunConfig


@register_memory("mars")
class MarsMemory(Memory):
    def update_bytes(self, shapes: Shapes, run: RunConfig) -> int:
        """The largest tensor's float32 temporaries at once: the corrected gradient c (then the
        denominator, which becomes the update); bf16-true adds the gradient's float32 copy
        beside c (then the weight's beside the update), and bfloat16 moments their float32
        copies beside both."""
        t = run.train
        copies = 1 if t.precision != "bf16-true" else 2 if t.state_dtype == "float32" else 4
        return 4 * copies * max(numel(s) for s in shapes.values())

    def estimate(self, shapes: Shapes, run: RunConfig) -> MemoryEstimate:
        """(2·state + compensation)·n over every element, plus grad-width bytes per matrix
        element for g_{t−1}."""
        w = widths(run)
        sizes = [numel(s) for s in shapes.values()]
        corrected = sum(numel(s) for s in shapes.values()
                        if len(s) >= 2 or self.config.optimize_1d)
        states = (2 * w.state + w.compensation) * sum(sizes) + w.grad * corrected
        return MemoryEstimate(w.weight * sum(sizes), grad_bytes(sizes, run, self.steps), states)
