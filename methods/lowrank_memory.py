"""Low-rank's bytes (methods/lowrank.py): AdamW's over the trained tensors after `prepare`,
each targeted linear's weight replaced by its two rank-r factors."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from harness.methods.base import register_memory
from harness.methods.full_memory import FullMemory, adam_bytes
from harness.methods.lowrank import check_found
from harness.methods.memory import MemoryEstimate, Shapes, numel, row_share, update_bytes
from harness.methods.surgery import is_target

if TYPE_CHECKING:
    from harness.config import RunConfig


@register_memory("lowrank")
class LowRankMemory(FullMemory):
    linears = "factored"
    bench: ClassVar[dict[str, Any]] = {"rank": 16}

    def estimate(self, shapes: Shapes, run: RunConfig) -> MemoryEstimate:
        return self.estimate_sharded(shapes, run, 1)

    def estimate_sharded(self, shapes: Shapes, run: RunConfig, world: int) -> MemoryEstimate:
        sizes = self._trained(shapes, world)
        return adam_bytes(sum(sizes), sizes, run, self.steps)  # as in full

    def update_bytes(self, shapes: Shapes, run: RunConfig) -> int:
        return update_bytes(self._trained(shapes), run)

    def _trained(self, shapes: Shapes, world: int = 1) -> list[int]:
        """One entry per trained tensor after `prepare`, two factors for each targeted linear:
        rank 0's ceil(m / world) rows of each under fsdp over `world` (1: whole)."""
        r, targets = self.config.rank, self.config.target_modules
        sizes: list[int] = []
        found = set()
        for name, shape in shapes.items():
            module, _, leaf = name.rpartition(".")
            if leaf == "weight" and len(shape) == 2 and is_target(module, targets):
                found.add(module.rsplit(".", 1)[-1])
                out_features, in_features = shape
                sizes += [numel(row_share(f, world)) for f in ((r, in_features), (out_features, r))]
            else:
                sizes.append(numel(row_share(shape, world)))
        check_found(self.config, found)
        return sizes
