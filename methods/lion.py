"""Lion (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms", arXiv 2302.06675):
the sign of an interpolation of the momentum and the gradient, one state (the momentum) per
element, half of Adam's. The paper's Program 1, on every trained parameter:

    update = sign(β1·m + (1 − β1)·g)
    θ ← θ − lr·(update + λ·θ)             (decoupled decay)
    m ← β2·m + (1 − β2)·g

Our own optimizer, not the reference package's (`pytorch_optimizer.Lion`, which the tests
check it against step for step): the update is three elementwise lines, and the harness needs
what the package does not do: a float32 momentum for a bfloat16 weight (bf16-true's
`state_dtype`), the update added with stochastic rounding or Kahan compensation, and FSDP's
row shards (elementwise: each rank steps its own rows, through `Rows`, with no collective).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from harness.config import Strict
from harness.config.tuning import tunable
from harness.distributed.rows import Rows
from harness.methods.base import Groups, Method, Terms, register, unpaged
from harness.modifiers.compensation import ParamwiseOptimizer, add_update, own_optimizer_kwargs

if TYPE_CHECKING:
    from harness.config import RunConfig


class LionConfig(Strict):
    betas: tuple[float, float] = tunable(
        (0.9, 0.99), values=[(0.9, 0.98), (0.9, 0.99), (0.95, 0.98)],
        description="β1: the update's interpolation, β2: the momentum's decay "
        "(arXiv 2302.06675 §5's defaults, pytorch_optimizer.Lion's; §5 takes (0.95, 0.98) for "
        "language models)", source="§5's defaults and its language-model betas")


class LionOptimizer(ParamwiseOptimizer):
    """Lion over whole or row-sharded tensors: momentum (`exp_avg`, the reference's name) in
    `state_dtype` (None: the weight's), the update added with `compensation` (bf16-true)."""

    def __init__(self, params: Iterable[Any], *, lr: float,
                 betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0,
                 state_dtype: torch.dtype | None = None, compensation: str = "none") -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})
        self.dtype, self.compensation = state_dtype, compensation

    def _update(self, group: dict[str, Any], p: Tensor) -> None:
        (b1, b2), lr, wd = group["betas"], group["lr"], group["weight_decay"]
        st = self.state[p]
        if not st:  # placed as the weight is: under fsdp, this rank's rows of a DTensor
            st["exp_avg"] = torch.zeros_like(p, dtype=self.dtype or p.dtype)
        g = Rows(p.grad).local.float()
        kept = Rows(st["exp_avg"]).local
        m = kept.float()  # the state itself when float32
        update = m.lerp(g, 1 - b1).sign_()
        m.lerp_(g, 1 - b2)
        if m is not kept:
            kept.copy_(m)
        del g, m  # each float32 temporary goes as soon as it is used: see add_update
        w = Rows(p).local
        if w.dtype != torch.bfloat16 or self.compensation == "none":
            w.mul_(1 - lr * wd)  # the reference's order: decay, then the signed step
            w.add_(update, alpha=-lr)
            return
        add_update(w, update.mul_(-lr), self.compensation, st, lr * wd)


@register("lion")
class Lion(Method):
    summary = "Lion: the sign of an interpolated momentum, one state per element"
    Config = LionConfig

    def check(self, run: RunConfig) -> Terms:
        # fsdp: elementwise, so each rank steps its own rows of every tensor
        return Terms(refusal=unpaged(run, "momentum", one=True), fsdp=None)

    def optimizer(self, groups: Groups, run: RunConfig) -> torch.optim.Optimizer:
        return LionOptimizer(groups, lr=run.train.lr, betas=self.config.betas,
                             **own_optimizer_kwargs(run.train))
