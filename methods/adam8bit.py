"""8-bit AdamW from bitsandbytes: blockwise-quantized moments (Dettmers et al., 2022)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from pydantic import Field

from harness.methods.base import Groups, Method, Terms, register
from harness.methods.full import AdamConfig
from harness.methods.galore_optim import GaLoreOptimizer
from harness.modifiers.compensation import own_optimizer_kwargs
from harness.modifiers.offload import repaged_on_load

if TYPE_CHECKING:
    from harness.config import RunConfig


class Adam8bitConfig(AdamConfig):
    min_8bit_size: int = Field(4096, ge=1, description="smaller tensors keep 32-bit states")


def own_kernel(run: RunConfig) -> bool:
    """Whether GaLore's optimizer runs the 8-bit kernel instead of bitsandbytes' AdamW8bit:
    under fsdp or hsdp (on 1 process too: one checkpoint format) and bf16-true settings it
    lacks."""
    t = run.train
    return t.sharded or (t.precision == "bf16-true" and (
        t.state_dtype, t.update_compensation) != ("float32", "none"))


@register("adam8bit")
class Adam8bit(Method):
    summary = "AdamW with 8-bit blockwise moments (bitsandbytes AdamW8bit; CPU and CUDA)"
    Config = Adam8bitConfig

    def check(self, run: RunConfig) -> Terms:
        """8-bit Adam shards: bitsandbytes' blockwise kernel (the one GaLore's optimizer runs
        unprojected) on each rank's rows, whose blocks are the whole tensor's where every shard
        is the same whole number of 256-value blocks (GaLoreOptimizer checks as it is built)."""
        return Terms(fsdp=None)

    def optimizer(self, groups: Groups, run: RunConfig) -> torch.optim.Optimizer:
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
