"""SinkGD (Scetbon, Ma, Gong & Meeds, 2025, "Gradient Multi-Normalization for Stateless and
Scalable LLM Training", arXiv 2502.06742): a stateless optimizer for the hidden matrices. Each
step, the gradient X = G of an m×n matrix is normalized L times alternately by its rows and
by its columns (SR-Sinkhorn, the paper's Algorithm 3),

    X ← √n · Q(X)⁻¹ · X        Q(X) = diag(‖X_i,:‖₂), each row to norm √n
    X ← √m · X · R(X)⁻¹        R(X) = diag(‖X_:,j‖₂), each column to norm √m

and the weight steps W ← W − η·X (Algorithm 4), keeping no state at all: the memory of SGD.
As the paper's LLaMA experiments (the GaLore benchmark, APOLLO's recipe), SinkGD trains the
linear layers of the decoder blocks at `scale` times the run's LR; the embeddings, the head
and the norms take AdamW at the run's LR (the split is Muon's: `is_hidden`).

Our own optimizer (no package provides SinkGD): a row's norm needs only that row, which
FSDP's row shards hold whole; a column's needs every rank's rows, so under fsdp each rank sums
the squares of its rows of each column and one all-reduce of n values per iteration
(`Rows.sum`) gives every rank the column norms of the whole matrix. Decoupled weight decay,
as AdamW's, at the group's LR; bf16-true adds the update by `add_update`. A zero row or column
would divide by zero in the paper's algorithm: its norm is clamped to `EPS` (nothing else
changes). The tests check it against the algorithm written out from the paper.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from pydantic import Field
from torch import Tensor, nn

from harness.distributed.rows import Rows
from harness.methods.base import Groups, Method, Terms, register
from harness.methods.full import AdamConfig, adamw
from harness.methods.muon import Chain, is_hidden
from harness.modifiers.compensation import ParamwiseOptimizer, add_update

if TYPE_CHECKING:
    from harness.config import RunConfig

EPS = 1e-8  # the smallest row or column norm divided by (the paper's has no zero rows)


class SinkGDConfig(AdamConfig):
    iterations: int = Field(
        5, ge=1, le=100, description="L, SR-Sinkhorn's row-and-column passes a step "
        "(arXiv 2502.06742 Algorithm 3; its LLaMA runs' L = 5)")
    scale: float = Field(
        0.05, gt=0, le=1, description="the linear layers' LR as a fraction of train.lr, the "
        "rest's (the paper's LLaMA runs, after APOLLO's recipe: 0.05)")


def sr_sinkhorn_(x: Tensor, iterations: int, rows: Rows) -> Tensor:
    """Algorithm 3 in place on `x`, float32, this rank's rows of the m×n matrix `rows` holds
    (all of them unsharded); the columns' squares summed over the ranks that split it."""
    m, n = rows.tensor.shape
    for _ in range(iterations):
        x.mul_(torch.linalg.vector_norm(x, dim=1, keepdim=True).clamp_min_(EPS)
               .reciprocal_().mul_(math.sqrt(n)))
        squares = torch.linalg.vector_norm(x, dim=0).square_()  # this rank's rows' part
        rows.sum(squares)
        x.mul_(squares.sqrt_().clamp_min_(EPS).reciprocal_().mul_(math.sqrt(m)))
    return x


class SinkGDOptimizer(ParamwiseOptimizer):
    """Algorithm 4 over whole or row-sharded matrices: no state but, under bf16-true with
    Kahan compensation, the compensation buffer."""

    def __init__(self, params: Iterable[Any], *, lr: float, iterations: int,
                 compensation: str = "none") -> None:
        super().__init__(params, {"lr": lr, "weight_decay": 0.0, "iterations": iterations})
        self.compensation = compensation

    def _update(self, group: dict[str, Any], p: Tensor) -> None:
        rows = Rows(p)
        x = sr_sinkhorn_(Rows(p.grad).local.to(torch.float32, copy=True), group["iterations"],
                         rows)
        w, lr, wd = rows.local, group["lr"], group["weight_decay"]
        if w.dtype != torch.bfloat16 or self.compensation == "none":
            w.mul_(1 - lr * wd)  # AdamW's order: decay, then the step
            w.add_(x, alpha=-lr)
            return
        add_update(w, x.mul_(-lr), self.compensation, self.state[p], lr * wd)


@register("sinkgd")
class SinkGD(Method):
    summary = "SinkGD: stateless row/column-normalized gradients on hidden matrices, AdamW rest"
    Config = SinkGDConfig

    def check(self, run: RunConfig) -> Terms:
        # fsdp: rows are local, column norms summed over the ranks (module docstring); paged:
        # the AdamW part's states are bitsandbytes' (the matrices keep none)
        return Terms(fsdp=None)

    def groups(self, model: nn.Module, run: RunConfig) -> Groups:
        """Hidden matrices (SinkGD, at scale·lr), embeddings and head (AdamW, decayed), vectors
        (AdamW, not decayed); SinkGD's group first."""
        t = run.train
        hidden, matrices, vectors = [], [], []
        for name, p in model.named_parameters():
            if p.requires_grad:
                kind = hidden if is_hidden(name, p.shape) else matrices if p.dim() >= 2 \
                    else vectors
                kind.append(p)
        return [
            {"params": hidden, "sinkgd": True, "lr": self.config.scale * t.lr,
             "weight_decay": t.weight_decay},
            {"params": matrices, "sinkgd": False, "lr": t.lr, "weight_decay": t.weight_decay},
            {"params": vectors, "sinkgd": False, "lr": t.lr, "weight_decay": 0.0},
        ]

    def optimizer(self, groups: Groups, run: RunConfig) -> torch.optim.Optimizer:
        """SinkGD on the `sinkgd` groups, the harness's AdamW (full's) on the others; one of
        them alone when the groups are one parameter's (layer-wise)."""
        c = self.config
        hidden = [g for g in groups if g["sinkgd"]]
        rest = [g for g in groups if not g["sinkgd"]]
        optimizers: list[torch.optim.Optimizer] = []
        if hidden:
            compensation = run.train.update_compensation \
                if run.train.precision == "bf16-true" else "none"
            optimizers.append(SinkGDOptimizer(hidden, lr=run.train.lr,
                                              iterations=c.iterations,
                                              compensation=compensation))
        if rest:
            optimizers.append(adamw(rest, run, c))
        return optimizers[0] if len(optimizers) == 1 else Chain(optimizers)
