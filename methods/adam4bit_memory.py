"""4-bit AdamW's bytes (methods/adam4bit.py): per quantized tensor two moments of codes (4 bits
a value for int4, 8 for int8 and fp8), a float32 scale per block and, for int4 and int8, a
float32 quantization map; smaller tensors keep two float moments; torch's float32 step per
tensor, as torchao counts steps."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from harness.methods.adam4bit import quantized
from harness.methods.base import register_memory
from harness.methods.memory import Memory, MemoryEstimate, Shapes, grad_bytes, numel, row_share
from harness.methods.widths import widths

if TYPE_CHECKING:
    from harness.config import RunConfig

CODE_BITS = {"int4": 4, "int8": 8, "fp8": 8}
QMAP_VALUES = {"int4": 16, "int8": 256, "fp8": 0}  # torchao's float32 maps (fp8: a cast)


def moment_bytes(n: int, states: str, block: int) -> int:
    """One quantized moment of `n` values: codes, a float32 scale per block, the map."""
    return n * CODE_BITS[states] // 8 + 4 * math.ceil(n / block) + 4 * QMAP_VALUES[states]


@register_memory("adam4bit")
class Adam4bitMemory(Memory):
    def update_bytes(self, shapes: Shapes, run: RunConfig) -> int:
        return 0  # torchao's step dequantizes one tensor's moments at a time inside its kernel

    def estimate(self, shapes: Shapes, run: RunConfig) -> MemoryEstimate:
        return self.estimate_sharded(shapes, run, 1)

    def estimate_sharded(self, shapes: Shapes, run: RunConfig, world: int) -> MemoryEstimate:
        """This rank's rows of each tensor; quantized where the whole tensor is large enough
        and the rows are whole blocks (`quantized`), else two moments at the state width."""
        c, w = self.config, widths(run)
        sizes = [numel(row_share(s, world)) for s in shapes.values()]
        states = 4 * len(sizes)  # torchao's float32 step per tensor
        for shape, n in zip(shapes.values(), sizes, strict=True):
            states += 2 * (moment_bytes(n, c.states, c.block) if quantized(numel(shape), n,
                                                                           c.block)
                           else w.state * n)
        return MemoryEstimate(w.weight * sum(sizes), grad_bytes(sizes, run, self.steps), states)
