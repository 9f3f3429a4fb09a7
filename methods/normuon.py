"""NorMuon (Li et al., 2025, "NorMuon: Making Muon more efficient and scalable", arXiv
2510.05491): Muon's orthogonalized update O, each row (a neuron's output weights) then divided
by the root of an exponential average of its mean square, v ← β₂·v + (1 − β₂)·mean_j O², and
the result rescaled to a set size. One value per row beside Muon's momentum: m + mn states for
an m×n hidden matrix.

Everything but the normalization is Muon's (methods/muon.py, imported): the split into hidden
matrices and AdamW for the rest, the momentum and Nesterov form, torch's Newton–Schulz, and
fsdp: each matrix's update orthogonalized whole by its owner, each rank getting its rows back.
The row statistics of those rows are then local (a row lives on one rank); the rescale needs
the whole matrix's Frobenius norms, summed over the ranks that split it (a two-value
all-reduce a matrix). The tests check the update against pytorch-optimizer's `NorMuon` in both
rescalings (tests/methods/test_normuon.py).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Literal

import torch
from pydantic import Field
from torch import Tensor

from harness.config.tuning import tunable
from harness.distributed.rows import Rows
from harness.methods.base import Groups, Terms, register, unpaged
from harness.methods.muon import Muon, MuonConfig, MuonOptimizer
from harness.modifiers.compensation import keep_rounded, own_optimizer_kwargs

if TYPE_CHECKING:
    from harness.config import RunConfig

SECOND = "second_momentum_buffer"  # the row states' key (the official code's name)


class NorMuonConfig(MuonConfig):
    beta2: float = tunable(
        0.95, values=[0.9, 0.95, 0.99], ge=0, lt=1,
        description="β₂: the row second moment's decay (paper Algorithm 1; official "
        "normuon.py: 0.95)", source="around the official 0.95")
    norm_eps: float = Field(1e-10, gt=0, description=(
        "added to each row's root mean square and to the norm rescaled by (normuon.py: 1e-10)"))
    update_scale: Literal["match_rms", "preserve_norm"] = Field("match_rms", description=(
        "match_rms: the update's RMS 0.2, train.lr unscaled (paper Algorithm 1: AdamW's LR "
        "carries over); preserve_norm: O's Frobenius norm kept, LR scaled by adjust_lr_fn "
        "(official normuon.py, with adjust_lr_fn original)"))


class NorMuonOptimizer(MuonOptimizer):
    """Muon's optimizer whose orthogonalized update is normalized row by row before it is
    added; the row second moments in `state_dtype` (None: the weight's), this rank's rows."""

    def __init__(self, params: Any, *, beta2: float, norm_eps: float, update_scale: str,
                 **muon: Any) -> None:
        super().__init__(params, **muon)
        self.beta2, self.norm_eps, self.update_scale = beta2, norm_eps, update_scale

    def _apply(self, group: dict[str, Any], p: Tensor, ortho: Tensor) -> None:
        """The rows of O (this rank's) normalized by their second moments, rescaled by the
        whole matrix's norms, then Muon's decay and step."""
        st, o = self.state[p], ortho.float()
        if SECOND not in st:
            st[SECOND] = torch.zeros(o.shape[0], 1, dtype=self.dtype or p.dtype,
                                     device=o.device)
        v = st[SECOND].float().lerp_(o.square().mean(1, keepdim=True), 1 - self.beta2)
        keep_rounded(st, {SECOND: v})
        normed = o / v.sqrt().add_(self.norm_eps)  # v: the state itself when float32
        squares = Rows(p).sum(torch.stack([o.square().sum(), normed.square().sum()]))
        del o, v
        norm, eps = squares[1].sqrt(), self.norm_eps
        if self.update_scale == "preserve_norm":
            super()._apply(group, p, normed.mul_(squares[0].sqrt() / (norm + eps)))
            return
        scale = 0.2 * math.sqrt(p.numel()) / (norm + eps)
        self._add(group, p, normed.mul_(scale), group["lr"])

    def state_dict(self) -> dict[str, Any]:
        """Under fsdp, the row states placed as row shards, which a checkpoint writes shard by
        shard (the momentum is a shard already)."""
        sd = super().state_dict()
        for index, p in enumerate(self._params()):
            if index in sd["state"]:
                sd["state"][index] = Rows(p).save(sd["state"][index], ())
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        for p in self._params():
            if p in self.state:
                Rows(p).load(self.state[p], ())

    def _params(self) -> list[Tensor]:
        return [p for g in self.param_groups for p in g["params"]]


@register("normuon")
class NorMuon(Muon):
    summary = "NorMuon: Muon's update normalized per neuron (row), AdamW on the rest"
    Config = NorMuonConfig

    def check(self, run: RunConfig) -> Terms:
        # fsdp: Muon's spread; a row's statistics live with its shard (module docstring)
        return Terms(refusal=unpaged(run, "momentum and row second moments"), fsdp=None)

    def _orthogonal(self, hidden: Groups, run: RunConfig) -> MuonOptimizer:
        c = self.config
        return NorMuonOptimizer(
            hidden, lr=run.train.lr, momentum=c.momentum, nesterov=c.nesterov,
            ns_steps=c.ns_steps, adjust_lr_fn=c.adjust_lr_fn, beta2=c.beta2,
            norm_eps=c.norm_eps, update_scale=c.update_scale, **own_optimizer_kwargs(run.train))
