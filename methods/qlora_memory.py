"""QLoRA's bytes (methods/qlora.py): the packed NF4 codes count as weights, their
quantization constants as extras (double quantization: each block's absmax itself 8-bit in
blocks of 256, with a float32 absmax per such block, a 256-entry float32 map and an offset)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from harness.methods.base import register_memory
from harness.methods.full_memory import adam_bytes
from harness.methods.lora_memory import LoraMemory, LoraShapes
from harness.methods.memory import MemoryEstimate, Shapes, tensor_bytes
from harness.methods.qlora import quant_tensors

if TYPE_CHECKING:
    from harness.config import RunConfig

NESTED_BLOCK = 256  # bitsandbytes quantizes the absmax values in blocks of 256
NF4_CODE = 16  # float32 entries of the NF4 code
NESTED_CODE = 256  # float32 entries of the 8-bit dynamic map for the absmax values


@register_memory("qlora")
class QLoraMemory(LoraMemory):
    def estimate(self, shapes: Shapes, run: RunConfig) -> MemoryEstimate:
        s = LoraShapes(shapes, self.config)
        packed = [math.ceil(out * inp / 2) for out, inp in s.target_weights]
        biases = sum(s.frozen) - sum(out * inp for out, inp in s.target_weights)
        counted = adam_bytes(biases + sum(s.others + s.adapters), s.trainable, run, self.steps,
                             sum(packed))
        counted.extra_bytes = sum(self._constants_bytes(out * inp) for out, inp in s.target_weights)
        return counted

    def _constants_bytes(self, n: int) -> int:
        """uint8 absmax per block; float32 absmax per 256 of those, offset, and both maps."""
        blocks = math.ceil(n / self.config.block_size)
        return blocks + 4 * (math.ceil(blocks / NESTED_BLOCK) + 1 + NESTED_CODE + NF4_CODE)

    def measure(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> MemoryEstimate:
        import bitsandbytes as bnb

        counted = super().measure(model, optimizer)
        constants = {
            t.data_ptr(): t
            for m in model.modules()
            if isinstance(m, bnb.nn.Linear4bit)
            for t in quant_tensors(m.weight.quant_state)
        }
        counted.extra_bytes = tensor_bytes(list(constants.values()))
        return counted
