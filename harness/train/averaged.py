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

from harness.modifiers.offload import HostOffloadOptimizer


@contextmanager
def averaged(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """The weights at the optimizer's evaluation point inside, at its training point after."""
    switch(optimizer, "eval")
    try:
        yield
    finally:
        switch(optimizer, "train")


def training(optimizer: torch.optim.Optimizer) -> None:
    """The weights at the optimizer's training point (a checkpoint holds its evaluation point)."""
    switch(optimizer, "train")


@torch.no_grad()
def switch(optimizer: torch.optim.Optimizer, mode: str) -> None:
    """Each optimizer inside the layer-wise wrapper that has `mode` ("train" or "eval") called;
    under host offload, the device weights take the host copies it moved."""
    for part in _parts(optimizer):
        inner = part.inner if isinstance(part, HostOffloadOptimizer) else part
        move = getattr(inner, mode, None)
        if not callable(move):
            continue
        move()
        if isinstance(part, HostOffloadOptimizer):  # the host copies moved, and the mode
            part.take_settings()
            for p in part.params:
                p.copy_(part.host[p])


def _parts(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    if getattr(optimizer, "layerwise", False):
        return [o for inner in optimizer.inner.values() for o in _parts(inner)]  # type: ignore[attr-defined]
    return [optimizer]
