"""CAME (Luo et al., 2023, "CAME: Confidence-guided Adaptive Memory Efficient Optimization", ACL
2023, arXiv 2307.02047): Adafactor's factored second moment with a first moment, the update
weighted by the inverse root of a factored "instability", the EMA of (u − m)², which damps the
steps whose momentum disagrees with the current update (the paper's Algorithm 1).

For an m×n matrix with gradient G (eps1 ε₁, eps2 ε₂, betas β₁ β₂ β₃, clip_threshold d):

    r ← β₂r + (1−β₂)·rowmean(G² + ε₁)      c ← β₂c + (1−β₂)·colmean(G² + ε₁)
    u ← G / √(r cᵀ / mean(r)),  u ← u / max(1, RMS(u)/d)
    m ← β₁m + (1−β₁)u
    R ← β₃R + (1−β₃)·rowmean((u−m)² + ε₂)  C ← the same by columns
    W ← W − η·lr·wd·W − η·m / √(R Cᵀ / mean(R))

A vector (norms) takes the unfactored path as the authors' code does: an element-wise second
moment, and the momentum m as its update (no confidence term). A matrix keeps mn + 2(m + n)
state values, a vector 2n. The step counter is a Python int; the references' `RMS` of the
weight, which neither update reads, is not kept.

Our own optimizer, equal to the authors' package (`came_pytorch.CAME`, came-pytorch 0.1.3) and
pytorch-optimizer's `CAME` (tests/methods/test_came.py), for what they cannot do here: FSDP's
row shards (rows and their means are local; each column mean, the mean of r and the RMS of
the update are sums over the ranks that split the matrix, `Rows.sum`: 2n + 3 values a matrix a
step), and bf16-true (float32 arithmetic, states in train.state_dtype, the update added by
`add_update` with train.update_compensation).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from pydantic import Field
from torch import Tensor

from harness.config import Strict
from harness.distributed.rows import Rows
from harness.methods.base import Groups, Method, Terms, register, unpaged
from harness.modifiers.compensation import (
    ParamwiseOptimizer,
    add_update,
    keep_rounded,
    own_optimizer_kwargs,
)

if TYPE_CHECKING:
    from harness.config import RunConfig

# Column statistics of a 2-D matrix: whole on every rank under fsdp (its rows are split).
COLUMNS = ("exp_avg_sq_col", "exp_avg_res_col")


class CAMEConfig(Strict):
    betas: tuple[float, float, float] = Field(
        (0.9, 0.999, 0.9999), description="β1 (momentum), β2 (factored second moment), β3 "
        "(factored instability): the authors' README (yangluo7/CAME) and came_pytorch's "
        "defaults")
    eps: tuple[float, float] = Field(
        (1e-30, 1e-16), description="ε1 added to G², ε2 added to the instability (u − m)²: "
        "the paper's Algorithm 1 (ε1, ε2), the README's and came_pytorch's values")
    clip_threshold: float = Field(
        1.0, gt=0, description="d, the largest RMS of the preconditioned update (Algorithm 1, "
        "Adafactor's update clipping; came_pytorch's clip_threshold 1.0)")


def _rows_mean(x: Tensor, rows: Rows, matrix: bool) -> Tensor:
    """x's mean over dim -2 (the rows of a matrix): under fsdp a 2-D matrix's rows are split,
    so each rank's sum is summed over the ranks and divided by the whole matrix's rows."""
    if not (rows.sharded and matrix):
        return x.mean(dim=-2)
    return rows.sum(x.sum(dim=-2)).div_(rows.tensor.shape[-2])


def _factored_rsqrt(row: Tensor, col: Tensor, rows: Rows, matrix: bool) -> Tensor:
    """1/√(r cᵀ / mean(r)), as the references' `_approx_sq_grad`; mean(r) over the whole
    matrix's rows (a sum over the ranks under fsdp)."""
    if rows.sharded and matrix:
        mean = rows.sum(row.sum(dim=-1, keepdim=True)).div_(rows.tensor.shape[-2])
    else:
        mean = row.mean(dim=-1, keepdim=True)
    return (row / mean).rsqrt_().unsqueeze(-1).mul(col.unsqueeze(-2).rsqrt())


def _rms(x: Tensor, rows: Rows) -> Tensor:
    """The root mean square of the whole tensor of which `x` is this rank's rows."""
    if not rows.sharded:
        return x.norm(2) / math.sqrt(x.numel())
    square = rows.sum(x.square().sum().reshape(1))
    return square.sqrt_().div_(math.sqrt(rows.tensor.numel())).squeeze(0)


class CAMEOptimizer(ParamwiseOptimizer):
    """CAME (module docstring) over whole or row-sharded tensors: float32 arithmetic, states in
    `state_dtype` (None: the weight's dtype), the update added by `add_update` with
    `compensation`; decoupled weight decay (the references' p ← p − lr·wd·p)."""

    def __init__(self, params: Iterable[Any], *, lr: float,
                 betas: tuple[float, float, float] = (0.9, 0.999, 0.9999),
                 eps: tuple[float, float] = (1e-30, 1e-16), clip_threshold: float = 1.0,
                 weight_decay: float = 0.0, state_dtype: torch.dtype | None = None,
                 compensation: str = "none") -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps,
                                  "clip_threshold": clip_threshold, "weight_decay": weight_decay})
        self.dtype, self.compensation = state_dtype, compensation

    def _init(self, st: dict[str, Any], w: Tensor, dtype: torch.dtype) -> None:
        st["step"] = 0
        st["exp_avg"] = torch.zeros_like(w, dtype=dtype)
        if w.dim() < 2:
            st["exp_avg_sq"] = torch.zeros_like(w, dtype=dtype)
            return
        for kind in ("sq", "res"):
            st[f"exp_avg_{kind}_row"] = w.new_zeros(w.shape[:-1], dtype=dtype)
            st[f"exp_avg_{kind}_col"] = w.new_zeros(w.shape[:-2] + w.shape[-1:], dtype=dtype)

    def _update(self, group: dict[str, Any], p: Tensor) -> None:
        (b1, b2, b3), (eps1, eps2) = group["betas"], group["eps"]
        lr, wd = group["lr"], group["weight_decay"]
        rows = Rows(p)
        st, w, matrix = self.state[p], rows.local, p.dim() == 2
        if not st:
            self._init(st, w, self.dtype or p.dtype)
        st["step"] += 1
        g = Rows(p.grad).local.float()
        square = g.square().add_(eps1)
        if w.dim() >= 2:
            update = self._factored(st, "sq", square, b2, rows, matrix).mul_(g)
        else:
            v = st["exp_avg_sq"].float().mul_(b2).add_(square, alpha=1 - b2)
            keep_rounded(st, {"exp_avg_sq": v})
            update = v.rsqrt().mul_(g)
        del square, g  # each float32 temporary goes as soon as it is used: see add_update
        update.div_((_rms(update, rows) / group["clip_threshold"]).clamp_(min=1.0))
        m = st["exp_avg"].float().mul_(b1).add_(update, alpha=1 - b1)
        keep_rounded(st, {"exp_avg": m})
        if w.dim() >= 2:
            residual = update.sub_(m).square_().add_(eps2)
            update = self._factored(st, "res", residual, b3, rows, matrix).mul_(m)
            del residual
        else:
            update = m.clone()  # m may be the state itself
        add_update(w, update.mul_(-lr), self.compensation, st, lr * wd)

    def _factored(self, st: dict[str, Any], kind: str, x: Tensor, beta: float, rows: Rows,
                  matrix: bool) -> Tensor:
        """The row and column EMAs of `x` (`kind`: "sq" or "res") advanced; their factored
        inverse root, float32, of x's shape."""
        row_key, col_key = f"exp_avg_{kind}_row", f"exp_avg_{kind}_col"
        row = st[row_key].float().mul_(beta).add_(x.mean(dim=-1), alpha=1 - beta)
        col = st[col_key].float().mul_(beta).add_(_rows_mean(x, rows, matrix), alpha=1 - beta)
        keep_rounded(st, {row_key: row, col_key: col})
        return _factored_rsqrt(row, col, rows, matrix)

    def state_dict(self) -> dict[str, Any]:
        """Under fsdp, row states placed as row shards, which a checkpoint writes shard by
        shard; a matrix's column statistics whole (every rank holds them)."""
        sd = super().state_dict()
        params = [p for g in self.param_groups for p in g["params"]]
        for index, p in enumerate(params):
            if index in sd["state"]:
                sd["state"][index] = Rows(p).save(sd["state"][index], _whole(p))
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        for g in self.param_groups:
            for p in g["params"]:
                if p in self.state:
                    Rows(p).load(self.state[p], _whole(p))


def _whole(p: Tensor) -> tuple[str, ...]:
    return COLUMNS if p.dim() == 2 else ()


@register("came")
class CAME(Method):
    summary = "CAME: Adafactor's factored moments with a momentum and a confidence term"
    Config = CAMEConfig

    def check(self, run: RunConfig) -> Terms:
        # fsdp: rows local, column means, mean(r) and the update's RMS summed over the ranks
        return Terms(refusal=unpaged(run, "factored moments"), fsdp=None)

    def optimizer(self, groups: Groups, run: RunConfig) -> torch.optim.Optimizer:
        c = self.config
        return CAMEOptimizer(groups, lr=run.train.lr, betas=c.betas, eps=c.eps,
                             clip_threshold=c.clip_threshold,
                             **own_optimizer_kwargs(run.train))
