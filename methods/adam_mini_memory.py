"""Adam-mini's bytes (methods/adam_mini.py): a first moment per element and one second moment
per block (head, output row or tensor), at the state width."""

from __future__ import annotations

from typing import TYPE_CHECKING

from harness.methods.adam_mini import block_count, block_kind
from harness.methods.base import register_memory
from harness.methods.memory import Memory, MemoryEstimate, Shapes, grad_bytes, numel, row_share
from harness.methods.widths import widths
from harness.models import architecture

if TYPE_CHECKING:
    from harness.config import RunConfig


@register_memory("adam_mini")
class AdamMiniMemory(Memory):
    def update_bytes(self, shapes: Shapes, run: RunConfig) -> int:
        """Its own optimizer makes each update a new float32 tensor, one weight at a time;
        under bf16-true the weight's float32 copy (`Memory.update_bytes`) beside it, and with
        bfloat16 moments the first moment's copy too."""
        if run.train.precision != "bf16-true":
            return 4 * max(numel(s) for s in shapes.values())
        copies = 2 if run.train.state_dtype == "float32" else 3
        return 4 * copies * max(numel(s) for s in shapes.values())

    def estimate(self, shapes: Shapes, run: RunConfig) -> MemoryEstimate:
        """mn + blocks state values per m×n weight at the state width, plus Kahan buffers."""
        return self.estimate_sharded(shapes, run, 1)

    def estimate_sharded(self, shapes: Shapes, run: RunConfig, world: int) -> MemoryEstimate:
        """Under fsdp the moments and row blocks by this rank's rows; head and tensor blocks
        whole on every rank (WHOLE)."""
        head_dim, w = architecture(str(run.model)).head_dim, widths(run)
        sizes = [numel(row_share(s, world)) for s in shapes.values()]
        blocks = 0
        for name, shape in shapes.items():
            kind = block_kind(name, tuple(shape))
            held = row_share(shape, world) if kind in ("element", "row") else tuple(shape)
            blocks += block_count(kind, held, head_dim)
        states = w.state * (sum(sizes) + blocks) + w.compensation * sum(sizes)
        return MemoryEstimate(w.weight * sum(sizes), grad_bytes(sizes, run, self.steps), states)
