"""Stable-SPAM (Huang et al., 2025, "Stable-SPAM: How to Train in 4-Bit More Stably than 16-Bit
Adam", arXiv 2502.17055), its AdamW form: Adam on a gradient first clipped where it spikes and
then rescaled to a running norm, with the moments reset every `update_proj_gap` steps.

Per tensor, each step: AdaClip keeps a running maximum
m_max ← θ·m_max + (1−θ)·max|g| and brings every element above its bias-corrected value back to
it (g·m̂_max/max|g|); AdaGN keeps running moments of the clipped gradient's norm,
m_n ← γ1·m_n + (1−γ1)·‖g‖ and v_n ← γ2·v_n + (1−γ2)·‖g‖², and rescales g to norm
m̂_n/(√v̂_n + ε); then AdamW, whose moments (and their bias correction) restart from zero every
`update_proj_gap` steps (SPAM's momentum reset). With `t_max`, β1 and γ1 shrink along a cosine
to `eta_min` of themselves over t_max steps (the authors' `total_T`).

The arithmetic is pytorch-optimizer's `StableSPAM` (its per-parameter path, which also counts
the norm statistics' bias corrections from the first step, not from the last reset as the
authors' script does: docs/contenders.md#stable-spam), written here per parameter so that it
keeps bf16-true's float32 states and compensated update (modifiers/compensation.py) and takes
fsdp's row shards: a tensor's max |g| and norm are the whole tensor's, summed over the ranks that
split it (`Rows.sum`). The three statistics are float32 scalars whatever the weight's dtype.
The test checks it against the package across resets (tests/methods/test_stable_spam.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from pydantic import Field
from torch import Tensor

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

SCALARS = ("m_norm_t", "v_norm_t", "m_max_t")  # the package's names: AdaGN's two, AdaClip's


class StableSpamConfig(AdamConfig):
    betas: tuple[float, float] = Field(
        (0.9, 0.999), description="Adam's β1, β2 (the authors' StableSPAM defaults, which "
        "their scripts keep)")
    gamma1: float = Field(0.7, ge=0, lt=1, description="γ1: decay of the gradient norm's mean "
                          "(the authors' StableSPAM(gamma1=0.7))")
    gamma2: float = Field(0.9, ge=0, lt=1, description="γ2: decay of the gradient norm's square "
                          "(the authors' StableSPAM(gamma2=0.9))")
    theta: float = Field(0.999, ge=0, lt=1, description="θ: decay of the running max |g| of "
                         "AdaClip (the authors' StableSPAM(gamma3=0.999))")
    update_proj_gap: int = Field(1000, ge=1, description="ΔT: steps between momentum resets "
                                 "(the authors' StableSPAM(update_proj_gap=1000))")
    t_max: int | None = Field(None, ge=1, description="steps of the cosine decay of β1 and γ1 "
                              "(the authors' total_T; None, their optimizer's default: none)")
    eta_min: float = Field(0.5, gt=0, le=1, description="what β1 and γ1 decay to, a fraction "
                           "of themselves (the authors' eta_min=0.5)")


def cosine_scale(previous: float, step: int, t_max: int, eta_min: float) -> float:
    """The factor on β1 and γ1 at `step` (from 1) after `previous`, the last step's (1.0
    before the first): torch's recursive CosineAnnealingLR over t_max + 1 epochs advanced to
    epoch step + 1, which is how the package and the authors' code compute it; eta_min from
    step t_max on."""
    if step >= t_max:
        return eta_min
    span = t_max + 1
    ratio = (1 + math.cos(math.pi * (step + 1) / span)) / (1 + math.cos(math.pi * step / span))
    return ratio * (previous - eta_min) + eta_min


class StableSpam(ParamwiseOptimizer):
    """Stable-SPAM over groups; moments in `state_dtype` (None: the weight's), the update
    added by `add_update` with `compensation`. Decoupled weight decay, as the package's."""

    def __init__(self, params: Iterable[Any], *, lr: float, betas: tuple[float, float],
                 eps: float, gamma1: float, gamma2: float, theta: float, update_proj_gap: int,
                 t_max: int | None = None, eta_min: float = 0.5,
                 state_dtype: torch.dtype | None = None, compensation: str = "none") -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": 0.0})
        self.gamma1, self.gamma2, self.theta = gamma1, gamma2, theta
        self.gap, self.t_max, self.eta_min = update_proj_gap, t_max, eta_min
        self.dtype, self.compensation = state_dtype, compensation

    def _state(self, p: Tensor) -> dict[str, Any]:
        """p's state, made at its first step (placed as the weight is: under fsdp, this rank's
        rows), its counters advanced: `total` steps, `step` since the last reset."""
        st = self.state[p]
        if not st:
            st.update(step=0, total=0, scale=1.0)
            st["exp_avg"] = torch.zeros_like(p, dtype=self.dtype or p.dtype)
            st["exp_avg_sq"] = torch.zeros_like(p, dtype=self.dtype or p.dtype)
            for key in SCALARS:
                st[key] = torch.zeros((), device=Rows(p).local.device)
        st["total"] += 1
        if self.t_max is not None:
            st["scale"] = cosine_scale(st["scale"], st["total"], self.t_max, self.eta_min)
        if st["total"] % self.gap == 0:  # the reset: this step is the moments' first
            st["step"] = 1
            Rows(st["exp_avg"]).local.zero_()
            Rows(st["exp_avg_sq"]).local.zero_()
        else:
            st["step"] += 1
        return st

    def _update(self, group: dict[str, Any], p: Tensor) -> None:
        st, rows = self._state(p), Rows(p)
        lr, decay = group["lr"], group["lr"] * group["weight_decay"]
        g, live = self._normalised(st, rows, Rows(p.grad).local, group["eps"])
        # a zero clipped gradient (live 0): the package decays the weight and moves nothing
        # else; here its moments keep their values through weights of 0, without reading it
        (b1, b2), step = group["betas"], st["step"]
        b1 = b1 * st["scale"]
        kept = {k: Rows(st[k]).local for k in ("exp_avg", "exp_avg_sq")}  # this rank's rows
        m = kept["exp_avg"].float().lerp_(g, live * (1 - b1))  # the state itself when float32
        v = kept["exp_avg_sq"].float().mul_(torch.where(live > 0, b2, 1.0))
        v.addcmul_(g, g, value=1 - b2)
        del g  # each float32 temporary goes as soon as it is used: see add_update
        keep_rounded(kept, {"exp_avg": m, "exp_avg_sq": v})
        denom = v.sqrt().div_(math.sqrt(1 - b2 ** step)).add_(group["eps"])
        del v
        update = torch.div(m, denom, out=denom).mul_(-lr / (1 - b1 ** step)).mul_(live)
        del m
        add_update(rows.local, update, self.compensation, st, decay)

    def _normalised(self, st: dict[str, Any], rows: Rows, grad: Tensor,
                    eps: float) -> tuple[Tensor, Tensor]:
        """AdaClip, then AdaGN, of this rank's rows of the gradient, in a float32 copy, with the
        whole tensor's max |g| and norm; and 1.0, or 0.0 where the clipped gradient is zero
        (its norm statistics then kept as they were). Read by the device alone: no host sync."""
        total = st["total"]
        largest = _whole_max(rows, torch.linalg.vector_norm(grad, math.inf, dtype=torch.float32)
                             if grad.numel() else grad.new_zeros((), dtype=torch.float32))
        m_max = st["m_max_t"].lerp_(largest, 1 - self.theta)
        limit = m_max / (1 - self.theta ** total)
        spikes = grad.abs() > limit  # before the copy: |g|'s temporary is not beside it
        g = grad.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
        _clip(g, spikes, largest, limit)
        del spikes
        norm = torch.linalg.vector_norm(g)
        if rows.sharded:  # the whole tensor's: every rank's sum of squares
            norm = rows.sum(norm.square()).sqrt()
        live = (norm > 0).float()
        gamma1 = self.gamma1 * st["scale"]
        st["m_norm_t"].lerp_(norm, live * (1 - gamma1))
        st["v_norm_t"].lerp_(norm.square(), live * (1 - self.gamma2))
        m_hat = st["m_norm_t"] / (1 - gamma1 ** total)
        v_hat = st["v_norm_t"] / (1 - self.gamma2 ** total)
        # a zero gradient stays zero: divided by the smallest normal float32, not by 0
        return g.div_(norm.clamp_min(torch.finfo(torch.float32).tiny)).mul_(
            m_hat / (v_hat.sqrt() + eps)), live


# Elements of a gradient AdaClip rescales at once: a float32 temporary of at most this many
CLIP_CHUNK = 1 << 24


def _clip(g: Tensor, spikes: Tensor, largest: Tensor, limit: Tensor) -> None:
    """g ← g/max|g|·limit where `spikes`, in place, as the package's g[spikes] = g[spikes] /
    max|g| * limit (the same operations on each element) but without the masked gather's host
    sync: by chunks of CLIP_CHUNK elements (`torch.where` on each)."""
    for part, mask in zip(g.view(-1).split(CLIP_CHUNK), spikes.reshape(-1).split(CLIP_CHUNK),
                          strict=True):
        torch.where(mask, part.div(largest).mul_(limit), part, out=part)


def _whole_max(rows: Rows, value: Tensor) -> Tensor:
    """The largest of every rank's `value` where the tensor is split (fsdp: a slot per rank,
    summed, so that the ranks' sum carries each one's), else `value`."""
    if not rows.sharded:
        return value
    slots = value.new_zeros(Rows.ranks())
    slots[Rows.mine_of(len(slots))] = value
    return rows.sum(slots).max()


@register("stable_spam")
class StableSpamMethod(Method):
    summary = "Stable-SPAM: AdamW on spike-clipped, norm-rescaled gradients, moments reset"
    Config = StableSpamConfig

    def check(self, run: RunConfig) -> Terms:
        # fsdp: each rank steps its rows; a tensor's max |g| and norm sum the ranks' parts
        return Terms(refusal=unpaged(run, "moments and norm statistics"), fsdp=None)

    def optimizer(self, groups: Groups, run: RunConfig) -> torch.optim.Optimizer:
        c = self.config
        return StableSpam(groups, lr=run.train.lr, betas=c.betas, eps=c.eps, gamma1=c.gamma1,
                          gamma2=c.gamma2, theta=c.theta, update_proj_gap=c.update_proj_gap,
                          t_max=c.t_max, eta_min=c.eta_min, **own_optimizer_kwargs(run.train))
