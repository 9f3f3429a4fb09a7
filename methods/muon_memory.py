"""Muon's bytes (methods/muon.py): one momentum per hidden matrix element, half of Adam's;
the embeddings, head and vectors as AdamW keeps them. And the Newton–Schulz flops a rank
spends a step (`ns_flops_per_rank`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from harness.distributed.rows import Rows
from harness.methods.base import register_memory
from harness.methods.full_memory import adam_bytes
from harness.methods.memory import Memory, MemoryEstimate, Shapes, grad_bytes, numel
from harness.methods.muon import is_hidden, ns_flops
from harness.methods.widths import widths

if TYPE_CHECKING:
    from harness.config import RunConfig


@register_memory("muon")
class MuonMemory(Memory):
    def updated_alone(self, name: str, shape: tuple[int, ...], run: RunConfig) -> bool:
        return is_hidden(name, shape)  # orthogonalized matrix by matrix; AdamW's by chunks

    def estimate(self, shapes: Shapes, run: RunConfig) -> MemoryEstimate:
        """One momentum per hidden matrix element at the state width (and its Kahan buffer);
        the other tensors as AdamW keeps them (full's `adam_bytes`)."""
        w = widths(run)
        sizes = [numel(s) for s in shapes.values()]
        rest = [numel(s) for name, s in shapes.items() if not is_hidden(name, s)]
        hidden = sum(sizes) - sum(rest)
        states = (w.state + w.compensation) * hidden \
            + adam_bytes(0, rest, run, self.steps).optimizer_state_bytes
        return MemoryEstimate(w.weight * sum(sizes), grad_bytes(sizes, run, self.steps), states)

    def ns_flops_per_rank(self, shapes: Shapes, world: int) -> int:
        """The Newton–Schulz flops of the busiest rank a step under fsdp over `world` ranks
        (1: one process's, or every rank's under ddp): each hidden matrix orthogonalized by
        one rank, balanced as the optimizer balances them (harness/distributed/owners.py)."""
        costs = [ns_flops(s, self.config.ns_steps) for n, s in shapes.items() if is_hidden(n, s)]
        loads = [0] * world
        for cost, owner in zip(costs, Rows.assign(costs, world), strict=True):
            loads[owner] += cost
        return max(loads)
