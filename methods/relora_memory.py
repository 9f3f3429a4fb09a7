"""ReLoRA's bytes (methods/relora.py): LoRA's, at step 1; with a warm start, those of its
full-rank phase."""

from __future__ import annotations

from typing import TYPE_CHECKING

from harness.methods.base import register_memory
from harness.methods.full_memory import adam_bytes
from harness.methods.lora_memory import LoraMemory, LoraShapes
from harness.methods.memory import MemoryEstimate, Shapes

if TYPE_CHECKING:
    from harness.config import RunConfig


@register_memory("relora")
class ReLoraMemory(LoraMemory):
    def estimate_sharded(self, shapes: Shapes, run: RunConfig, world: int) -> MemoryEstimate:
        """Bytes at step 1 (rank 0's rows under fsdp over `world`): with a warm start, the
        full-rank phase where the targets train (joint: with the adapters; two runs: without
        them)."""
        s = LoraShapes(shapes, self.config, world)
        trainable = s.trainable
        if self.config.warm_start_steps:
            kept = (s.others if self.config.train_non_targets else []) if (
                self.config.two_runs) else s.trainable
            trainable = kept + [out * inp for out, inp in s.target_weights]
        return adam_bytes(s.float_numel, trainable, run, self.steps)
