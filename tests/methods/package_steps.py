"""What the reference tests that step a built method beside an authors' package share: the
same gradients into both models, the package's groups for a model, and the comparison of the
weights after, and the AdamW beside Muon-split packages (tests/methods/test_muon.py,
test_normuon.py, test_apollo.py, test_fira.py)."""

from __future__ import annotations

from typing import Any

import torch

from harness.methods.surgery import TARGETS


def feed(models: list[torch.nn.Module], steps: int, step: Any) -> None:
    """The same random gradients, rows of very different scales, into each model; `step()`."""
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for params in zip(*(m.parameters() for m in models), strict=True):
            scale = torch.rand(params[0].shape[0], *[1] * (params[0].dim() - 1), generator=gen)
            grad = torch.randn(params[0].shape, generator=gen) * scale * 10
            for p in params:
                p.grad = grad.clone()
        step()


def package_groups(model: torch.nn.Module, settings: dict) -> list[dict]:
    """A package's groups for `model`: one a parameter in the model's order (so that APOLLO's
    seeds, a parameter's place among the optimizer's, are ours: its place in the model); the
    attention and MLP linears with the projection `settings`."""
    return [{"params": [p], **(settings if any(t in n for t in TARGETS) else {})}
            for n, p in model.named_parameters()]


def assert_stepped_as_package(model: torch.nn.Module, ref: torch.nn.Module, ours: Any,
                              reference: Any, vectors_close: bool) -> None:
    """20 steps of both on the same gradients: every weight moved by more than 1e-2; projected
    matrices within 2e-4 and embeddings and head within 3e-3 of the package's (the tests say
    why); norms within 3e-4 when both decay them alike, else more than 1.5e-2 apart."""
    def step() -> None:
        ours.step()
        reference.step()

    start = [p.detach().clone() for p in model.parameters()]
    feed([model, ref], 20, step)
    for (name, p), q, p0 in zip(model.named_parameters(), ref.parameters(), start, strict=True):
        gap = (p - q).abs().max()
        assert (p - p0).abs().max() > 1e-2, name
        if p.dim() < 2:
            assert gap < 3e-4 if vectors_close else gap > 1.5e-2, name
        else:
            assert gap < (3e-3 if "embed" in name or "lm_head" in name else 2e-4), name


def adamw_on_the_rest(model: torch.nn.Module, taken: list[torch.nn.Parameter], lr: float,
                      weight_decay: float) -> torch.optim.Optimizer:
    """torch's fused AdamW on `model`'s parameters outside `taken` (Muon's split): decay on
    matrices, none on vectors, as the harness's AdamW side does."""
    rest = [p for p in model.parameters() if all(p is not t for t in taken)]
    return torch.optim.AdamW(
        [{"params": [p for p in rest if p.dim() == 2], "weight_decay": weight_decay},
         {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}], lr=lr, fused=True)
