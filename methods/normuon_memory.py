"""NorMuon's bytes (methods/normuon.py): Muon's (methods/muon_memory.py) and one row second
moment per row of each hidden matrix, at the state width."""

from __future__ import annotations

from typing import TYPE_CHECKING

from harness.methods.base import register_memory
from harness.methods.memory import MemoryEstimate, Shapes
from harness.methods.muon import is_hidden
from harness.methods.muon_memory import MuonMemory
from harness.methods.widths import widths

if TYPE_CHECKING:
    from harness.config import RunConfig


@register_memory("normuon")
class NorMuonMemory(MuonMemory):
    def estimate(self, shapes: Shapes, run: RunConfig) -> MemoryEstimate:
        """Muon's estimate and m values of an m×n hidden matrix (under fsdp, of its rows:
        `estimate_sharded` passes the shards' shapes)."""
        muon = super().estimate(shapes, run)
        rows = sum(s[0] for name, s in shapes.items() if is_hidden(name, s))
        muon.optimizer_state_bytes += widths(run).state * rows
        return muon
