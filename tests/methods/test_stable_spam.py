"""Stable-SPAM: the same updates as pytorch-optimizer's `StableSPAM` on the same gradients,
across momentum resets, gradient spikes, a zero gradient and the cosine decay of β1 and γ1; its
state bytes (two moments and three scalars a tensor) plain and layer-wise, bf16-true's states
and compensation, and the paged refusal. The memory modifiers, precisions, ddp and fsdp:
tests/method_matrix.py and tests/train/test_equality.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import (
    SAMPLE_VOCAB,
    assert_estimate_matches,
    assert_resumes_exactly,
    micro_model,
    micro_run,
)
from head_heavy import PEAK_RTOL, head_heavy_peaks

from harness.errors import UserError
from harness.methods import build_memory, build_method, memory_of, optimizer_for
from harness.methods.resolve import load_run, modifier_support
from harness.models import param_shapes
from harness.modifiers.compensation import KAHAN
from harness.train import train

METHOD = {"name": "stable_spam"}
STEPS, GAP = 8, 3  # resets at steps 3 and 6


def spam_run(steps: int = 4, memory: dict[str, Any] | None = None, method: dict | None = None,
             **train_keys: Any) -> dict:
    """4 steps of 2 micro-batches, no clipping (layer-wise clips each parameter on its own)."""
    data = micro_run(steps=steps, grad_clip=None, **train_keys)
    data["eval"] = {"every": 0, "tokens": 256}
    return {**data, "method": {**METHOD, **(method or {})}, "memory": memory or {}}


def feed(models: list[torch.nn.Module], step: Any) -> None:
    """STEPS steps of the same gradients into every model, `step()` after each: rows of very
    different scales, a few elements 1000 times the rest (the spikes AdaClip cuts), and at step
    2 a zero gradient for the final norm."""
    gen = torch.Generator().manual_seed(1)
    for t in range(STEPS):
        for params in zip(*(m.parameters() for m in models), strict=True):
            shape = params[0].shape
            scale = torch.rand(shape[0], *[1] * (len(shape) - 1), generator=gen) * 10
            g = torch.randn(shape, generator=gen) * scale
            spikes = torch.rand(shape, generator=gen) < 0.002
            g = torch.where(spikes, g * 1000, g)
            if t == 2 and params[0] is models[0].model.norm.weight:
                g = torch.zeros(shape)
            for p in params:
                p.grad = g.clone()
        step()


def package_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """The package's groups as the method's: decay on matrices, not on vectors."""
    params = list(model.parameters())
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


@pytest.mark.parametrize("t_max", [None, 5], ids=["no_decay", "cosine_decay"])
def test_matches_the_package_across_resets(t_max):
    from pytorch_optimizer import StableSPAM

    model, ref = micro_model(), micro_model()
    settings = {"gamma1": 0.6, "gamma2": 0.95, "theta": 0.99, "update_proj_gap": GAP,
                "t_max": t_max, "eta_min": 0.5, "betas": [0.9, 0.99]}
    run = load_run(spam_run(method=settings, lr=0.01, weight_decay=0.1))
    ours = optimizer_for(build_method(run), model, run)
    reference = StableSPAM(package_groups(ref, 0.1), lr=0.01, betas=(0.9, 0.99), gamma1=0.6,
                           gamma2=0.95, theta=0.99, t_max=t_max, eta_min=0.5,
                           update_proj_gap=GAP, eps=1e-8, foreach=False)
    start = [p.detach().clone() for p in model.parameters()]

    def step() -> None:
        ours.step()
        reference.step()

    feed([model, ref], step)
    for (name, p), q, p0 in zip(model.named_parameters(), ref.parameters(), start, strict=True):
        # float32 roundings in another order (the update's product, the decay beside it):
        # measured at most 1.2e-7 (a unit in the last place of a norm's weight near 1); each
        # weight moved by more than 5e-2
        torch.testing.assert_close(p, q, atol=1e-7, rtol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")
        assert (p - p0).abs().max() > 5e-2, name
        st, ref_st = ours.state[p], reference.state[q]
        assert st["step"] == STEPS - 2 * GAP + 1  # the moments restarted at step 6
        for key in ("exp_avg", "exp_avg_sq", "m_norm_t", "v_norm_t", "m_max_t"):
            torch.testing.assert_close(st[key], ref_st[key], atol=1e-7, rtol=1e-5,
                                       msg=lambda m, k=f"{name} {key}": f"{k}: {m}")


def test_a_reset_restarts_the_moments_at_its_step_and_not_before():
    """The same gradients with resets every 3 steps and every 1000: the same weights after
    step 2, different ones after step 3 (the moments of steps 1-2 dropped)."""
    runs = {gap: load_run(spam_run(method={"update_proj_gap": gap}, lr=0.01)) for gap in (3, 1000)}
    models = {gap: micro_model() for gap in runs}
    optimizers = {gap: optimizer_for(build_method(runs[gap]), models[gap], runs[gap])
                  for gap in runs}
    gen = torch.Generator().manual_seed(0)
    for t in range(3):
        for params in zip(*(m.parameters() for m in models.values()), strict=True):
            g = torch.randn(params[0].shape, generator=gen)
            for p in params:
                p.grad = g.clone()
        for opt in optimizers.values():
            opt.step()
        a, b = (next(m.parameters()) for m in models.values())
        assert torch.equal(a, b) == (t < 2), t
    assert optimizers[3].state[a]["step"] == 1 and optimizers[1000].state[b]["step"] == 3


def test_state_bytes_two_moments_and_three_scalars_a_tensor():
    model = micro_model()
    run = load_run(spam_run())
    method = build_method(run)
    optimizer = optimizer_for(method, model, run)
    ids = torch.randint(0, SAMPLE_VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    assert len(params) == 21  # 2 embeddings, 2 layers of 7 linears and 2 norms, a final norm
    measured = memory_of(method).measure(model, optimizer)
    assert measured.optimizer_state_bytes == 4 * 2 * n + 4 * 3 * 21
    assert memory_of(method).estimate(param_shapes("llama_micro", SAMPLE_VOCAB), run) == measured


def test_bench_memory_counts_what_it_estimates(monkeypatch):
    """`harness bench memory`'s comparison, for stable_spam plain and layer-wise."""
    from harness.bench import memory

    monkeypatch.setattr(memory, "METHODS", {
        "stable_spam": {}, "stable_spam_layerwise": {"method": "stable_spam"}})
    records = memory.bench_memory("llama_micro", 3, 32, 2)
    assert len(records) == 2 * 5
    assert all(memory.met(r) for r in records), [r for r in records if not memory.met(r)]
    states = {r["name"].split("/")[2]: r["value"] for r in records
              if r["name"].endswith("optimizer_state_bytes")}
    assert states["stable_spam"] == states["stable_spam_layerwise"] == 8 * 1_149_248 + 12 * 21


def test_paged_states_are_refused_with_the_reason():
    support = modifier_support("stable_spam")
    assert {k for k, v in support.items() if v} == {"optimizer_offload paged"}
    with pytest.raises(UserError,
                       match=r"^method stable_spam: its moments and norm statistics are"):
        load_run(spam_run(memory={"optimizer_offload": "paged"}))


@pytest.mark.parametrize(("state_dtype", "compensation", "dtype"),
                         [("float32", "kahan", torch.float32),
                          ("bfloat16", "stochastic_rounding", torch.bfloat16)])
def test_bf16_true_honours_state_dtype_and_compensation(tmp_path, monkeypatch, state_dtype,
                                                        compensation, dtype):
    from harness.methods import stable_spam

    seen: dict[str, Any] = {}
    real_add = stable_spam.add_update

    def spy(param, update, mode, state, decay=0.0):
        seen.update(param=param.dtype, mode=mode, m=state["exp_avg"].dtype,
                    v=state["exp_avg_sq"].dtype, scalar=state["m_norm_t"].dtype)
        real_add(param, update, mode, state, decay)
        seen["kahan"] = KAHAN in state

    monkeypatch.setattr(stable_spam, "add_update", spy)
    run = load_run(spam_run(steps=2, precision="bf16-true", state_dtype=state_dtype,
                            update_compensation=compensation))
    summary = train(run, tmp_path / "t")
    assert summary["status"] == "ok", summary["error"]
    assert seen == {"param": torch.bfloat16, "mode": compensation, "m": dtype, "v": dtype,
                    "scalar": torch.float32, "kahan": compensation == "kahan"}
    estimate = build_memory(run).estimate(param_shapes("llama_micro", SAMPLE_VOCAB), run)
    assert_estimate_matches(estimate, summary)


def test_resume_is_exact_across_a_reset_and_the_decay(tmp_path):
    """Stopped after step 3 (a reset at step 2, the next at 4) and resumed: the counters, the
    decay's factor, float32 statistics and moments of bfloat16 weights all come back."""
    data = spam_run(steps=5, precision="bf16-true", update_compensation="kahan",
                    method={"update_proj_gap": 2, "t_max": 4})
    assert_resumes_exactly(load_run(data), tmp_path, stop=3)


@pytest.mark.parametrize("overrides", [{}, {"train.state_dtype": "bfloat16"},
                                       {"train.precision": "32-true"}],
                         ids=["float32_moments", "bfloat16_moments", "32-true"])
def test_the_peak_counts_the_steps_float32_temporaries(tmp_path, overrides):
    """The head's temporaries at its update (the float32 clipped gradient and its mask, the
    denominator that becomes the update, and under bf16-true the copies `update_bytes`
    names) are in the estimated peak: without them it falls short by 1.25 to 3 float32
    copies of the head (8.4 MB each)."""
    measured, estimated = head_heavy_peaks(tmp_path, "stable_spam", overrides)
    assert abs(measured / estimated - 1) <= PEAK_RTOL


def test_the_clip_by_chunks_is_the_packages_masked_assignment(monkeypatch):
    """AdaClip without a host sync: torch.where by chunks (7 elements here, so that chunks cut
    rows) gives the bits of the package's g[spikes] = g[spikes] / max|g| * limit, on a
    transposed (non-contiguous) gradient too."""
    from harness.methods import stable_spam

    monkeypatch.setattr(stable_spam, "CLIP_CHUNK", 7)
    grad = torch.randn(300, 200, generator=torch.Generator().manual_seed(0)).T
    spikes, largest, limit = grad.abs() > 2.5, grad.abs().max(), torch.tensor(2.5)
    want = grad.clone()
    want[spikes] = want[spikes] / largest * limit
    g = grad.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
    stable_spam._clip(g, spikes, largest, limit)
    assert spikes.sum() > 100 and torch.equal(g, want)
