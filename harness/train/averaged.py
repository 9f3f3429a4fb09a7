"""The averaged point of an optimizer that keeps it apart from where it takes gradients
(Schedule-Free's x beside y). Such an optimizer says so by having `train()` and `eval()`, the
schedulefree package's convention: the trainer switches it to its evaluation point around each
evaluation and each checkpoint (so that the evaluation, the checkpoint and the model exported
from it hold x), then back to its training point; after a resume, to its training point.
Duck-typed, so no hook of the method interface; other optimizers are left as they are."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from harness.distributed import fsdp
from harness.modifiers.offload import HostOffloadOptimizer


@contextmanager
def averaged(optimizer: torch.optim.Optimizer, model: nn.Module) -> Iterator[None]:
    """`model`'s weights at the optimizer's evaluation point inside, at its training point
    after."""
    switch(optimizer, model, "eval")
    try:
        yield
    finally:
        switch(optimizer, model, "train")


def training(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    """The weights at the optimizer's training point (a checkpoint holds its evaluation point)."""
    switch(optimizer, model, "train")


@torch.no_grad()
def switch(optimizer: torch.optim.Optimizer, model: nn.Module, mode: str) -> None:
    """Each optimizer inside the layer-wise wrapper that has `mode` ("train" or "eval") called;
    under host offload, the device weights take the host copies it moved; under fsdp, the
    weights an evaluation left gathered dropped, so the next forward gathers the moved shards."""
    parts = [p for p in _parts(optimizer) if callable(getattr(_inner(p), mode, None))]
    if parts:
        fsdp.regather(model)
    for part in parts:
        getattr(_inner(part), mode)()
        if isinstance(part, HostOffloadOptimizer):  # the host copies moved, and the mode
            part.take_settings()
            for p in part.params:
                p.copy_(part.host[p])


def _inner(part: torch.optim.Optimizer) -> torch.optim.Optimizer:
    return part.inner if isinstance(part, HostOffloadOptimizer) else part


def _parts(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    if getattr(optimizer, "layerwise", False):
        return [o for inner in optimizer.inner.values() for o in _parts(inner)]  # type: ignore[attr-defined]
    return [optimizer]
