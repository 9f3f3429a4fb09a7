"""The peak of live tensor bytes in a steady training step: `torch.cuda.max_memory_allocated`
on a GPU, and on the CPU, which keeps no allocator statistics, the profiler's memory timeline
of one step. `harness bench memory` checks the activation model against it."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import torch
from torch.profiler import ProfilerActivity, profile, schedule
from torch.profiler._memory_profiler import Action

if TYPE_CHECKING:
    from harness.train import Trainer

SKIPPED = 2  # step 1 allocates the optimizer's states; step 2 warms the profiler up


def step_peak(trainer: Trainer) -> tuple[int, dict[str, int]]:
    """Run `trainer.fit()` (more than SKIPPED steps) and return the peak after the first SKIPPED
    steps, with its breakdown by the profiler's categories (parameter, activation, ...) on CPU."""
    if trainer.run.train.steps <= SKIPPED:
        raise ValueError(f"step_peak needs more than {SKIPPED} steps")
    if trainer.device.type == "cuda":
        def reset() -> None:
            if trainer.step == SKIPPED:
                torch.cuda.reset_peak_memory_stats(trainer.device)

        trainer.after_step = reset
        trainer.fit()
        return torch.cuda.max_memory_allocated(trainer.device), {}
    when = schedule(wait=SKIPPED - 1, warmup=1, active=1, repeat=1)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True, schedule=when) as prof:
        trainer.after_step = prof.step
        trainer.fit()
    return _peak(prof._memory_profile())


def _peak(memory: object) -> tuple[int, dict[str, int]]:
    live: dict[object, tuple[int, str]] = {}
    current = peak = 0
    at_peak: Counter[str] = Counter()
    for _, action, (key, version), size in memory.timeline:  # type: ignore[attr-defined]
        if action in (Action.PREEXISTING, Action.CREATE, Action.INCREMENT_VERSION):
            category = memory._categories.get(key, version + (action == Action.INCREMENT_VERSION))  # type: ignore[attr-defined]
            old = live.get(key, (0, ""))[0]
            size = old if action == Action.INCREMENT_VERSION and old else size
            live[key] = (size, category.name.lower() if category else "other")
            current += size - old
        elif action == Action.DESTROY:
            current -= live.pop(key, (0, ""))[0]
        if current > peak:
            peak = current
            at_peak = Counter()
            for nbytes, category in live.values():
                at_peak[category] += nbytes
    return peak, dict(at_peak)
