"""What the optimizers of INT8 weights share (Q-GaLore's, and APOLLO's with `int8_weights`).

Each quant.Int8Linear's weight gradient G reaches `_receive` inside backward (the layer's grad
hook) and is dropped after it: summed over micro-batches in the form `_part` gives (Q-GaLore
projects it when no SVD is due), and on the last one (the trainer's `sync`) averaged over
ranks and handed to the subclass's `_step_layer`, which puts its update onto the codes by
stochastic rounding from a seeded generator whose state is checkpointed. Every other parameter
trains with its own optimizer in its post-accumulate-grad hook, as LayerwiseOptimizer runs it;
the scheduler drives `group`'s LR with theirs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from harness import distributed
from harness.methods.quant import Int8Linear
from harness.modifiers.layerwise import LayerwiseOptimizer


def on_device(v: Any, device: torch.device) -> Any:
    """Checkpoints load on the CPU: every tensor inside goes back to its layer's device."""
    if isinstance(v, Tensor):
        return v.to(device)
    if isinstance(v, dict):
        return {k: on_device(x, device) for k, x in v.items()}
    if isinstance(v, list):
        return [on_device(x, device) for x in v]
    return v


def per_parameter(cls: Callable[..., torch.optim.Optimizer], weight_decay: float,
                  **settings: Any) -> Callable[[nn.Parameter], torch.optim.Optimizer]:
    """`make` for the parameters that stay float: one `cls` each, weight decay on matrices
    only."""
    def make(p: nn.Parameter) -> torch.optim.Optimizer:
        decay = weight_decay if p.dim() >= 2 else 0.0
        return cls([{"params": [p], "weight_decay": decay}], **settings)

    return make


class Int8LayerwiseOptimizer(LayerwiseOptimizer):
    """INT8 layers updated in their backward by `_step_layer`; the rest layer-wise by `make`'s
    optimizers. `layer_state`: each layer's initial state, checkpointed with the group."""

    def __init__(self, layers: list[Int8Linear], layer_state: dict[Int8Linear, dict[str, Any]],
                 params: list[nn.Parameter], make: Callable[[nn.Parameter], Any], *,
                 group: dict[str, Any], clip: float | None, seed: int,
                 state_dtype: torch.dtype | None) -> None:
        super().__init__(params, make, clip)
        self.group = group
        self.layers, self.layer_state = layers, layer_state
        # G is float32 (no float weight to follow): the layers' moments in state_dtype, else the
        # weights' dtype. The INT8 codes take stochastic rounding, never `compensation`.
        self.state_dtype = state_dtype or next((p.dtype for p in params), None)
        self.pending: dict[Int8Linear, Tensor] = {}  # this step's gradients, summed so far
        device = layers[0].codes.device if layers else torch.device("cpu")
        self.generator = torch.Generator(device).manual_seed(seed)
        for m in layers:
            m.grad_hook = self._receive

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return [self.group, *super().param_groups]

    @property
    def state(self) -> dict[Any, Any]:  # type: ignore[override]
        return {**super().state, **self.layer_state}

    def _part(self, m: Int8Linear, g: Tensor) -> Tensor:
        """What of G is summed over micro-batches: all of it, unless a subclass projects it."""
        return g

    def _receive(self, m: Int8Linear, g: Tensor) -> None:
        """Inside backward: accumulate, and update once the gradient is complete."""
        part = self._part(m, g)
        acc = self.pending.get(m)
        self.pending[m] = part if acc is None else acc.add_(part)
        if self.sync:  # under DDP a (linear) projection commutes with the ranks' average
            g = distributed.all_sum(self.pending.pop(m)).div_(distributed.world_size())
            self._step_layer(m, g)

    def _step_layer(self, m: Int8Linear, g: Tensor) -> None:
        raise NotImplementedError

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self.pending.clear()

    def held_gradients(self) -> dict[Int8Linear, Tensor]:
        """This step's gradients summed so far, by layer (harness/cost/grad_peak.py)."""
        return dict(self.pending)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(),
                "group": {k: v for k, v in self.group.items() if k != "params"},
                "layers": [self.layer_state[m] for m in self.layers],
                "generator": self.generator.get_state()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.group.update(state_dict["group"])
        for m, st in zip(self.layers, state_dict["layers"], strict=True):
            self.layer_state[m] = on_device(st, m.codes.device)
        self.generator.set_state(state_dict["generator"])
