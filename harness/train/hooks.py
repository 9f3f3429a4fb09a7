"""The training loop's events, and the callbacks registered on them.

The loop (harness/train/loop.py) only runs optimizer steps; every other job is a callback on
one of these events, registered when the trainer is built (or, for a profiler, before `fit`):
- "update": the optimizer has stepped and gradients still exist: the method's `on_step`
  (ReLoRA's merges, Q-GaLore's SVD events), the offload modifier's bytes, the cost breakdown;
- "step": the step is counted, before anything is recorded: profilers (a trace's step
  boundary, harness/cost/profile.py) and peak resets (harness/cost/tensor_peak.py);
- "step_end": the step's records: timing, the log line, an evaluation when due, and a
  checkpoint when due or when a stop is asked for;
- "eval": after each evaluation but the last: pruning.
Callbacks take the `Step` and run in registration order. One ends the loop by raising:
NonFinite, Pruned or Interrupted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

EVENTS = ("update", "step", "step_end", "eval")


class NonFinite(Exception):
    """The loss became NaN or Inf at `step`: the trial ends with status `nan` at that step."""

    def __init__(self, value: float, step: int) -> None:
        super().__init__(f"loss is {value} at step {step}")
        self.step = step


class Pruned(Exception):
    """The trial's Optuna study cut it at an evaluation: it ends with status `pruned`."""


class Interrupted(Exception):
    """A stop was asked for (a signal, the sweep) before the last step; its checkpoint is saved."""


@dataclass(frozen=True)
class Step:
    """The optimizer step an event is about."""

    number: int  # steps done with this one, resumed ones included
    loss: torch.Tensor  # this rank's share of the step's mean loss (on the device)
    last: bool  # the budget's final step


Callback = Callable[[Step], None]


class Hooks:
    """Callbacks by event, in registration order."""

    def __init__(self) -> None:
        self._callbacks: dict[str, list[Callback]] = {event: [] for event in EVENTS}

    def _list(self, event: str) -> list[Callback]:
        if event not in self._callbacks:
            raise ValueError(f"unknown training event '{event}' (allowed: {', '.join(EVENTS)})")
        return self._callbacks[event]

    def on(self, event: str, callback: Callback) -> None:
        self._list(event).append(callback)

    def fire(self, event: str, step: Step) -> None:
        for callback in list(self._list(event)):
            callback(step)
