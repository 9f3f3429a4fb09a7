"""Adafactor's update (Shazeer & Stern, 2018) on lists of tensors: GaLore's third inner optimizer
(methods/galore_optim.py), on projected gradients and at full rank on the other weights."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

ADAFACTOR = {"eps": 1e-30, "clip": 1.0, "decay_rate": -0.8}  # transformers' defaults


def adafactor(lr: float, beta1: float | None, states: list[dict[str, Any]],
              grads: list[Tensor]) -> list[Tensor]:
    """transformers' Adafactor with relative_step=False and scale_parameter=False (as the
    GaLore scripts): the lr-scaled update, RMS-clipped, through the first moment if any."""
    out = []
    for st, g in zip(states, grads, strict=True):
        factored = g.dim() >= 2
        if "step" not in st:
            st["step"] = 0
            if factored:
                st["exp_avg_sq_row"] = g.new_zeros(g.shape[:-1])
                st["exp_avg_sq_col"] = g.new_zeros(g.shape[:-2] + g.shape[-1:])
            else:
                st["exp_avg_sq"] = torch.zeros_like(g)
            if beta1 is not None:
                st["exp_avg"] = torch.zeros_like(g)
        st["step"] += 1
        beta2t = 1.0 - st["step"] ** ADAFACTOR["decay_rate"]
        sq = g.square().add_(ADAFACTOR["eps"])
        if factored:
            row, col = st["exp_avg_sq_row"], st["exp_avg_sq_col"]
            row.lerp_(sq.mean(dim=-1), 1.0 - beta2t)
            col.lerp_(sq.mean(dim=-2), 1.0 - beta2t)
            r = (row / row.mean(dim=-1, keepdim=True)).rsqrt_().unsqueeze(-1)
            update = r.mul(col.unsqueeze(-2).rsqrt()).mul_(g)
        else:
            st["exp_avg_sq"].lerp_(sq, 1.0 - beta2t)
            update = st["exp_avg_sq"].rsqrt().mul_(g)
        rms = update.norm() / update.numel() ** 0.5
        update.div_((rms / ADAFACTOR["clip"]).clamp_(min=1.0)).mul_(lr)
        if beta1 is not None:
            update = st["exp_avg"].lerp_(update, 1 - beta1)
        out.append(update)
    return out
