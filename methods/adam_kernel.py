"""AdamW on lists of tensors, the elementwise step GaLore, Q-GaLore and 8-bit Adam under bf16-true
share: torch's fused kernel, or bitsandbytes' blockwise 8-bit one."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor
from torch.optim.adamw import adamw as fused_adamw

BLOCK = 256  # bitsandbytes' block size for 8-bit optimizer states
QMAP = 256  # entries in each state's float32 quantization map


def _step_tensors(steps: list[int], device: torch.device) -> list[Tensor]:
    """The fused kernel's step counters, made on the device without a host-to-device copy."""
    if len(set(steps)) == 1:
        return list(torch.full((len(steps),), float(steps[0]), device=device).unbind())
    return [torch.full((), float(s), device=device) for s in steps]


class AdamKernel:
    """AdamW on lists of tensors: torch's fused kernel, or bitsandbytes' 8-bit blockwise one for
    states of at least `min_8bit_size` elements. GaLore and Q-GaLore run their low-rank moments
    through it."""

    def __init__(self, eight_bit: bool, min_8bit_size: int) -> None:
        self.eight_bit, self.min_8bit_size = eight_bit, min_8bit_size
        self._qmaps: dict[torch.device, tuple[Tensor, Tensor]] = {}
        if eight_bit:  # imported now, not in the first step: its 2 s import (torch.compile's
            import bitsandbytes.functional  # noqa: F401  set-up) would be timed and, on a CPU,
            # profiled there: 1.9M events, 45 s of torch's memory-timeline analysis

    def __call__(self, group: dict[str, Any], targets: list[Tensor], grads: list[Tensor],
              states: list[dict[str, Any]], lr: float, wd: float,
              sizes: list[int] | None = None) -> None:
        """AdamW on `targets`; 8-bit blockwise states for the large ones when asked, large by
        `sizes` where given (fsdp: the whole tensors', of which `grads` are a rank's rows)."""
        fused: list[int] = []
        sizes = sizes or [g.numel() for g in grads]
        for i, (g, st) in enumerate(zip(grads, states, strict=True)):
            if self.eight_bit and sizes[i] >= self.min_8bit_size:
                self._adam8bit(group, targets[i], g, st, lr, wd)
                continue
            if "exp_avg" not in st:
                st.update(step=0, exp_avg=torch.zeros_like(g), exp_avg_sq=torch.zeros_like(g))
            fused.append(i)
        if not fused:
            return
        b1, b2 = group["betas"]
        sts = [states[i] for i in fused]
        fused_adamw([targets[i] for i in fused], [grads[i] for i in fused],
                    [st["exp_avg"] for st in sts], [st["exp_avg_sq"] for st in sts], [],
                    _step_tensors([st["step"] for st in sts], sts[0]["exp_avg"].device), fused=True,
                    amsgrad=False, beta1=b1, beta2=b2, lr=lr, weight_decay=wd,
                    eps=group["eps"], maximize=False)
        for st in sts:
            st["step"] += 1

    def _adam8bit(self, group: dict[str, Any], target: Tensor, grad: Tensor,
                  st: dict[str, Any], lr: float, wd: float) -> None:
        """bitsandbytes' blockwise 8-bit Adam update (it has CPU and CUDA kernels)."""
        import bitsandbytes.functional as bnbf

        if "state1" not in st:
            if grad.device not in self._qmaps:
                self._qmaps[grad.device] = tuple(  # type: ignore[assignment]
                    bnbf.create_dynamic_map(signed=s).to(grad.device) for s in (True, False))
            blocks = math.ceil(grad.numel() / BLOCK)
            q1, q2 = self._qmaps[grad.device]
            st.update(step=0, qmap1=q1, qmap2=q2,
                      state1=torch.zeros_like(grad, dtype=torch.uint8),
                      state2=torch.zeros_like(grad, dtype=torch.uint8),
                      absmax1=torch.zeros(blocks, device=grad.device),
                      absmax2=torch.zeros(blocks, device=grad.device))
        st["step"] += 1
        b1, b2 = group["betas"]
        bnbf.optimizer_update_8bit_blockwise(
            "adam", grad, target, st["state1"], st["state2"], b1, b2, 0.0, 0.0, group["eps"],
            st["step"], lr, st["qmap1"], st["qmap2"], st["absmax1"], st["absmax2"],
            weight_decay=wd)
