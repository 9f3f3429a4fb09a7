"""MARS-AdamW: the same updates as pytorch-optimizer's `MARS(mars_type="adamw")` on the same
gradients (clipped and unclipped corrections, vectors by AdamW or by MARS), its state bytes
(two moments, and the previous gradient of every matrix) plain and layer-wise, bf16-true's
states and compensation, and the paged refusal. The memory modifiers, precisions, ddp and fsdp:
tests/method_matrix.py and tests/train/test_equality.py."""

from __future__ import annotations

import math
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

METHOD = {"name": "mars"}
# Gradient norms of each step, in turn: small and large, so that some corrections
# c_t = g + 0.475·(g − g_prev) stay under norm 1 and others are clipped to it.
NORMS = (0.05, 0.1, 4.0, 0.2, 0.02, 3.0, 0.3)
GAMMA, BETA1 = 0.025, 0.95


def mars_run(steps: int = 4, memory: dict[str, Any] | None = None, method: dict | None = None,
             **train_keys: Any) -> dict:
    """4 steps of 2 micro-batches, no clipping (layer-wise clips each parameter on its own)."""
    data = micro_run(steps=steps, grad_clip=None, **train_keys)
    data["eval"] = {"every": 0, "tokens": 256}
    return {**data, "method": {**METHOD, **(method or {})}, "memory": memory or {}}


def feed(models: list[torch.nn.Module], step: Any) -> list[float]:
    """Each step the same random gradients into every model, each tensor's norm NORMS[t];
    `step()`. The correction norms of the matrices, from the gradients alone."""
    gen, previous, corrections = torch.Generator().manual_seed(1), {}, []
    for norm in NORMS:
        for i, params in enumerate(zip(*(m.parameters() for m in models), strict=True)):
            g = torch.randn(params[0].shape, generator=gen)
            g *= norm / g.norm()
            for p in params:
                p.grad = g.clone()
            c = g + GAMMA * BETA1 / (1 - BETA1) * (g - previous.get(i, torch.zeros_like(g)))
            previous[i] = g
            if g.dim() == 2:
                corrections.append(float(c.norm()))
        step()
    return corrections


def without_root_guard(monkeypatch: pytest.MonkeyPatch) -> None:
    """The package's denominator √(v + 1e-15) + ε as √v + ε: its `apply_ams_bound` adds a guard
    of its own under the root (`exp_avg_sq_eps`), which neither the paper nor AGI-Arena/MARS
    has, and which moves elements whose v is below about 1e-13."""
    from pytorch_optimizer.base.optimizer import BaseOptimizer

    guarded = BaseOptimizer.apply_ams_bound
    monkeypatch.setattr(BaseOptimizer, "apply_ams_bound", staticmethod(
        lambda ams, v, most, eps: guarded(ams, v, most, eps, exp_avg_sq_eps=0.0)))


def authors_eps(reference: torch.optim.Optimizer, step: int, eps: float) -> None:
    """The package adds ε before dividing by √(1−β2^t), the authors after (AGI-Arena/MARS
    `update_fn`): the authors' ε is the package's ε·√(1−β2^t), set on each group before its
    `step`-th step (β2 the group's: `betas_1d`'s for the vectors AdamW trains)."""
    for group in reference.param_groups:
        matrices = group["optimize_1d"] or group["params"][0].dim() >= 2
        beta2 = (group["betas"] if matrices else group["betas_1d"])[1]
        group["eps"] = eps * math.sqrt(1 - beta2 ** step)


@pytest.mark.parametrize("optimize_1d", [False, True], ids=["vectors_adamw", "vectors_mars"])
def test_matches_the_package_step_for_step(monkeypatch, optimize_1d):
    from pytorch_optimizer import MARS

    without_root_guard(monkeypatch)
    model, ref = micro_model(), micro_model()
    settings = {"gamma": GAMMA, "betas": [BETA1, 0.99], "optimize_1d": optimize_1d,
                "lr_1d_factor": 0.4, "betas_1d": [0.8, 0.9], "weight_decay_1d": 0.05}
    run = load_run(mars_run(method=settings, lr=0.01, weight_decay=0.1))
    ours = optimizer_for(build_method(run), model, run)
    params = list(ref.parameters())  # the package's groups: matrices, vectors
    reference = MARS([{"params": [p for p in params if p.dim() >= 2]},
                      {"params": [p for p in params if p.dim() < 2]}],
                     lr=0.01, betas=(BETA1, 0.99), gamma=GAMMA, mars_type="adamw",
                     optimize_1d=optimize_1d, lr_1d=0.004, betas_1d=(0.8, 0.9),
                     weight_decay=0.1, weight_decay_1d=0.05, foreach=False)
    steps = iter(range(1, len(NORMS) + 1))
    start = [p.detach().clone() for p in model.parameters()]

    def step() -> None:
        ours.step()
        authors_eps(reference, next(steps), 1e-8)
        reference.step()

    corrections = feed([model, ref], step)
    assert min(corrections) < 0.5 and max(corrections) > 2  # both sides of the clip
    for (name, p), q, p0 in zip(model.named_parameters(), ref.parameters(), start, strict=True):
        # float32 roundings in another order (the denominator, the decay beside the update):
        # measured at most 3.7e-8 on the matrices and 6.0e-7 (5 units in the last place) on
        # norms near 1; the package's own ε and root guard: 1.1e-2. Each weight moved > 1e-4
        torch.testing.assert_close(p, q, atol=1e-7, rtol=2e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")
        assert (p - p0).abs().max() > 1e-4, name


def test_state_bytes_two_moments_and_the_previous_gradient_of_each_matrix():
    model = micro_model()
    run = load_run(mars_run())
    method = build_method(run)
    optimizer = optimizer_for(method, model, run)
    ids = torch.randint(0, SAMPLE_VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    n = sum(p.numel() for p in model.parameters())
    matrices = sum(p.numel() for p in model.parameters() if p.dim() == 2)
    assert n - matrices == 64 * (2 * 2 + 1)  # the norms: 2 a layer and the final one
    measured = memory_of(method).measure(model, optimizer)
    assert measured.optimizer_state_bytes == 4 * (2 * n + matrices)
    assert memory_of(method).estimate(param_shapes("llama_micro", SAMPLE_VOCAB), run) == measured
    norm = model.model.norm.weight
    assert "last_grad" not in optimizer.state[norm]
    assert torch.equal(optimizer.state[model.lm_head.weight]["last_grad"],
                       model.lm_head.weight.grad)


def test_bench_memory_counts_what_it_estimates(monkeypatch):
    """`harness bench memory`'s comparison, for mars plain and layer-wise."""
    from harness.bench import memory

    monkeypatch.setattr(memory, "METHODS", {"mars": {}, "mars_layerwise": {"method": "mars"}})
    records = memory.bench_memory("llama_micro", 3, 32, 2)
    assert len(records) == 2 * 5
    assert all(memory.met(r) for r in records), [r for r in records if not memory.met(r)]
    states = {r["name"].split("/")[2]: r["value"] for r in records
              if r["name"].endswith("optimizer_state_bytes")}
    assert states["mars"] == states["mars_layerwise"] == 4 * (2 * 1_149_248 + 1_148_928)


def test_paged_states_are_refused_with_the_reason():
    support = modifier_support("mars")
    assert {k for k, v in support.items() if v} == {"optimizer_offload paged"}
    with pytest.raises(UserError, match=r"^method mars: its moments and previous gradients are"):
        load_run(mars_run(memory={"optimizer_offload": "paged"}))


@pytest.mark.parametrize(("state_dtype", "compensation", "dtype"),
                         [("float32", "kahan", torch.float32),
                          ("bfloat16", "stochastic_rounding", torch.bfloat16)])
def test_bf16_true_honours_state_dtype_and_compensation(tmp_path, monkeypatch, state_dtype,
                                                        compensation, dtype):
    from harness.methods import mars

    seen: dict[str, Any] = {}
    real_add = mars.add_update

    def spy(param, update, mode, state, decay=0.0):
        seen.update(param=param.dtype, mode=mode, m=state["exp_avg"].dtype,
                    v=state["exp_avg_sq"].dtype)
        if "last_grad" in state:
            seen["last"] = state["last_grad"].dtype
        real_add(param, update, mode, state, decay)
        seen["kahan"] = KAHAN in state

    monkeypatch.setattr(mars, "add_update", spy)
    run = load_run(mars_run(steps=2, precision="bf16-true", state_dtype=state_dtype,
                            update_compensation=compensation))
    summary = train(run, tmp_path / "t")
    assert summary["status"] == "ok", summary["error"]
    assert seen == {"param": torch.bfloat16, "mode": compensation, "m": dtype, "v": dtype,
                    "last": torch.bfloat16, "kahan": compensation == "kahan"}
    estimate = build_memory(run).estimate(param_shapes("llama_micro", SAMPLE_VOCAB), run)
    assert_estimate_matches(estimate, summary)


def test_resume_keeps_the_previous_gradient(tmp_path):
    """Stopped after step 2 and resumed: the next correction needs step 2's gradient, kept in
    the checkpoint with the float32 moments of bfloat16 weights."""
    data = mars_run(steps=4, precision="bf16-true", update_compensation="kahan")
    assert_resumes_exactly(load_run(data), tmp_path, stop=2)


@pytest.mark.parametrize("overrides", [{}, {"train.state_dtype": "bfloat16"},
                                       {"train.precision": "32-true"}],
                         ids=["float32_moments", "bfloat16_moments", "32-true"])
def test_the_peak_counts_the_steps_float32_temporaries(tmp_path, overrides):
    """The head's float32 temporaries at its update (the correction c, the denominator that
    becomes the update, and under bf16-true the copies `update_bytes` names) are in the
    estimated peak: without them it falls short by 1 to 4 float32 copies of the head (8.4 MB
    each)."""
    measured, estimated = head_heavy_peaks(tmp_path, "mars", overrides)
    assert abs(measured / estimated - 1) <= PEAK_RTOL
