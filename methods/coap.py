"""COAP (Xiao et al., 2025, "COAP: Memory-Efficient Training with Correlation-Aware Gradient
Projection", arXiv 2412.00071; code bytedance/coap, Apache-2.0): GaLore's low-rank Adam whose
projection follows the moments instead of being recomputed by SVD at every refresh.

For a targeted m×n weight (m ≥ n: Q, r×n, on the right, R = GQᵀ; m < n: P, m×r, on the left,
R = PᵀG) the basis is first found by a randomized range finder (one pass, no power iteration,
its test matrix Ω drawn from a generator seeded `seed`): Y = AΩ, Q_Y = qr(Y), and the top r
right singular vectors of Q_Yᵀ·A, A = G (right) or Gᵀ (left) (`coap_torch/utils/orthogonal.py`).
Every `update_proj_gap` steps (T_u) the basis moves one gradient step of lr `proj_lr`, its
gradient clipped to norm 1, down the correlation-aware loss (eq. 5; `MatrixCOAP.update_proj`)

    L(P) = mse(G·PᵀP, G) · (1 − mean over rows of cos(M·P, G))     (right; left: PPᵀG, P·M)

M the first moment in the subspace, and every `reproject_factor`·T_u steps it is recomputed by
the range finder with the previous basis as Ω (eq. 6). The moments are kept as they are across
a change (the authors' LLaMA setting, `restore_state: False`). Adam, the update α·lr·P·N, the
unprojected weights, bf16-true and layer-wise accumulation are GaLore's
(methods/galore_optim.py); docs/fidelity.md#coap lists what differs from the authors' code.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor

from harness.config.tuning import tunable
from harness.methods.base import Groups, Terms, register, unpaged
from harness.methods.galore import GaLore, ProjectionConfig
from harness.methods.galore_optim import GaLoreOptimizer
from harness.modifiers.compensation import own_optimizer_kwargs

if TYPE_CHECKING:
    from harness.config import RunConfig

CLIP = 1.0  # the basis gradient's norm bound (`update_proj`: clip_grad_norm_ max_norm=1.0)
CLIP_EPS = 1e-6  # torch's clip_grad_norm_ guard


class COAPConfig(ProjectionConfig):
    update_proj_gap: int = Field(
        40, ge=1, description="T_u: steps between projection updates (eq. 5); the authors' "
        "LLaMA scripts' --update_interval 40")
    reproject_factor: int = Field(
        5, ge=1, description="every reproject_factor·T_u steps the basis is recomputed by the "
        "range finder (eq. 6); the scripts' --reproject_factor 5")
    scale: float = tunable(0.25, values=[0.125, 0.25, 0.5, 1.0], gt=0,
                           description="α: multiplies the back-projected update (the LLaMA "
                           "scripts' --coap_scale 0.25)",
                           source="halves and doubles of the scripts' α, as GaLore's")
    proj_lr: float = Field(0.1, gt=0, description="the basis' gradient step on the "
                           "correlation-aware loss (MatrixCOAP.update_proj's lr 0.1)")
    seed: int = Field(3407, ge=0, description="the range finder's first test matrix's "
                      "generator seed (coap_torch/utils/orthogonal.py: 3407)")
    proj_type: Literal["std"] = Field(
        "std", description="std: the smaller side (m ≥ n: right), as COAPAdamProjector")
    optimizer: Literal["adamw"] = Field("adamw", description="inner optimizer (COAP's AdamW)")
    min_8bit_size: ClassVar[int] = 0  # GaLore's companion reads it; COAP has no 8-bit states


def range_finder(grad: Tensor, side: str, rank: int, omega: Tensor) -> dict[str, Tensor]:
    """One pass of the randomized range finder on A = G (right) or Gᵀ (left), in float32;
    the basis in the gradient's dtype: Q = Vh[:r] (r×n) on the right, P = Vhᵀ (m×r) on the
    left."""
    a = grad.float() if side == "right" else grad.float().T
    q = torch.linalg.qr(a @ omega.float()).Q
    vh = signed(torch.linalg.svd(q.T @ a, full_matrices=False).Vh[:rank])
    basis = vh if side == "right" else vh.T
    return {side: basis.to(grad.dtype).contiguous()}


def signed(vh: Tensor) -> Tensor:
    """Each singular vector with its largest entry positive. LAPACK leaves the sign to
    rounding (CPU and GPU differ), and the moments, kept across a recomputation, would read a
    flipped vector's coordinates with the wrong sign."""
    top = vh.gather(1, vh.abs().argmax(dim=1, keepdim=True))
    return vh * torch.sign(top)


def correlation_step(basis: Tensor, moment: Tensor, grad: Tensor, side: str,
                     lr: float) -> Tensor:
    """The basis after one clipped gradient step on eq. 5's loss, in float32, then cast."""
    p = basis.detach().float().requires_grad_()
    g, m = grad.float(), moment.float()
    with torch.enable_grad():
        if side == "right":
            loss = F.mse_loss(g @ p.T @ p, g) * (1 - F.cosine_similarity(m @ p, g, dim=1).mean())
        else:
            loss = F.mse_loss(p @ p.T @ g, g) * (1 - F.cosine_similarity(p @ m, g, dim=1).mean())
        (step,) = torch.autograd.grad(loss, p)
    step.mul_(torch.clamp(CLIP / (step.norm() + CLIP_EPS), max=1.0))
    return (p.detach() - lr * step).to(basis.dtype)


class COAPOptimizer(GaLoreOptimizer):
    """GaLore's optimizer whose refreshes are COAP's: the range finder at the first and every
    `reproject_factor`-th one, the correlation step at the others."""

    def __init__(self, params: Iterable[Any], *, reproject_factor: int, proj_lr: float,
                 seed: int, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.reproject_factor, self.proj_lr, self.seed = reproject_factor, proj_lr, seed

    def _refresh(self, group: dict[str, Any], params: list[Tensor],
                 states: list[dict[str, Any]], sides: list[str]) -> None:
        every = group["update_proj_gap"] * self.reproject_factor
        for p, st, side in zip(params, states, sides, strict=True):
            g, old = p.grad, st.get(side)
            if old is None or st["proj_step"] % every == 0:
                self.svd_attempts += 1
                basis = range_finder(g, side, group["rank"], self._omega(g, side, group, old))
            else:
                basis = {side: correlation_step(old, st["exp_avg"], g, side, self.proj_lr)}
            if not basis[side].isfinite().all():
                self.svd_failures += 1  # keep the previous basis (or wait for one)
                continue
            self._switch(group["moments"], st, basis)

    def _omega(self, g: Tensor, side: str, group: dict[str, Any], old: Tensor | None) -> Tensor:
        """The range finder's test matrix: the previous basis (Qᵀ, or P), else Gaussian."""
        if old is not None:
            return old.T if side == "right" else old
        cols = g.shape[1] if side == "right" else g.shape[0]
        gen = torch.Generator(g.device).manual_seed(self.seed)
        return torch.randn(cols, group["rank"], generator=gen, device=g.device)


@register("coap")
class COAP(GaLore):
    summary = "COAP: GaLore's low-rank Adam, its basis moved by the moments' correlation"
    Config = COAPConfig

    def check(self, run: RunConfig) -> Terms:
        return Terms(refusal=unpaged(run, "low-rank moments"), fsdp=(
            "COAP's projection step differentiates a loss of the whole gradient and first "
            "moment, which FSDP's row shards split; use train.parallel: ddp"))

    def optimizer(self, groups: Groups, run: RunConfig) -> COAPOptimizer:
        c = self.config
        return COAPOptimizer(
            groups, lr=run.train.lr, betas=c.betas, eps=c.eps, inner="adamw",
            proj_type=c.proj_type, update_proj_gap=c.update_proj_gap, scale=c.scale,
            reproject_factor=c.reproject_factor, proj_lr=c.proj_lr, seed=c.seed,
            **own_optimizer_kwargs(run.train, chunked=True))
