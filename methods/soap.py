"""SOAP (Vyas et al., 2024, "SOAP: Improving and Stabilizing Shampoo using Adam", arXiv
2409.11321): Adam run in the eigenbasis of Shampoo's preconditioner. For an m×n weight it keeps
Shampoo's two statistics L ← β·L + (1 − β)·G·Gᵀ (m×m) and R ← β·R + (1 − β)·Gᵀ·G (n×n),
their eigenbases Q_L and Q_R, and Adam's two moments: the first of G as it is, the second of
the rotated gradient Q_Lᵀ·G·Q_R. The update is Q_L·(Q_Lᵀ·M·Q_R / (√V + ε))·Q_Rᵀ, Adam's bias
corrections, then decoupled weight decay. A side longer than `max_precond_dim` (an embedding's
vocabulary) is left unrotated (one-sided), and a vector takes plain Adam. The first step only
builds L, R and their eigenbases (an eigendecomposition), so that no update is rotated by its
own gradient; every `precondition_frequency` steps each basis is refreshed by one power
iteration and a QR decomposition, the second moment's entries reordered with the
eigenvalue estimates. States: 2mn + 2m² + 2n² values for an m×n matrix.

The arithmetic is the authors' (nikhilvyas/SOAP, MIT: `SOAP.step`, `update_preconditioner`,
`get_orthogonal_matrix_QR`), which pytorch-optimizer's `SOAP` follows and the tests check
step for step. Our own class, not the package's: it keeps float32 states for a bfloat16
weight (bf16-true's `state_dtype`) and adds the update with stochastic rounding or Kahan
compensation; the package keeps every state in the gradient's dtype. The authors' options
for convolutions (`merge_dims`, `data_format`), `precondition_1d` and `normalize_grads` are
left at their defaults: a LLaMA has neither 3-D nor 4-D weights (docs/fidelity.md).
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
from harness.methods.base import Groups, Method, Terms, decay_groups, register, unpaged
from harness.modifiers.compensation import (
    KAHAN,
    ParamwiseOptimizer,
    add_update,
    keep_rounded,
    own_optimizer_kwargs,
)

if TYPE_CHECKING:
    from torch import nn

    from harness.config import RunConfig

SIDES = (("L", "QL"), ("R", "QR"))  # each side's statistic and eigenbasis, by dimension
NOT_SHARDED = ("its preconditioners L = G·Gᵀ and R = Gᵀ·G, their eigenbases and the second "
               "moment in that basis each take every row of a gradient and are kept whole; "
               "use train.parallel: ddp")


class SOAPConfig(Strict):
    betas: tuple[float, float] = tunable(
        (0.95, 0.95), values=[(0.95, 0.95), (0.95, 0.99)],
        description="Adam's moment decays in the eigenbasis (the authors' soap.py default; "
        "paper §4)", source="β2 as arXiv 2509.02046 tunes SOAP's")
    shampoo_beta: float | None = Field(None, ge=0, lt=1, description=(
        "L and R's decay (None: betas[1], as the authors' shampoo_beta=-1)"))
    eps: float = Field(1e-8, gt=0, description="added to the second moment's root (soap.py)")
    precondition_frequency: int = Field(10, ge=1, description=(
        "steps between eigenbasis refreshes (soap.py default; paper §4: 10)"))
    max_precond_dim: int = Field(10000, ge=1, description=(
        "a dimension above this is not rotated (soap.py default; paper §4: the vocabulary "
        "side of the embeddings and head)"))
    decay_vectors: bool = Field(False, description=(
        "norms take train.weight_decay too (the authors' optimizer decays every parameter)"))


class SOAPOptimizer(ParamwiseOptimizer):
    """SOAP over vectors and matrices: arithmetic in float32, states in `state_dtype` (None:
    the weight's), the update added by `add_update` with `compensation` (bf16-true)."""

    def __init__(self, params: Iterable[Any], *, lr: float,
                 betas: tuple[float, float] = (0.95, 0.95), shampoo_beta: float | None = None,
                 eps: float = 1e-8, weight_decay: float = 0.0, precondition_frequency: int = 10,
                 max_precond_dim: int = 10000, state_dtype: torch.dtype | None = None,
                 compensation: str = "none") -> None:
        super().__init__(params, {
            "lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
            "shampoo_beta": betas[1] if shampoo_beta is None else shampoo_beta,
            "precondition_frequency": precondition_frequency,
            "max_precond_dim": max_precond_dim})
        self.dtype, self.compensation = state_dtype, compensation

    def _update(self, group: dict[str, Any], p: Tensor) -> None:
        st, g = self.state[p], p.grad.float()
        if not st:  # the first gradient builds the preconditioner only (the authors' code)
            self._start(group, p, g)
            return
        (b1, b2), lr, wd = group["betas"], group["lr"], group["weight_decay"]
        st["step"] += 1
        bases = self._bases(st)
        m = st["exp_avg"].float().lerp_(g, 1 - b1)  # the state itself when float32
        v = st["exp_avg_sq"].float().lerp_(rotate(g, bases).square_(), 1 - b2)
        keep_rounded(st, {"exp_avg": m, "exp_avg_sq": v})
        update = rotate(m, bases).div_(v.sqrt().add_(group["eps"]))
        del m, v  # each float32 temporary goes as soon as it is used: see add_update
        update = rotate(update, bases, back=True)
        n = st["step"]
        step_size = lr * math.sqrt(1 - b2**n) / (1 - b1**n)
        # the authors' order, W ← (W − s·U)·(1 − lr·wd), as add_update's W − lr·wd·W + update
        add_update(p, update.mul_(-step_size * (1 - lr * wd)), self.compensation, st, lr * wd)
        del update  # not beside the statistics' d×d outer products
        self._accumulate(group, st, g)
        if n % group["precondition_frequency"] == 0:
            self._refresh(st)

    def _start(self, group: dict[str, Any], p: Tensor, g: Tensor) -> None:
        """Zero moments and statistics, the first gradient's statistics and their eigenbases."""
        if p.dim() > 2:
            raise ValueError(f"SOAP takes vectors and matrices, not a {p.dim()}-D tensor")
        dtype = self.dtype or p.dtype
        st = self.state[p]
        st["step"] = 0
        st["exp_avg"] = torch.zeros_like(p, dtype=dtype)
        st["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype)
        if self.compensation == "kahan" and p.dtype == torch.bfloat16:
            st[KAHAN] = torch.zeros_like(p)  # from the first step, as the moments
        for (stat, _), size in zip(SIDES, rotated(p.shape, group["max_precond_dim"]),
                                   strict=False):
            if size:
                st[stat] = torch.zeros(size, size, dtype=dtype, device=p.device)
        self._accumulate(group, st, g)
        for stat, basis in SIDES:
            if stat in st:
                st[basis] = eigenbasis(st[stat].float()).to(dtype)

    def _accumulate(self, group: dict[str, Any], st: dict[str, Any], g: Tensor) -> None:
        """L ← β·L + (1 − β)·G·Gᵀ, R ← β·R + (1 − β)·Gᵀ·G (the sides that are rotated)."""
        for (stat, _), outer in zip(SIDES, (lambda: g @ g.T, lambda: g.T @ g), strict=True):
            if stat in st:
                s = st[stat].float().lerp_(outer(), 1 - group["shampoo_beta"])
                keep_rounded(st, {stat: s})

    def _refresh(self, st: dict[str, Any]) -> None:
        """Each basis by one power iteration on its statistic and a QR decomposition, its
        columns ordered by the estimated eigenvalues, the second moment's entries with them
        (`get_orthogonal_matrix_QR`)."""
        for dim, (stat, basis) in enumerate(SIDES):
            if stat not in st:
                continue
            q = st[basis].float()
            power = st[stat].float() @ q
            order = torch.argsort((q * power).sum(0), descending=True)
            st["exp_avg_sq"] = st["exp_avg_sq"].index_select(dim, order)
            st[basis] = torch.linalg.qr(power.index_select(1, order)).Q.to(st[basis].dtype)

    @staticmethod
    def _bases(st: dict[str, Any]) -> tuple[Tensor | None, Tensor | None]:
        return tuple(st[b].float() if b in st else None for _, b in SIDES)  # type: ignore[return-value]


def rotated(shape: Iterable[int], max_precond_dim: int) -> list[int]:
    """The size of each dimension's statistic, 0 where it is not rotated: a matrix's sides up to
    `max_precond_dim`; a vector's none (the authors' precondition_1d off)."""
    shape = tuple(shape)
    if len(shape) < 2:
        return [0] * len(shape)
    return [d if d <= max_precond_dim else 0 for d in shape]


def rotate(x: Tensor, bases: tuple[Tensor | None, Tensor | None], back: bool = False) -> Tensor:
    """Q_Lᵀ·x·Q_R (into the eigenbasis) or, `back`, Q_L·x·Q_Rᵀ; a side without a basis as it
    is. A new tensor."""
    left, right = bases
    if left is None and right is None:
        return x.clone()
    if left is not None:
        x = (left if back else left.T) @ x
    if right is not None:
        x = x @ (right.T if back else right)
    return x


def eigenbasis(stat: Tensor) -> Tensor:
    """The eigenvectors of a symmetric statistic, largest eigenvalue first (the authors'
    `get_orthogonal_matrix`: a 1e-30 shift, float64 where float32 does not converge)."""
    eye = torch.eye(stat.shape[0], device=stat.device, dtype=stat.dtype)
    try:
        _, q = torch.linalg.eigh(stat + 1e-30 * eye)
    except torch.linalg.LinAlgError:
        _, q = torch.linalg.eigh(stat.double() + 1e-30 * eye.double())
        q = q.to(stat.dtype)
    return torch.flip(q, dims=[1])


@register("soap")
class SOAP(Method):
    summary = "SOAP: Adam in the eigenbasis of Shampoo's preconditioner (refreshed by QR)"
    Config = SOAPConfig

    def check(self, run: RunConfig) -> Terms:
        return Terms(refusal=unpaged(run, "moments, statistics and eigenbases"),
                     fsdp=NOT_SHARDED)

    def groups(self, model: nn.Module, run: RunConfig) -> Groups:
        return decay_groups(model, run.train.weight_decay, self.config.decay_vectors)

    def optimizer(self, groups: Groups, run: RunConfig) -> torch.optim.Optimizer:
        c = self.config
        return SOAPOptimizer(groups, lr=run.train.lr, betas=c.betas, shampoo_beta=c.shampoo_beta,
                             eps=c.eps, precondition_frequency=c.precondition_frequency,
                             max_precond_dim=c.max_precond_dim, **own_optimizer_kwargs(run.train))
