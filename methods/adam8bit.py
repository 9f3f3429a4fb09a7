"""8-bit AdamW from bitsandbytes: blockwise-quantized moments (Dettmers et al., 2022)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from pydantic import Field

from harness.methods.base import Groups, MemoryEstimate, Method, Shapes, grad_bytes, numel, register
from harness.methods.full import AdamConfig
from harness.methods.widths import widths

if TYPE_CHECKING:
    from harness.config import RunConfig

BLOCK = 256  # bitsandbytes' block size for 8-bit optimizer states
QMAP = 256  # entries in each state's float32 quantization map


def adam8bit_state_bytes(n: int, min_8bit_size: int) -> int:
    """bitsandbytes' 8-bit Adam moments of an n-value tensor: two uint8 states, each with its
    float32 quantization map and a float32 absmax per block; smaller tensors stay 32-bit."""
    if n < min_8bit_size:
        return 8 * n
    return 2 * (n + 4 * QMAP + 4 * math.ceil(n / BLOCK))


class Adam8bitConfig(AdamConfig):
    min_8bit_size: int = Field(4096, ge=1, description="smaller tensors keep 32-bit states")


@register("adam8bit")
class Adam8bit(Method):
    summary = "AdamW with 8-bit blockwise moments (bitsandbytes AdamW8bit; CPU and CUDA)"
    Config = Adam8bitConfig

    def build_optimizer(self, groups: Groups, run: RunConfig) -> torch.optim.Optimizer:
        import bitsandbytes as bnb

        paged = run.memory.optimizer_offload == "paged"
        return (bnb.optim.PagedAdamW8bit if paged else bnb.optim.AdamW8bit)(
            groups,
            lr=run.train.lr,
            betas=self.config.betas,
            eps=self.config.eps,
            min_8bit_size=self.config.min_8bit_size,
        )

    def refusal(self, run: RunConfig) -> str | None:
        t = run.train
        if t.precision != "bf16-true":
            return None
        if t.update_compensation != "none":
            return ("bitsandbytes' AdamW8bit adds its update to a bf16 weight inside its kernel, "
                    "rounded to nearest (torchao's AdamW8bit(bf16_stochastic_round=True) runs on "
                    "CPU but compiles per parameter shape, ~9 s each, and has no Kahan form): "
                    "use train.update_compensation: none")
        if t.state_dtype != "float32":
            return ("bitsandbytes keeps the 32-bit states (tensors under min_8bit_size) in "
                    "float32: use train.state_dtype: float32")
        return None

    def estimate(self, shapes: Shapes, run: RunConfig) -> MemoryEstimate:
        sizes, w = [numel(s) for s in shapes.values()], widths(run)
        states = sum(adam8bit_state_bytes(n, self.config.min_8bit_size) for n in sizes)
        states += w.compensation * sum(sizes)
        return MemoryEstimate(w.weight * sum(sizes), grad_bytes(sizes, run, self.steps), states)
