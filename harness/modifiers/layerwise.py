"""Layer-wise updates: each parameter's optimizer steps inside backward, its gradient freed at once.

Only one parameter's gradient exists at a time, which is the memory saving. Two defects of
the reference code are fixed here: under gradient accumulation the update runs only when the
gradient is complete (the trainer sets `sync` before the last micro-batch's backward;
GaLore#78, Q-GaLore#13), and the LR schedule ticks once per optimizer step because the
scheduler drives this wrapper's `param_groups`, which are the inner optimizers' own groups
(GaLore#62). A global gradient norm cannot be known before the first update runs, so clipping
is per parameter: each gradient's norm is clipped to `clip` on its own.

An inner optimizer with a `fold(param, last)` method (GaLore's) may keep a smaller sum instead
of the full gradient while micro-batches accumulate: called on every micro-batch, it frees
`param.grad` and returns that sum, or returns None and the full gradient accumulates as usual.
On the last micro-batch the sum is what is averaged over ranks, and the inner `step()` reads
it. Without accumulation it always returns None. With `clip` nothing is folded: the clip is
on the whole gradient's norm, as without accumulation, which a low-rank sum cannot give (so
the result does not depend on how many micro-batches, or ranks, a step is split into).
Under fsdp (`train.fsdp_reduce: every`) the hook runs after each micro-batch's reduce-scatter,
on the shard the reduced gradients add up in; `sync` still holds the update to the last.

Data parallel (harness/distributed/): DDP's wrapper would reduce gradients in buckets after
they were complete, which either fails here (the hook has already freed them) or needs every
gradient kept until the bucket is reduced, doubling gradient memory. So the trainer does not
wrap a layer-wise model. Instead this hook all-reduces its parameter's gradient right before the
update: summed over ranks and divided by W, the average DDP would have taken (the trainer scales
each rank's loss by W over the step's global target count, so the average is the 1-process
gradient). Then it clips, steps and frees it; peak gradient memory stays one parameter (plus
what accumulation keeps). Hooks fire in autograd order, identical on every rank for the same
graph, so the per-parameter collectives match up. Ranks start equal (the trainer broadcasts rank
0's weights) and stay equal, since every rank steps on the same reduced gradient.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn

from harness import distributed
from harness.distributed import fsdp


class LayerwiseOptimizer(torch.optim.Optimizer):
    """Wraps one optimizer per parameter; `step()` and `zero_grad()` have nothing left to do."""

    layerwise = True

    def __init__(self, params: list[nn.Parameter],
                 make: Callable[[nn.Parameter], torch.optim.Optimizer], clip: float | None):
        self.inner = {p: make(p) for p in params}
        self.clip = clip
        self.sync = True
        self.defaults = {}
        # Each hook reaches this optimizer through a weak reference: the hooks live on the
        # parameters' C++ side, where the cycle collector cannot see them, so a bound method
        # there (parameter -> hook -> optimizer -> its states and parameters) kept every
        # finished layer-wise run alive for the rest of the process, and every later run's
        # peak counted the earlier ones' weights and states.
        self._hooks = [p.register_post_accumulate_grad_hook(partial(_update, weakref.ref(self)))
                       for p in params]

    def _update(self, param: torch.Tensor) -> None:
        # GaLore: accumulate in low rank, unless clipping needs the whole gradient's norm
        fold = None if self.clip else getattr(self.inner[param], "fold", None)
        low = fold(param, self.sync) if fold is not None else None
        if not self.sync:  # a middle micro-batch: let the gradient accumulate
            return
        grad = param.grad if low is None else low
        # the average over ranks, before anything reads the gradient (fsdp's reduce-scatter
        # took it already: FSDP runs this hook on the sharded, reduced gradient)
        if distributed.active() and not fsdp.is_sharded(param):
            distributed.all_sum(grad).div_(distributed.world_size())
        if self.clip:
            torch.nn.utils.clip_grad_norm_([param], self.clip)
        self.inner[param].step()
        param.grad = None

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return [g for opt in self.inner.values() for g in opt.param_groups]

    @property
    def state(self) -> dict[Any, Any]:  # type: ignore[override]
        return {p: s for opt in self.inner.values() for p, s in opt.state.items()}

    def step(self, closure: Callable | None = None) -> None:  # type: ignore[override]
        """Every update already ran in backward."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.inner.values():
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"inner": [opt.state_dict() for opt in self.inner.values()]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for opt, sd in zip(self.inner.values(), state_dict["inner"], strict=True):
            opt.load_state_dict(sd)


def _update(optimizer: weakref.ref[LayerwiseOptimizer], param: torch.Tensor) -> None:
    """A parameter's hook: its optimizer's update, while that optimizer is in use."""
    live = optimizer()
    if live is not None:
        live._update(param)
