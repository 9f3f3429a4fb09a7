"""SinkGD's bytes (methods/sinkgd.py): no state for a hidden matrix (its Kahan buffer under
bf16-true with compensation); the embeddings, head and vectors as AdamW keeps them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from harness.methods.base import register_memory
from harness.methods.full_memory import adam_bytes
from harness.methods.memory import Memory, MemoryEstimate, Shapes, grad_bytes, numel
from harness.methods.muon import is_hidden
from harness.methods.widths import widths

if TYPE_CHECKING:
    from harness.config import RunConfig


@register_memory("sinkgd")
class SinkGDMemory(Memory):
    def updated_alone(self, name: str, shape: tuple[int, ...], run: RunConfig) -> bool:
        return is_hidden(name, shape)  # normalized matrix by matrix; AdamW's by chunks

    def estimate(self, shapes: Shapes, run: RunConfig) -> MemoryEstimate:
        w = widths(run)
        sizes = [numel(s) for s in shapes.values()]
        rest = [numel(s) for name, s in shapes.items() if not is_hidden(name, s)]
        hidden = sum(sizes) - sum(rest)
        states = w.compensation * hidden \
            + adam_bytes(0, rest, run, self.steps).optimizer_state_bytes
        return MemoryEstimate(w.weight * sum(sizes), grad_bytes(sizes, run, self.steps), states)
