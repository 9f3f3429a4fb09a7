"""The most gradient bytes alive at once during a step, counted from the tensors themselves.

After a plain step every gradient is still in `.grad`, so counting them then is the peak. A
layer-wise update frees each gradient inside backward, and INT8 weights never have a `.grad`
(their G goes to the optimizer's hook), so after the step nothing is left to count. This watch
looks at every moment a gradient arrives instead: a trained parameter's (a tensor hook, which
runs before the gradient is accumulated and before any post-accumulate hook can free it) and an
INT8 layer's (where `Int8Linear._receive` takes its G). Each time it sums what is alive then:
every `.grad`, every gradient an optimizer holds outside `.grad` (`held_gradients()`: GaLore's
low-rank sums between micro-batches, the INT8 layers' pending sums), an INT8 layer's own
`weight_grad`, and the arriving gradient unless it is added into a tensor of its shape already
counted. It never trusts a formula: a hook that forgot to free a gradient shows as a larger
peak.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from harness.methods.memory import tensor_bytes
from harness.methods.quant import Int8Linear
from harness.modifiers.optimizer import unwrap


class GradPeak:
    """Watches the gradients of `model` trained by `optimizer` until `close()`."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.holders = [optimizer, *unwrap(optimizer)]
        self.layers = [m for m in model.modules() if isinstance(m, Int8Linear)]
        self.peak = 0
        self._handles = [p.register_hook(partial(self._param_grad, p)) for p in self.params]
        for m in self.layers:  # an instance attribute over the method, removed by close()
            m._receive = partial(self._layer_grad, m, m._receive)  # type: ignore[method-assign]

    def held(self) -> dict[Any, Tensor]:
        """Gradients kept outside `.grad`, by the parameter or layer they belong to."""
        out: dict[Any, Tensor] = {}
        for holder in self.holders:
            out.update(getattr(holder, "held_gradients", dict)())
        out.update({m: m.weight_grad for m in self.layers if m.weight_grad is not None})
        return out

    def _observe(self, owner: Any, grad: Tensor, into: Tensor | None) -> None:
        held = self.held()
        into = held.get(owner, into)
        alive = tensor_bytes([p.grad for p in self.params if p.grad is not None])
        alive += tensor_bytes(list(held.values()))
        if into is None or into.shape != grad.shape:
            alive += tensor_bytes(grad)
        self.peak = max(self.peak, alive)

    def _param_grad(self, p: nn.Parameter, grad: Tensor) -> None:
        self._observe(p, grad, p.grad)

    def _layer_grad(self, m: Int8Linear, receive: Callable[[Tensor], None], g: Tensor) -> None:
        self._observe(m, g, None)
        receive(g)

    def close(self) -> int:
        """Stop watching; the peak, or the gradients alive now if none arrived (a step that
        ran no backward here)."""
        for h in self._handles:
            h.remove()
        for m in self.layers:
            del m._receive
        self._handles, self.layers = [], []
        now = tensor_bytes([p.grad for p in self.params if p.grad is not None])
        return max(self.peak, now)
