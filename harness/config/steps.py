"""Step arithmetic of a run: the LR schedule (below the methods, which reshape it)."""

from __future__ import annotations

import math

from harness.config import TrainConfig


def lr_factor(step: int, t: TrainConfig) -> float:
    """Linear warmup, then cosine (or linear) decay to `min_lr_ratio`; `step` counts from 0."""
    if step < t.warmup_steps:
        return (step + 1) / t.warmup_steps
    if t.schedule == "constant":
        return 1.0
    progress = min(1.0, (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps))
    decay = 0.5 * (1 + math.cos(math.pi * progress)) if t.schedule == "cosine" else 1 - progress
    return t.min_lr_ratio + (1 - t.min_lr_ratio) * decay
