"""CAME's bytes (methods/came.py): an m×n matrix keeps its momentum (mn values) and row and
column statistics of the second moment and of the instability (2(m + n)); a vector its
momentum and an element-wise second moment (2n); at the state width, plus Kahan buffers."""

from __future__ import annotations

from typing import TYPE_CHECKING

from harness.methods.base import register_memory
from harness.methods.memory import Memory, MemoryEstimate, Shapes, grad_bytes, numel, row_share
from harness.methods.widths import widths

if TYPE_CHECKING:
    from harness.config import RunConfig


def state_values(shape: tuple[int, ...], held: tuple[int, ...]) -> int:
    """State values of a tensor of `shape` of which this rank holds the rows `held` (the
    whole shape unsharded): the momentum of its rows; a matrix's row statistics of its rows
    and column statistics whole (every rank holds them); a vector's second moment."""
    if len(shape) < 2:
        return 2 * numel(held)
    rows = numel(held[:-1])
    cols = numel(shape[:-2] + shape[-1:]) if len(shape) == 2 else numel(held[:-2] + held[-1:])
    return numel(held) + 2 * (rows + cols)


@register_memory("came")
class CAMEMemory(Memory):
    def update_bytes(self, shapes: Shapes, run: RunConfig) -> int:
        """Its own optimizer, one tensor at a time in float32 whatever the precision: two
        float32 tensors of the largest weight at once (G² + ε₁ and the factored inverse root;
        then the update and the instability's), three under bf16-true (the gradient's float32
        copy beside them; then the momentum's with bfloat16 states; `add_update`'s two)."""
        copies = 3 if run.train.precision == "bf16-true" else 2
        return 4 * copies * max(numel(s) for s in shapes.values())

    def estimate(self, shapes: Shapes, run: RunConfig) -> MemoryEstimate:
        return self.estimate_sharded(shapes, run, 1)

    def estimate_sharded(self, shapes: Shapes, run: RunConfig, world: int) -> MemoryEstimate:
        """Under fsdp the momentum and row statistics by this rank's rows, a matrix's column
        statistics whole."""
        w = widths(run)
        held = {name: row_share(s, world) for name, s in shapes.items()}
        sizes = [numel(h) for h in held.values()]
        values = sum(state_values(tuple(s), tuple(held[n])) for n, s in shapes.items())
        states = w.state * values + w.compensation * sum(sizes)
        return MemoryEstimate(w.weight * sum(sizes), grad_bytes(sizes, run, self.steps), states)
