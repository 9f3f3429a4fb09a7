"""AdEMAMix (Pagliardini, Ablin and Grangier, 2024, "The AdEMAMix Optimizer: Better, Faster,
Older", arXiv 2409.03137): AdamW with a second, slow EMA of the gradients (decay β3, no bias
correction) added to the fast one with weight α; α and β3 warm up over T_α,β3 steps (the
paper's Algorithm 1 and its schedulers f_α, f_β3 from β_start = β1).

Our own optimizer, as the paper's Algorithm 1 with decoupled weight decay (λ·lr·θ, as the
authors' apple/ml-ademamix code): arithmetic in float32 whatever the weights' dtype, so that
bf16-true honours `train.state_dtype` and `train.update_compensation`
(modifiers/compensation.py), which pytorch-optimizer's AdEMAMix (the test's reference) does
not; every operation is elementwise, so FSDP's row shards take it unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from pydantic import Field
from torch import Tensor

from harness.config import Strict
from harness.config.tuning import tunable
from harness.methods.base import Groups, Method, Terms, register, unpaged
from harness.modifiers.compensation import (
    ParamwiseOptimizer,
    add_update,
    keep_rounded,
    own_optimizer_kwargs,
)

if TYPE_CHECKING:
    from harness.config import RunConfig

STATES = ("exp_avg", "exp_avg_sq", "exp_avg_slow")  # m1, ν, m2


class AdEMAMixConfig(Strict):
    betas: tuple[float, float, float] = Field(
        (0.9, 0.999, 0.9999), description="β1 (fast EMA), β2 (second moment), β3 (slow EMA): "
        "the paper's LLM experiments, pytorch-optimizer's defaults")
    alpha: float = tunable(
        8.0, values=[4.0, 6.0, 8.0, 10.0], ge=0, description="weight of the slow EMA in the "
        "update: 8, the paper's LLM runs (it sweeps 4 to 10; pytorch-optimizer's default 5)",
        source="the paper's sweep of α, 4 to 10")
    eps: float = Field(1e-8, gt=0, description="added to the second moment's root")
    t_alpha_beta3: int | None = Field(
        None, ge=0, description="steps over which α rises from 0 and β3 from β1 (the paper's "
        "T_α,β3); None: the run's train.steps, as the paper sets it (T); 0: no warmup")


def alpha_at(step: int, alpha: float, warmup: int) -> float:
    """f_α: α·t/T during the warmup, then α (the paper's linear scheduler)."""
    return alpha if not warmup else min(step * alpha / warmup, alpha)


def beta3_at(step: int, beta1: float, beta3: float, warmup: int) -> float:
    """f_β3: β3 rising from β1 so that the slow EMA's half-life grows linearly (the paper's
    scheduler, from β_start = β1), then β3."""
    if not warmup:
        return beta3
    a, b, t = math.log(beta1), math.log(beta3), step / warmup
    return min(math.exp(a * b / ((1 - t) * b + t * a)), beta3)


class AdEMAMix(ParamwiseOptimizer):
    """AdEMAMix over groups; states in `state_dtype` (None: the weight's dtype), the update
    added by `add_update` with `compensation` (bf16-true)."""

    def __init__(self, params: Iterable[Any], *, lr: float,
                 betas: tuple[float, float, float] = (0.9, 0.999, 0.9999), alpha: float = 8.0,
                 eps: float = 1e-8, weight_decay: float = 0.0, warmup: int = 0,
                 state_dtype: torch.dtype | None = None, compensation: str = "none") -> None:
        defaults = {"lr": lr, "betas": betas, "alpha": alpha, "eps": eps,
                    "weight_decay": weight_decay, "warmup": warmup}
        super().__init__(params, defaults)
        self.dtype, self.compensation = state_dtype, compensation

    def _update(self, group: dict[str, Any], p: Tensor) -> None:
        (b1, b2, b3), lr, warmup = group["betas"], group["lr"], group["warmup"]
        st = self.state[p]
        if not st:
            st["step"] = 0
            for key in STATES:
                st[key] = torch.zeros_like(p, dtype=self.dtype or p.dtype)
        st["step"] += 1
        t = st["step"]
        g = p.grad.float()
        fast = st["exp_avg"].float().lerp_(g, 1 - b1)  # the state itself when float32
        slow = st["exp_avg_slow"].float().lerp_(g, 1 - beta3_at(t, b1, b3, warmup))
        v = st["exp_avg_sq"].float().mul_(b2).addcmul_(g, g, value=1 - b2)
        del g  # each float32 temporary goes as soon as it is used: see add_update
        keep_rounded(st, {"exp_avg": fast, "exp_avg_slow": slow, "exp_avg_sq": v})
        denom = v.sqrt().div_(math.sqrt(1 - b2 ** t)).add_(group["eps"])
        del v
        update = fast.div(1 - b1 ** t).add_(slow, alpha=alpha_at(t, group["alpha"], warmup))
        del fast, slow
        update.div_(denom).mul_(-lr)
        del denom
        add_update(p, update, self.compensation, st, lr * group["weight_decay"])


@register("ademamix")
class AdEMAMixMethod(Method):
    summary = "AdEMAMix: AdamW plus a slow gradient EMA (β3, α) warmed up over the run"
    Config = AdEMAMixConfig

    def check(self, run: RunConfig) -> Terms:
        # fsdp: elementwise, each rank updates its rows
        return Terms(refusal=unpaged(run, "three moments"), fsdp=None)

    def optimizer(self, groups: Groups, run: RunConfig) -> torch.optim.Optimizer:
        c = self.config
        warmup = run.train.steps if c.t_alpha_beta3 is None else c.t_alpha_beta3
        return AdEMAMix(groups, lr=run.train.lr, betas=c.betas, alpha=c.alpha, eps=c.eps,
                        warmup=warmup, **own_optimizer_kwargs(run.train))
