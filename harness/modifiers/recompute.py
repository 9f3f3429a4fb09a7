"""Memory modifiers, orthogonal to the method: activation recompute, activation offload,
layer-wise updates and optimizer offload (`memory:` in the config).

Recompute and offload act on the decoder layers' modules by kind: `attention` (self_attn),
`mlp` and `norm` (the two RMSNorms); `recompute: full` checkpoints whole decoder layers. Both
wrap a module's `forward`, so they see every method's modules as they are after `prepare`:
LoRA/QLoRA adapters, low-rank factors and Q-GaLore's INT8 linears (whose update, fused into
backward, runs once: a recomputed forward rebuilds saved tensors, not graph nodes).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from harness.config import MemoryConfig
from harness.errors import UserError
from harness.modifiers.offload import ActivationOffloader

# A module kind -> its attribute names in a LLaMA decoder layer (or a BERT-family encoder's).
KIND_ATTRS = {
    "attention": ("self_attn", "attention"),
    "mlp": ("mlp", "intermediate", "output"),
    "norm": ("input_layernorm", "post_attention_layernorm"),
}


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The transformer's stack of layers, however a method wrapped the model (peft included)."""
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.rsplit(".", 1)[-1] in ("layers", "layer"):
            return module
    raise UserError("memory: recompute and offload need a model with a ModuleList of layers")


def modules_of(layer: nn.Module, kind: str) -> list[nn.Module]:
    found = [getattr(layer, a) for a in KIND_ATTRS[kind] if hasattr(layer, a)]
    if not found:
        raise UserError(f"memory: the model's layers have no {kind} module "
                        f"({' or '.join(KIND_ATTRS[kind])})")
    return found


def recompute(module: nn.Module) -> None:
    """Keep only the module's inputs in forward; rebuild the rest in backward (non-reentrant,
    RNG state preserved, so dropout draws the same mask and the numbers do not change)."""
    forward = module.forward

    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # eval: nothing is saved anyway
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    module.forward = checkpointed


def offload(module: nn.Module, offloader: ActivationOffloader, layer: int) -> None:
    """Tensors the module saves for backward go through the offloader's hooks."""
    forward = module.forward

    def offloaded(*args: Any, **kwargs: Any) -> Any:
        with offloader.hooks(layer, module):  # its weights, as they are now, stay
            return forward(*args, **kwargs)

    module.forward = offloaded


def apply(
    model: nn.Module, config: MemoryConfig, device: torch.device
) -> ActivationOffloader | None:
    """Wrap the chosen modules; returns the offloader (its byte count is reported) if any."""
    if config.recompute == "none" and not config.offloaded:
        return None
    layers = decoder_layers(model)
    if config.recompute == "full":
        for layer in layers:
            recompute(layer)
    for kind in config.recomputed:
        for layer in layers:
            for module in modules_of(layer, kind):
                recompute(module)
    if not config.offloaded:
        return None
    # weights stay: each wrapped module's own, read at each of its forwards (offload.py `hooks`)
    offloader = ActivationOffloader(device, config.offload_min_bytes)
    for index, layer in enumerate(layers[:-1]):  # the last layer's are needed first: they stay
        for kind in config.offloaded:
            for module in modules_of(layer, kind):
                offload(module, offloader, index)
    return offloader
