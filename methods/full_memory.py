"""Full-rank AdamW's bytes (methods/full.py): weights, gradients and two moments of every
trained element; `adam_bytes` is the arithmetic every AdamW-trained method reuses."""

from __future__ import annotations

from typing import TYPE_CHECKING

from harness.methods.base import register_memory
from harness.methods.memory import Memory, MemoryEstimate, Shapes, grad_bytes, numel
from harness.methods.widths import widths

if TYPE_CHECKING:
    from harness.config import RunConfig
    from harness.config.steps import Steps


def adam_bytes(float_numel: int, trainable: list[int], run: RunConfig, steps: Steps,
               other_bytes: int = 0) -> MemoryEstimate:
    """AdamW's bytes: `float_numel` float weights (and `other_bytes` of codes) at the run's
    width, its gradients, two moments in the state dtype, torch's float32 step per trained
    tensor (bf16-true's AdamW counts steps in a Python int) and, with Kahan summation, a bf16
    compensation per trained element (methods/widths.py)."""
    w, n = widths(run), sum(trainable)
    step = 0 if run.train.precision == "bf16-true" else 4  # full.adamw picks the optimizer
    states = (2 * w.state + w.compensation) * n + step * len(trainable)
    return MemoryEstimate(w.weight * float_numel + other_bytes,
                          grad_bytes(trainable, run, steps), states)


@register_memory("full")
class FullMemory(Memory):
    def estimate(self, shapes: Shapes, run: RunConfig) -> MemoryEstimate:
        sizes = [numel(s) for s in shapes.values()]
        return adam_bytes(sum(sizes), sizes, run, self.steps)
