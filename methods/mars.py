"""MARS (Yuan et al., 2024, "MARS: Unleashing the Power of Variance Reduction for Training Large
Models", arXiv 2411.10438), its AdamW form: AdamW fed a variance-reduced gradient
c_t = g_t + γ·β1/(1−β1)·(g_t − g_{t−1}), clipped to unit norm (Algorithm 1, Clip(c_t, 1)), on
every matrix; plain AdamW, with its own betas, LR and decay, on the vectors (norms, biases).

This is MARS-approx (the paper's approximate variant, the authors' default `is_approx=True`):
g_{t−1} is the previous step's gradient on the previous batch, kept as one more state per matrix
element (`last_grad`), where exact MARS would take a second gradient of the previous weights on
the current batch. Embeddings and the head are matrices: MARS trains them as the others
(AGI-Arena/MARS `MARS/optimizers/mars.py`: `is_grad_2d`; pytorch-optimizer's `MARS` alike).

The arithmetic is the authors' (`update_fn`: the denominator √v/√(1−β2^t) + ε, times
1−β1^t; decoupled decay), which pytorch-optimizer's `MARS(mars_type="adamw")` follows but for
where it adds ε (before the bias correction) and a guard of its own under the root
(docs/fidelity.md#mars). Written here per parameter so that it keeps bf16-true's float32 states
and compensated update (modifiers/compensation.py) and takes fsdp's row shards: the clip norm
of a matrix is its whole norm, each rank's sum of squares summed over the ranks that split it
(`Rows.sum`). The test checks it against the package step for step, its ε re-expressed as the
authors' (tests/methods/test_mars.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from pydantic import Field
from torch import Tensor, nn

from harness.config.tuning import tunable
from harness.distributed.rows import Rows
from harness.methods.base import Groups, Method, Terms, register, unpaged
from harness.methods.full import AdamConfig
from harness.modifiers.compensation import (
    ParamwiseOptimizer,
    add_update,
    keep_rounded,
    own_optimizer_kwargs,
)

if TYPE_CHECKING:
    from harness.config import RunConfig


class MarsConfig(AdamConfig):
    betas: tuple[float, float] = Field(
        (0.95, 0.99), description="β1, β2 of the matrices' moments (MARS/train_mars.py and "
        "config/train_gpt2_*_mars.py: beta1 0.95, beta2 0.99)")
    gamma: float = tunable(0.025, values=[0.0125, 0.025, 0.05], ge=0,
                           description="γ: the strength of the gradient correction "
                           "(config/train_gpt2_*_mars.py: gamma 0.025)",
                           source="halves and doubles of the configs' γ")
    optimize_1d: bool = Field(
        False, description="vectors take MARS too, not AdamW (MARS/optimizers/mars.py: "
        "optimize_1d=False)")
    lr_1d_factor: float = Field(
        1.0, gt=0, description="the vectors' LR over train.lr (MARS/optimizers/mars.py: "
        "lr_1d_factor = lr_1d / lr, 1 at its defaults; config/train_gpt2_*_mars.py: 0.5)")
    betas_1d: tuple[float, float] = Field(
        (0.9, 0.95), description="the vectors' AdamW betas (MARS/train_mars.py: betas_1d)")
    weight_decay_1d: float = Field(
        0.1, ge=0, description="the vectors' decoupled decay (MARS/train_mars.py: "
        "weight_decay_1d 0.1); the matrices take train.weight_decay")


def vector_step(p: Tensor, optimize_1d: bool) -> bool:
    """Whether the reference steps `p` with plain AdamW: a vector, unless `optimize_1d`."""
    return p.dim() < 2 and not optimize_1d


class MarsOptimizer(ParamwiseOptimizer):
    """MARS-AdamW on groups with `mars` true, AdamW on the others; moments in `state_dtype`
    (None: the weight's), the previous gradient in the gradient's dtype (a copy, exact), the
    update added by `add_update` with `compensation`."""

    def __init__(self, params: Iterable[Any], *, lr: float, betas: tuple[float, float],
                 eps: float, gamma: float, state_dtype: torch.dtype | None = None,
                 compensation: str = "none") -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "gamma": gamma,
                                  "weight_decay": 0.0, "mars": True})
        self.dtype, self.compensation = state_dtype, compensation

    def _update(self, group: dict[str, Any], p: Tensor) -> None:
        (b1, b2), lr, mars = group["betas"], group["lr"], group["mars"]
        st = self.state[p]
        if not st:  # placed as the weight is: under fsdp, this rank's rows of a DTensor
            st["step"] = 0
            st["exp_avg"] = torch.zeros_like(p, dtype=self.dtype or p.dtype)
            st["exp_avg_sq"] = torch.zeros_like(p, dtype=self.dtype or p.dtype)
            if mars:
                st["last_grad"] = torch.zeros_like(p.grad)
        st["step"] += 1
        g = Rows(p.grad).local.float()
        c = _corrected(p, g, st, group) if mars else g
        kept = {k: Rows(st[k]).local for k in ("exp_avg", "exp_avg_sq")}  # this rank's rows
        m = kept["exp_avg"].float().lerp_(c, 1 - b1)  # the state itself when float32
        v = kept["exp_avg_sq"].float().mul_(b2).addcmul_(c, c, value=1 - b2)
        del c, g  # each float32 temporary goes as soon as it is used: see add_update
        keep_rounded(kept, {"exp_avg": m, "exp_avg_sq": v})
        step = st["step"]
        # the authors' m / ((√v / √(1−β2^t) + ε)·(1−β1^t)): ε after the bias correction
        denom = v.sqrt().mul_(1 / math.sqrt(1 - b2 ** step)).add_(group["eps"]).mul_(
            1 - b1 ** step)
        del v
        update = torch.div(m, denom, out=denom).mul_(-lr)  # in the denominator's storage
        del m
        add_update(Rows(p).local, update, self.compensation, st, lr * group["weight_decay"])


def _corrected(p: Tensor, g: Tensor, st: dict[str, Any], group: dict[str, Any]) -> Tensor:
    """c_t = g + γ·β1/(1−β1)·(g − g_prev), divided by its norm where that exceeds 1 (the whole
    matrix's norm under fsdp); g_prev becomes the gradient. One new float32 tensor: c."""
    b1, rows = group["betas"][0], Rows(p)
    last = Rows(st["last_grad"]).local
    c = last.to(torch.float32, copy=True)
    torch.sub(g, c, out=c).mul_(group["gamma"] * b1 / (1 - b1)).add_(g)
    last.copy_(Rows(p.grad).local)
    norm = torch.linalg.vector_norm(c)
    if rows.sharded:  # the whole matrix's: every rank's sum of squares
        norm = rows.sum(norm.square()).sqrt()
    return c.div_(norm.clamp(min=1))  # clipped to norm 1, with no host read of the norm


@register("mars")
class Mars(Method):
    summary = "MARS-AdamW: AdamW on a variance-reduced, clipped gradient (MARS-approx)"
    Config = MarsConfig

    def check(self, run: RunConfig) -> Terms:
        # fsdp: each rank steps its rows; a matrix's clip norm sums the ranks' squares
        return Terms(refusal=unpaged(run, "moments and previous gradients"), fsdp=None)

    def groups(self, model: nn.Module, run: RunConfig) -> Groups:
        """Matrices (MARS, train.weight_decay) and vectors (AdamW with betas_1d, lr_1d_factor
        and weight_decay_1d; MARS with the matrices' settings under `optimize_1d`)."""
        c, t = self.config, run.train
        params = [p for p in model.parameters() if p.requires_grad]
        vectors = [p for p in params if vector_step(p, c.optimize_1d)]
        matrices = [p for p in params if not vector_step(p, c.optimize_1d)]
        return [
            {"params": matrices, "mars": True, "weight_decay": t.weight_decay},
            {"params": vectors, "mars": False, "lr": t.lr * c.lr_1d_factor, "betas": c.betas_1d,
             "weight_decay": c.weight_decay_1d},
        ]

    def optimizer(self, groups: Groups, run: RunConfig) -> torch.optim.Optimizer:
        c = self.config
        return MarsOptimizer(groups, lr=run.train.lr, betas=c.betas, eps=c.eps, gamma=c.gamma,
                             **own_optimizer_kwargs(run.train))
