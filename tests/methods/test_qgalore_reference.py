"""Q-GaLore's reference behaviours, each selectable: the lazy schedule replayed against
q-galore-torch's own projector, unclipped INT8 gradients, and `simulate_mode: snap` (weights
snapped to the INT8 grid by stochastic rounding after every step)."""

from __future__ import annotations

import math
import re

import pytest
import torch
from conftest import micro_run
from test_qgalore import backward, check_estimate, fit, qgalore_run, rows, tiny

from harness.errors import UserError
from harness.methods import qgalore_optim
from harness.methods.quant import dequantize_int8, quantize_int8, snap_int8_
from harness.methods.resolve import load_run
from harness.train import train

STEPS = 70


def gradients(kind: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(x, c) per step: G = cᵀx is rank 1, its first left singular vector ∝ c. constant: one
    direction; signs: that direction with a random sign (which the reference reads as cosine
    -1); noisy: directions near it, cosines around the threshold."""
    g = torch.Generator().manual_seed(0)
    x0, c0 = torch.randn(1, 64, generator=g), torch.randn(1, 32, generator=g)
    out = []
    for _ in range(STEPS):
        if kind == "constant":
            x, c = x0, c0
        elif kind == "signs":
            x, c = x0, c0 * (2 * torch.randint(0, 2, (), generator=g) - 1)
        else:
            x = x0 + 0.5 * torch.randn(1, 64, generator=g)
            c = c0 + 0.9 * torch.randn(1, 32, generator=g)
        out.append((x, c))
    return out


def reference_svd_steps(seq: list) -> tuple[list[int], list[float]]:
    """q-galore-torch's GaLoreProjector fed the same gradients: the steps its `project` ran an
    SVD (the optimizer calls it with its 0-based step count), and its final cosine queue."""
    from q_galore_torch.q_galore_projector import GaLoreProjector

    ref = GaLoreProjector(8, update_proj_gap=2, quant=True, group_size=256, n_bit=4)
    steps = []
    for t, (x, c) in enumerate(seq):
        count = ref.svd_count
        ref.project(c.T @ x, t)
        if ref.svd_count > count:
            steps.append(t)
    return steps, ref.queue


def our_svd_steps(seq: list, **method) -> list[int]:
    model, qgalore, opt = tiny(rank=8, gap=2, optimizer="adamw", **method)
    steps = []
    for t, (x, c) in enumerate(seq):
        backward(model, opt, x, c)
        opt.step()
        opt.zero_grad()
        if qgalore.on_step(t + 1, model, opt):
            steps.append(t)
    return steps


@pytest.mark.parametrize("kind", ["constant", "signs", "noisy"])
@pytest.mark.parametrize("simulate", [False, True])
def test_reference_schedule_runs_the_svds_q_galore_torch_runs(kind, simulate):
    """The same gradients, hence the same first singular vectors: the reference schedule's SVD
    steps are the reference code's, in the fused and the simulated form; ours differ."""
    seq = gradients(kind)
    expected, queue = reference_svd_steps(seq)
    assert our_svd_steps(seq, lazy_schedule="reference", simulate=simulate) == expected
    assert our_svd_steps(seq, simulate=simulate) != expected
    if kind == "constant":  # the rolling queue grows the gap at every SVD: 2 → 4 → 8 → …
        assert expected == [0, 2, 4, 6, 8, 10, 12, 16, 32, 64]
    if kind == "noisy":  # signed cosines below zero: the reference reads them as dissimilar
        assert min(queue) < 0


def test_reference_schedule_keeps_signed_cosines_in_the_optimizer():
    model, _, opt = tiny(rank=8, gap=2, optimizer="adamw", lazy_schedule="reference")
    for x, c in gradients("noisy")[:12]:
        backward(model, opt, x, c)
    _, queue = reference_svd_steps(gradients("noisy")[:12])
    assert opt.gaps[model.q_proj].queue == pytest.approx(queue, abs=1e-5)


@pytest.mark.parametrize("clip_int8", [True, False])
def test_clip_int8_clips_the_low_rank_gradient_or_leaves_it(clip_int8):
    """clip_int8 true: Adam's first moment after one step is 0.1 × the clipped R = PᵀG (norm at
    most the clip); false, the reference: 0.1 × R itself."""
    model, _, opt = tiny(rank=8, optimizer="adamw", grad_clip=1e-3, clip_int8=clip_int8)
    torch.manual_seed(3)
    x, c = torch.randn(5, 64), torch.randn(5, 32)
    backward(model, opt, x, c)
    basis = opt.dequantized_basis(model.q_proj)["left"]
    low = basis.T @ (c.T @ x)
    moment = opt.layer_state[model.q_proj]["moments"]["exp_avg"]
    assert low.norm() > 100 * 1e-3
    if clip_int8:
        torch.testing.assert_close(moment, 0.1 * low * (1e-3 / (low.norm() + 1e-6)))
    else:
        torch.testing.assert_close(moment, 0.1 * low, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(("method", "message"), [
    ({"simulate_mode": "snap"}, "method: simulate_mode 'snap' needs simulate: true"),
    ({"simulate": True, "clip_int8": False}, "method: clip_int8: false needs simulate: false"),
    ({"simulate": True, "snap_rounding": "nearest"},
     "method: snap_rounding 'nearest' needs simulate_mode: snap"),
    ({"lazy_schedule": "paper"}, "method.lazy_schedule: 'paper' is not allowed"),
])
def test_misused_keys_are_one_line_errors(method, message):
    with pytest.raises(UserError, match=re.escape(message)) as error:
        load_run({**micro_run(), "method": {"name": "qgalore", **method}})
    assert "\n" not in str(error.value)


def test_snap_refuses_an_update_compensation():
    data = {**micro_run(precision="bf16-true", update_compensation="kahan"),
            "method": {"name": "qgalore", "simulate": True, "simulate_mode": "snap"}}
    with pytest.raises(UserError, match=re.escape("train.update_compensation: none")):
        load_run(data)


def test_snap_rounds_as_the_reference_simulation_does():
    """q-galore-torch's simulated optimizer snaps with `_quantize_stochastic_round` (global
    generator); ours draws from a given one: with the same seed, the same weights."""
    from q_galore_torch.q_galore_adamw8bit_simulate import AdamW8bit

    w = torch.randn(64, 512, generator=torch.Generator().manual_seed(0)) * 0.02
    torch.manual_seed(7)
    expected = AdamW8bit._quantize_stochastic_round(None, w, q_group_size=256)
    ours = w.clone()
    snap_int8_(ours, 256, torch.Generator().manual_seed(7))
    assert torch.equal(ours, expected) and not torch.equal(ours, w)


def test_snap_is_unbiased_where_nearest_is_biased():
    """The mean over many draws of one group's snap is the weight itself (inside the grid: the
    group's extremes may sit half a step outside it, where the clamp biases them); nearest
    rounding keeps an error of about a quarter step on average."""
    draws, g = 4000, torch.Generator().manual_seed(1)
    w = torch.randn(256, generator=g) * 0.02
    snapped = w.repeat(draws)
    _, scale, _ = snap_int8_(snapped, 256, g)  # every group the same: the same grid
    inside = (w != w.max()) & (w != w.min())
    mean = snapped.view(draws, 256).mean(0)
    se = 0.5 * scale[0] / math.sqrt(draws)
    assert (mean - w)[inside].abs().max() < 5 * se
    near = dequantize_int8(*quantize_int8(w))
    assert (near - w)[inside].abs().mean() > 0.15 * scale[0] > 10 * se


def test_snap_leaves_every_targeted_weight_on_its_int8_grid(tmp_path, monkeypatch):
    """Every step snaps each targeted weight once, onto the fresh grid of its updated value, and
    nothing moves it afterwards: each stays (code - zero) · scale with integer codes."""
    snaps: list[tuple] = []

    def recording(w, group, generator):
        before = w.clone()
        grid = snap_int8_(w, group, generator)
        snaps.append((w, before, grid))
        return grid

    monkeypatch.setattr(qgalore_optim, "snap_int8_", recording)
    run = load_run(qgalore_run(8, simulate=True, simulate_mode="snap"))
    trainer = fit(run, tmp_path)
    assert len(snaps) == 8 * 14
    for i, (w, before, (codes, scale, zero)) in enumerate(snaps):
        fresh = quantize_int8(before)
        assert torch.equal(scale, fresh[1]) and torch.equal(zero, fresh[2])
        if i >= len(snaps) - 14:  # the last step's: the weights the model ends with
            assert torch.equal(w, dequantize_int8(codes, scale, zero))
    targets = {id(m.parametrizations.weight.original) for m in trainer.model.modules()
               if hasattr(m, "parametrizations")}
    assert len(targets) == 14
    assert all({id(w) for w, _, _ in snaps[s:s + 14]} == targets for s in range(0, 8 * 14, 14))
    loss = [r["loss"] for r in rows(tmp_path, "train")]
    assert loss[-1] < loss[0] - 0.3
    check_estimate(run, trainer.costs)


def test_snap_rounds_to_nearest_as_the_reference_without_stochastic_round(tmp_path,
                                                                         monkeypatch):
    """`snap_rounding: nearest` (the reference's simulation without --stochastic_round): every
    snap gets no generator, and each targeted weight ends on its grid's nearest codes."""
    generators: list = []

    def recording(w, group, generator):
        generators.append(generator)
        before = w.clone()
        grid = snap_int8_(w, group, generator)
        assert torch.equal(grid[0], quantize_int8(before, group)[0])  # nearest codes
        return grid

    monkeypatch.setattr(qgalore_optim, "snap_int8_", recording)
    run = load_run(qgalore_run(2, simulate=True, simulate_mode="snap", snap_rounding="nearest"))
    fit(run, tmp_path)
    assert len(generators) == 2 * 14 and all(g is None for g in generators)


@pytest.mark.parametrize("method", [
    {"lazy_schedule": "reference", "simulate": True, "simulate_mode": "snap"},
    {"lazy_schedule": "reference", "clip_int8": False},
])
def test_reference_keys_under_bf16_true(tmp_path, method):
    """They compose with bf16-true: a trial trains, and the estimate equals the count."""
    data = qgalore_run(3, **method)
    data["train"].update(precision="bf16-true")
    run = load_run(data)
    trainer = fit(run, tmp_path)
    assert all(math.isfinite(r["loss"]) for r in rows(tmp_path, "train"))
    check_estimate(run, trainer.costs)


def test_snap_resumes_exactly(tmp_path):
    """The snap generator is checkpointed: stopped at step 3 and resumed, the same losses."""
    run = load_run(qgalore_run(5, simulate=True, simulate_mode="snap",
                               lazy_schedule="reference", update_proj_gap=1, queue_size=2))
    straight = train(run, tmp_path / "straight")
    first = train(run, tmp_path / "resumed", should_stop=lambda step: step == 3)
    assert (first["status"], first["step"]) == ("interrupted", 3)
    assert train(run, tmp_path / "resumed")["eval_loss"] == straight["eval_loss"]
    losses = [[r["loss"] for r in rows(tmp_path / d, "train")] for d in ("straight", "resumed")]
    assert losses[0] == losses[1]
