"""8-bit AdamW from bitsandbytes: blockwise-quantized moments (Dettmers et al., 2022)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from pydantic import Field

from harness.methods.adam_kernel import BLOCK, QMAP
from harness.methods.base import (
    Groups,
    MemoryEstimate,
    Method,
    Shapes,
    grad_bytes,
    numel,
    register,
    row_share,
)
from harness.methods.full import AdamConfig
from harness.methods.galore_optim import GaLoreOptimizer
from harness.methods.widths import widths
from harness.modifiers.compensation import own_optimizer_kwargs
from harness.modifiers.offload import repaged_on_load

if TYPE_CHECKING:
    from harness.config import RunConfig


def adam8bit_state_bytes(n: int, min_8bit_size: int, width: int = 4) -> int:
    """8-bit Adam moments of an n-value tensor: two uint8 states, each with its float32
    quantization map and a float32 absmax per block; smaller tensors keep two moments of
    `width` bytes (bitsandbytes: float32; GaLore's kernel: train.state_dtype)."""
    if n < min_8bit_size:
        return 2 * width * n
    return 2 * (n + 4 * QMAP + 4 * math.ceil(n / BLOCK))


class Adam8bitConfig(AdamConfig):
    min_8bit_size: int = Field(4096, ge=1, description="smaller tensors keep 32-bit states")


def own_kernel(run: RunConfig) -> bool:
    """Whether GaLore's optimizer runs the 8-bit kernel instead of bitsandbytes' AdamW8bit:
    under fsdp (on 1 process too: one checkpoint format) and bf16-true settings it lacks."""
    t = run.train
    return t.parallel == "fsdp" or (t.precision == "bf16-true" and (
        t.state_dtype, t.update_compensation) != ("float32", "none"))


@register("adam8bit")
class Adam8bit(Method):
    summary = "AdamW with 8-bit blockwise moments (bitsandbytes AdamW8bit; CPU and CUDA)"
    Config = Adam8bitConfig

    def build_optimizer(self, groups: Groups, run: RunConfig) -> torch.optim.Optimizer:
        """bitsandbytes' AdamW8bit, which rounds its bf16-true update to nearest and keeps small
        tensors' states in float32; any other bf16-true setting, and `train.parallel: fsdp`
        (whose shards bitsandbytes' optimizer cannot take; on any number of processes, so that
        its checkpoints resume at any), runs the same 8-bit blockwise kernel in GaLore's
        optimizer (no projection), which honours both keys."""
        c, t = self.config, run.train
        if own_kernel(run):
            return GaLoreOptimizer(groups, lr=t.lr, betas=c.betas, eps=c.eps, inner="adam8bit",
                                   min_8bit_size=c.min_8bit_size, **own_optimizer_kwargs(t))
        import bitsandbytes as bnb

        kwargs = {"lr": t.lr, "betas": c.betas, "eps": c.eps, "min_8bit_size": c.min_8bit_size}
        if run.memory.optimizer_offload == "paged":
            return repaged_on_load(bnb.optim.PagedAdamW8bit(groups, **kwargs))
        return bnb.optim.AdamW8bit(groups, **kwargs)

    def update_bytes(self, shapes: Shapes, run: RunConfig) -> int:
        """bitsandbytes' AdamW8bit updates in place (its CPU fallback's own temporaries, five or
        six float32 copies of a tensor at bitsandbytes 0.50, are not counted: CUDA's kernel
        makes none); GaLore's optimizer in its stead as `Method.update_bytes`."""
        return super().update_bytes(shapes, run) if own_kernel(run) else 0

    def fsdp_refusal(self, run: RunConfig) -> str | None:
        """8-bit Adam shards: bitsandbytes' blockwise kernel (the one GaLore's optimizer runs
        unprojected) on each rank's rows, whose blocks are the whole tensor's where every shard
        is the same whole number of 256-value blocks (GaLoreOptimizer checks as it is built)."""
        return None

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
