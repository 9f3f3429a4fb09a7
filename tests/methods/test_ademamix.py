"""AdEMAMix: the method's optimizer equals pytorch-optimizer's AdEMAMix (decoupled decay, the
paper's warmup of α and β3) step for step across the end of the warmup, plain and layer-wise;
its schedulers against the paper's definitions worked by hand; exact state bytes; bf16-true
honours state dtype and compensation and resumes exactly; paged states refused."""

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

from harness.errors import UserError
from harness.methods import build_memory, build_method, optimizer_for
from harness.methods.ademamix import alpha_at, beta3_at
from harness.methods.resolve import load_run
from harness.models import param_shapes
from harness.modifiers.compensation import KAHAN
from harness.train import train

METHOD = {"name": "ademamix"}


def ema_run(steps: int = 4, memory: dict[str, Any] | None = None, **train_keys: Any) -> dict:
    data = micro_run(steps=steps, grad_clip=None, **train_keys)
    data["eval"] = {"every": 0, "tokens": 256}
    return {**data, "method": METHOD, "memory": memory or {}}


@pytest.mark.parametrize("layerwise", [False, True], ids=["plain", "layerwise"])
def test_matches_pytorch_optimizer_across_the_warmup(layerwise):
    """Seven steps, α and β3 warmed up over 4 (so both the ramp and the plateau), weight decay
    on matrices, β3 small enough (0.99) that the slow EMA moves within the test."""
    from pytorch_optimizer import AdEMAMix

    torch.manual_seed(0)
    model, ref_model = micro_model(), micro_model()
    ref_model.load_state_dict(model.state_dict())
    method = {**METHOD, "betas": [0.9, 0.999, 0.99], "alpha": 5.0, "t_alpha_beta3": 4}
    run = load_run({**ema_run(lr=0.01, weight_decay=0.1, memory={"layerwise": layerwise}),
                    "method": method})
    ours = optimizer_for(build_method(run), model, run)
    ps = list(ref_model.parameters())
    reference = AdEMAMix([{"params": [p for p in ps if p.dim() >= 2], "weight_decay": 0.1},
                          {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0}],
                         lr=0.01, betas=(0.9, 0.999, 0.99), alpha=5.0, t_alpha_beta3=4,
                         weight_decouple=True)
    start = [p.detach().clone() for p in model.parameters()]
    gen = torch.Generator().manual_seed(1)
    for _ in range(7):
        for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        if layerwise:  # its hooks step as backward would
            for p in model.parameters():
                ours._update(p)
        else:
            ours.step()
        reference.step()
        for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
            # measured: at most 1.2e-7 apart (one float32 ulp of a norm weight near 1)
            torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)
    moved = max((p - s).abs().max() for p, s in zip(model.parameters(), start, strict=True))
    assert moved > 0.05


def test_the_schedulers_are_the_papers():
    """f_α: linear from 0; f_β3: the slow EMA's half-life ln ½ / ln β linear in t from β1's to
    β3's. Halfway: α/2, and the half-life the mean of 6.58 and 6931.1 steps."""
    assert alpha_at(50, 8.0, 100) == 4.0 and alpha_at(150, 8.0, 100) == 8.0
    assert alpha_at(1, 8.0, 0) == 8.0  # no warmup
    half = lambda b: math.log(0.5) / math.log(b)  # noqa: E731
    mean = (half(0.9) + half(0.9999)) / 2
    assert mean == pytest.approx(3468.85, abs=0.01)
    assert beta3_at(50, 0.9, 0.9999, 100) == pytest.approx(0.5 ** (1 / mean), rel=1e-12)
    assert beta3_at(0, 0.9, 0.9999, 100) == pytest.approx(0.9, rel=1e-12)  # from β1
    assert beta3_at(100, 0.9, 0.9999, 100) == beta3_at(200, 0.9, 0.9999, 100) == 0.9999


def test_the_warmup_defaults_to_the_runs_steps():
    run = load_run(ema_run(steps=7))
    optimizer = optimizer_for(build_method(run), micro_model(), run)
    assert {g["warmup"] for g in optimizer.param_groups} == {7}


def test_bench_memory_counts_what_it_estimates_peak_included(monkeypatch):
    """`harness bench memory` plain and layer-wise: weights, gradients, three float32 states an
    element and nothing else equal the estimate; the step's peak within its tolerance, the
    optimizer's float32 temporaries counted (`update_bytes`)."""
    from harness.bench import memory

    monkeypatch.setattr(memory, "METHODS", {"ademamix": {},
                                            "ademamix_layerwise": {"method": "ademamix"}})
    records = memory.bench_memory("llama_micro", 3, 32, 2)
    assert len(records) == 2 * 5
    assert all(memory.met(r) for r in records), [r for r in records if not memory.met(r)]
    states = {r["name"].split("/")[2]: r["value"] for r in records
              if r["name"].endswith("optimizer_state_bytes")}
    n = sum(p.numel() for p in micro_model().parameters())
    assert states["ademamix"] == states["ademamix_layerwise"] == 3 * 4 * n
    assert n == 1_149_248


@pytest.mark.parametrize(("state_dtype", "compensation", "dtype"),
                         [("float32", "none", torch.float32),
                          ("bfloat16", "kahan", torch.bfloat16)])
def test_bf16_true_honours_state_dtype_and_compensation(tmp_path, monkeypatch, state_dtype,
                                                        compensation, dtype):
    from harness.methods import ademamix

    seen: dict[str, Any] = {}
    real_add = ademamix.add_update

    def spy(param, update, mode, state, decay=0.0):
        seen.update(param=param.dtype, mode=mode,
                    states={state[k].dtype for k in ademamix.STATES})
        real_add(param, update, mode, state, decay)
        seen["kahan"] = KAHAN in state

    monkeypatch.setattr(ademamix, "add_update", spy)
    run = load_run(ema_run(steps=2, precision="bf16-true", state_dtype=state_dtype,
                           update_compensation=compensation))
    summary = train(run, tmp_path / "t")
    assert summary["status"] == "ok", summary["error"]
    assert seen == {"param": torch.bfloat16, "mode": compensation, "states": {dtype},
                    "kahan": compensation == "kahan"}
    estimate = build_memory(run).estimate(param_shapes("llama_micro", SAMPLE_VOCAB), run)
    assert_estimate_matches(estimate, summary)


def test_resume_keeps_float32_states_of_bf16_weights(tmp_path):
    data = ema_run(steps=4, precision="bf16-true", update_compensation="kahan")
    assert_resumes_exactly(load_run(data), tmp_path, stop=2)


def test_paged_states_are_refused_with_the_reason():
    with pytest.raises(UserError, match=r"^method ademamix: its three moments are its own"):
        load_run(ema_run(memory={"optimizer_offload": "paged"}))
