"""Layer-wise GaLore under gradient accumulation (GaLoreOptimizer.fold): between micro-batches a
target keeps R = PᵀG instead of G, except on the steps that refresh its basis (the SVD needs the
whole G); the updates equal the plain optimizer's, and nothing changes without accumulation."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from harness.methods.galore_optim import GaLoreOptimizer
from harness.modifiers.layerwise import LayerwiseOptimizer

GAP, RANK, STEPS = 3, 4, 7  # bases computed at steps 1, 4 and 7
SETTINGS = {"lr": 0.01, "update_proj_gap": GAP, "weight_decay": 0.1}


def model(seed: int = 0) -> list[nn.Parameter]:
    """Three projected matrices (left, right and square: right) and a vector at full rank."""
    torch.manual_seed(seed)
    return [nn.Parameter(torch.randn(s) * 0.3) for s in ((12, 40), (40, 12), (12, 12), (12,))]


def loss(ps: list[nn.Parameter], x: torch.Tensor) -> torch.Tensor:
    w1, w2, w3, b = ps
    h = torch.tanh(torch.tanh(x @ w2.T) @ w1.T + b)
    return (h @ w3.T - x.flip(-1)).square().mean()


def batches(accumulation: int) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [[torch.randn(6, 12, generator=gen) for _ in range(accumulation)]
            for _ in range(STEPS)]


def plain_run(accumulation: int) -> list[list[torch.Tensor]]:
    """The parameters after each step of the non-layer-wise optimizer on the summed gradient."""
    ps = model()
    opt = GaLoreOptimizer([{"params": ps[:3], "rank": RANK}, {"params": ps[3:]}], **SETTINGS)
    out = []
    for micro in batches(accumulation):
        for x in micro:
            loss(ps, x).backward()
        opt.step()
        opt.zero_grad()
        out.append([p.detach().clone() for p in ps])
    return out


def layerwise(ps: list[nn.Parameter], fold: bool = True) -> LayerwiseOptimizer:
    """GaLore split per parameter, as `memory.layerwise` builds it; `fold=False`: the earlier
    form, which kept every full gradient until the last micro-batch."""
    ranks = {id(p): RANK if p.dim() == 2 else None for p in ps}

    def make(p: nn.Parameter) -> GaLoreOptimizer:
        opt = GaLoreOptimizer([{"params": [p], "rank": ranks[id(p)]}], **SETTINGS)
        if not fold:
            opt.fold = None  # type: ignore[method-assign]
        return opt

    return LayerwiseOptimizer(ps, make, clip=None)


def held_bytes(ps: list[nn.Parameter], opt: LayerwiseOptimizer) -> int:
    """Gradient bytes kept between micro-batches: full `.grad`s and low-rank sums."""
    sums = [s["folded"] for s in opt.state.values() if "folded" in s]
    return sum(t.numel() * t.element_size() for t in [p.grad for p in ps if p.grad is not None]
               + sums)


def layerwise_run(accumulation: int, fold: bool = True):
    """Parameters after each step, and the gradient bytes held after each first micro-batch."""
    ps = model()
    opt = layerwise(ps, fold)
    out, held = [], []
    for micro in batches(accumulation):
        for i, x in enumerate(micro):
            opt.sync = i == len(micro) - 1
            loss(ps, x).backward()
            if i == 0 and not opt.sync:
                held.append(held_bytes(ps, opt))
        assert all(p.grad is None for p in ps)  # every update ran inside the last backward
        assert all("folded" not in s for s in opt.state.values())  # consumed by the update
        opt.zero_grad()
        out.append([p.detach().clone() for p in ps])
    return out, held


def test_without_accumulation_nothing_changes():
    ours, held = layerwise_run(1)
    before, _ = layerwise_run(1, fold=False)
    assert not held
    for a, b in zip(ours, before, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))  # bit for bit
    for a, b in zip(ours, plain_run(1), strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("accumulation", [2, 3])
def test_with_accumulation_each_update_equals_the_plain_one(accumulation):
    ours, _ = layerwise_run(accumulation)
    plain = plain_run(accumulation)
    start = [p.detach() for p in model()]
    for step, (a, b) in enumerate(zip(ours, plain, strict=True)):
        # each step's update, refresh steps included (they keep the whole gradient)
        torch.testing.assert_close(
            [x - s for x, s in zip(a, start, strict=True)],
            [y - s for y, s in zip(b, start, strict=True)],
            rtol=1e-4, atol=1e-6, msg=lambda m, step=step: f"step {step + 1}: {m}")
        start = b


def test_low_rank_sums_between_micro_batches_except_on_refresh_steps():
    _, held = layerwise_run(3)
    _, before = layerwise_run(3, fold=False)
    full = 4 * (12 * 40 + 40 * 12 + 12 * 12 + 12)
    low = 4 * (RANK * 40 + 40 * RANK + 12 * RANK + 12)  # R = PᵀG (r×n), GQᵀ (m×r); the vector
    assert before == [full] * STEPS
    refresh = [step % GAP == 0 for step in range(STEPS)]
    assert held == [full if r else low for r in refresh]


def clipped_run(accumulation: int) -> tuple[list[list[torch.Tensor]], list[float]]:
    """Layer-wise GaLore clipping each gradient to 1e-3: the parameters after each step of
    accumulating `accumulation` micro-batches, or of one backward through the sum of their
    losses (1: the same summed gradient, one micro-batch), and the norm of each gradient the
    inner optimizer read (clipped)."""
    ps = model()
    opt = layerwise(ps)
    opt.clip = 1e-3
    norms = []
    for inner in opt.inner.values():
        def step(inner=inner, real=inner.step):
            norms.extend(inner.state[p].get("folded", p.grad).norm().item()
                         for p in inner.param_groups[0]["params"])
            return real()

        inner.step = step  # type: ignore[method-assign]
    out = []
    for micro in batches(2):
        parts = [[x] for x in micro] if accumulation == 2 else [micro]
        for i, xs in enumerate(parts):
            opt.sync = i == len(parts) - 1
            sum(loss(ps, x) for x in xs).backward()
        opt.zero_grad()
        out.append([p.detach().clone() for p in ps])
    return out, norms


def test_clipping_with_accumulation_clips_what_one_micro_batch_clips():
    """The clip needs the whole gradient's norm, which a low-rank sum does not keep: with a
    clip nothing is folded, and 2 micro-batches step as their sum in one backward does."""
    ours, norms = clipped_run(2)
    one, one_norms = clipped_run(1)
    assert norms == pytest.approx([1e-3] * len(norms), rel=1e-4)  # every clip bound: the
    assert one_norms == pytest.approx(norms, rel=1e-5)  # full gradient's, whole-rank ones too
    for step, (a, b) in enumerate(zip(ours, one, strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7,
                                   msg=lambda m, step=step: f"step {step + 1}: {m}")
