"""LoRA's bytes (methods/lora.py): the frozen base at the run's width, adapters and (by
default) the tensors outside the targets trained by AdamW. ReLoRA and QLoRA build on
`LoraShapes`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from harness.methods.base import register_memory
from harness.methods.full_memory import adam_bytes
from harness.methods.lora import LoraParams
from harness.methods.memory import (
    Memory,
    MemoryEstimate,
    Shapes,
    numel,
    row_share,
    update_bytes,
)
from harness.methods.surgery import is_target

if TYPE_CHECKING:
    from harness.config import RunConfig


class LoraShapes:
    """The base model's shapes split into target weights and the rest, plus the adapters' sizes
    and the tensors AdamW trains: rank 0's share under fsdp over `world` ranks (ceil(m / world)
    rows of every tensor, each adapter factor's own rows included; 1: whole)."""

    def __init__(self, shapes: Shapes, config: LoraParams, world: int = 1) -> None:
        targets = {n: s for n, s in shapes.items()
                   if is_target(n.rpartition(".")[0], config.target_modules)}
        self.target_weights = [tuple(row_share(s, world)) for n, s in targets.items()
                               if n.endswith(".weight")]
        self.frozen = [numel(row_share(s, world)) for s in targets.values()]
        self.others = [numel(row_share(s, world)) for n, s in shapes.items() if n not in targets]
        r = config.rank
        weights = [tuple(s) for n, s in targets.items() if n.endswith(".weight")]  # no biases
        self.adapters = [numel(row_share(factor, world))  # A (r × in) and B (out × r)
                         for out, inp in weights for factor in ((r, inp), (out, r))]
        self.trainable = self.adapters + (self.others if config.train_non_targets else [])
        self.float_numel = sum(self.frozen + self.others + self.adapters)


@register_memory("lora")
class LoraMemory(Memory):
    linears = "adapter"
    bench: ClassVar[dict[str, Any]] = {"rank": 8}

    def estimate(self, shapes: Shapes, run: RunConfig) -> MemoryEstimate:
        return self.estimate_sharded(shapes, run, 1)

    def estimate_sharded(self, shapes: Shapes, run: RunConfig, world: int) -> MemoryEstimate:
        s = LoraShapes(shapes, self.config, world)
        return adam_bytes(s.float_numel, s.trainable, run, self.steps)

    def update_bytes(self, shapes: Shapes, run: RunConfig) -> int:
        return update_bytes(LoraShapes(shapes, self.config).trainable, run)
