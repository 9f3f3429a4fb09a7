"""The method's optimizer as the modifiers ask: split per parameter (layer-wise), with its
states on the host (optimizer offload), and unwrapped again for counting."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from harness.config import RunConfig
from harness.distributed import fsdp
from harness.modifiers.layerwise import LayerwiseOptimizer
from harness.modifiers.offload import HostOffloadOptimizer

Groups = list[dict[str, Any]]
Build = Callable[[Groups], torch.optim.Optimizer]


def make_optimizer(groups: Groups, build: Build, run: RunConfig) -> torch.optim.Optimizer:
    """The method's optimizer, split per parameter (layerwise) and/or moved to the host."""
    sharded = any(fsdp.is_sharded(p) for g in groups for p in g["params"])
    if run.memory.optimizer_offload == "host" and not sharded:  # fsdp: its own CPU offload
        build = partial(HostOffloadOptimizer, build=build)
    if not run.memory.layerwise:
        return build(groups)
    settings = {p: {k: v for k, v in g.items() if k != "params"}
                for g in groups for p in g["params"]}
    return LayerwiseOptimizer(
        list(settings), lambda p: build([{**settings[p], "params": [p]}]), run.train.grad_clip
    )


def unwrap(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """The method's own optimizers inside the layer-wise and host-offload wrappers."""
    if getattr(optimizer, "layerwise", False):
        return [o for inner in optimizer.inner.values() for o in unwrap(inner)]  # type: ignore[attr-defined]
    if isinstance(optimizer, HostOffloadOptimizer):
        return [optimizer.inner]
    return [optimizer]
