"""train.precision: 32-true; bf16-mixed and 16-mixed (autocast over fp32 weights, 16-mixed with
dynamic loss scaling); bf16-true (the model itself in bfloat16: see `pure_bf16`)."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn

from harness.config import TrainConfig

DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def pure_bf16(model: nn.Module, train: TrainConfig) -> nn.Module:
    """bf16-true: every floating parameter and buffer in bfloat16, norms and embeddings too (as
    the GaLore and Q-GaLore reference scripts do), so gradients and activations are bfloat16
    and no float32 copy exists; integer tensors (INT8 and NF4 codes) stay as they are, and so
    do the buffers a module names in `FLOAT32_BUFFERS` (quantization scales, which its updates
    recompute in float32: cast once, a checkpoint would not load back bitwise). The trainer
    calls it before the method prepares the model and again after (adapters, factors).
    Other precisions: the model unchanged."""
    if train.precision != "bf16-true":
        return model
    kept = [(m, name, getattr(m, name)) for m in model.modules()
            for name in getattr(m, "FLOAT32_BUFFERS", ())]
    model.to(torch.bfloat16)
    for m, name, value in kept:
        setattr(m, name, value)
    return model


class Precision:
    """16-mixed multiplies the loss by a scale before backward so small gradients survive; a step
    whose gradients overflow is skipped and the scale backs off (torch.amp.GradScaler). Clipping
    sees unscaled gradients. `skipped` counts the skipped steps over the whole trial. The
    schedule advances on skipped steps too, as in torch's AMP recipe: knowing at once that a
    step was skipped would cost a host sync every step."""

    def __init__(self, train: TrainConfig, device: torch.device) -> None:
        """The mixed precisions autocast under every strategy (fsdp gathers the float32
        weights, harness/distributed/fsdp.py)."""
        self.device = device
        self.dtype = DTYPES.get(train.precision)
        self.scaler = None
        if train.precision == "16-mixed":
            s = train.loss_scale
            self.scaler = torch.amp.GradScaler(
                device.type,
                init_scale=s.init,
                growth_factor=s.growth_factor,
                backoff_factor=s.backoff_factor,
                growth_interval=s.growth_interval,
            )
        self.skipped = 0
        self.overflows: list[tuple[int, torch.Tensor]] = []  # (step, overflowed?) not yet read

    def autocast(self) -> AbstractContextManager[Any]:
        if self.dtype is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def step(self, optimizer: torch.optim.Optimizer, params: list[nn.Parameter],
             clip: float | None, step: int, measure: bool = False) -> torch.Tensor | None:
        """Unscale, clip (if `clip`) and step; return the gradients' global L2 norm before
        clipping (a device tensor, a DTensor under fsdp) where it was computed: to clip, for
        16-mixed, or as `measure` asks. Whether 16-mixed overflowed (GradScaler then skips
        the update) stays on the device until `settle`: a non-finite gradient norm, which is
        what GradScaler checks, so the loop reads no value per step."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
        norm = torch.nn.utils.clip_grad_norm_(params, clip, foreach=True) if clip else None
        if norm is None and (measure or self.scaler is not None):
            norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
        if self.scaler is None:
            optimizer.step()
            return norm
        self.overflows.append((step, ~norm.isfinite()))  # type: ignore[union-attr]
        self.scaler.step(optimizer)
        self.scaler.update()
        return norm

    def settle(self) -> list[int]:
        """The steps skipped since the last call, read in one go; counted in `skipped`."""
        if not self.overflows:
            return []
        flags = torch.stack([o for _, o in self.overflows]).tolist()
        skipped = [s for (s, _), f in zip(self.overflows, flags, strict=True) if f]
        self.overflows.clear()
        self.skipped += len(skipped)
        return skipped

    def log(self) -> dict[str, Any]:
        """What a metrics line and the summary record: the scale and the skipped steps (after
        `settle`)."""
        if self.scaler is None:
            return {}
        return {"loss_scale": self.scaler.get_scale(), "skipped_steps": self.skipped}

    def state_dict(self) -> dict[str, Any]:
        if self.scaler is None:
            return {}
        return {"scaler": self.scaler.state_dict(), "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state["scaler"])
            self.skipped = state["skipped"]
