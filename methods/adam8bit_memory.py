"""8-bit AdamW's bytes (methods/adam8bit.py): two uint8 moments with their quantization maps
and per-block absmax; `adam8bit_state_bytes` is what GaLore's and APOLLO's 8-bit inner
optimizers reuse."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from harness.methods.adam8bit import own_kernel
from harness.methods.adam_kernel import BLOCK, QMAP
from harness.methods.base import register_memory
from harness.methods.memory import Memory, MemoryEstimate, Shapes, grad_bytes, numel, row_share
from harness.methods.widths import widths

if TYPE_CHECKING:
    from harness.config import RunConfig


def adam8bit_state_bytes(n: int, min_8bit_size: int, width: int = 4) -> int:
    """8-bit Adam moments of an n-value tensor: two uint8 states, each with its float32
    quantization map and a float32 absmax per block; smaller tensors keep two moments of
    `width` bytes (bitsandbytes: float32; GaLore's kernel: train.state_dtype)."""
    if n < min_8bit_size:
        return 2 * width * n
    return 2 * (n + 4 * QMAP + 4 * math.ceil(n / BLOCK))


@register_memory("adam8bit")
class Adam8bitMemory(Memory):
    def update_bytes(self, shapes: Shapes, run: RunConfig) -> int:
        """bitsandbytes' AdamW8bit updates in place (its CPU fallback's own temporaries, five or
        six float32 copies of a tensor at bitsandbytes 0.50, are not counted: CUDA's kernel
        makes none); GaLore's optimizer in its stead as `Memory.update_bytes`, one weight at
        a time (its 8-bit kernel takes no chunks)."""
        return super().update_bytes(shapes, run) if own_kernel(run) else 0

    def updated_alone(self, name: str, shape: tuple[int, ...], run: RunConfig) -> bool:
        return True

    def estimate(self, shapes: Shapes, run: RunConfig) -> MemoryEstimate:
        return self.estimate_sharded(shapes, run, 1)

    def estimate_sharded(self, shapes: Shapes, run: RunConfig, world: int) -> MemoryEstimate:
        """This rank's rows of each tensor, 8-bit where the whole tensor is large enough."""
        w, least = widths(run), self.config.min_8bit_size
        sizes = [numel(row_share(s, world)) for s in shapes.values()]
        states = sum(adam8bit_state_bytes(n, least, w.state) if numel(s) >= least
                     else 2 * w.state * n for s, n in zip(shapes.values(), sizes, strict=True))
        states += w.compensation * sum(sizes)
        return MemoryEstimate(w.weight * sum(sizes), grad_bytes(sizes, run, self.steps), states)
