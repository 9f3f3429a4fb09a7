"""Muon: the update of `torch.optim.Muon` itself and of Moonlight's example optimizer on the same
gradients, through the method's own construction; Moonlight's split of a LLaMA; exact state
bytes; bf16-true's state dtype and compensation; resume; DDP (the modifiers and precisions:
tests/method_matrix.py; fsdp: tests/train/test_fsdp.py, tests/cost/test_sharded.py)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from conftest import (
    SAMPLE_VOCAB,
    assert_estimate_matches,
    assert_resumes_exactly,
    assert_two_processes_train_as_one,
    micro_model,
    micro_run,
)
from package_steps import adamw_on_the_rest, feed

from harness.errors import UserError
from harness.methods import build_method, memory_of, optimizer_for
from harness.methods.resolve import load_run
from harness.models import param_shapes
from harness.modifiers.compensation import KAHAN
from harness.train import train

METHOD = {"name": "muon"}
# llama_micro: 2 layers of q, k, v, o (64x64) and gate, up (176x64), down (64x176): the hidden
# matrices; embeddings and head 2 x SAMPLE_VOCAB x 64; 5 norms of 64.
HIDDEN = 2 * (4 * 64 * 64 + 3 * 176 * 64)
OTHER = 2 * SAMPLE_VOCAB * 64 + 5 * 64


def muon_run(steps: int = 4, method: dict[str, Any] | None = None, memory: dict | None = None,
             **train_keys: Any) -> dict[str, Any]:
    data = micro_run(steps=steps, grad_clip=None, **train_keys)
    data["eval"] = {"every": 0, "tokens": 256}
    return {**data, "method": {**METHOD, **(method or {})}, "memory": memory or {}}


@pytest.mark.parametrize(("adjust", "nesterov"), [("original", True), ("match_rms_adamw", False)])
def test_hidden_matrices_step_as_torch_muon_and_the_rest_as_torch_adamw(adjust, nesterov):
    """Five steps at lr 0.02, decay 0.1: every hidden matrix bitwise torch.optim.Muon's (the
    same arithmetic in the same order), the embeddings, head and norms bitwise torch's fused
    AdamW's (matrices decayed, vectors not)."""
    model, ref = micro_model(), micro_model()
    settings = {"adjust_lr_fn": adjust, "nesterov": nesterov, "ns_steps": 4, "momentum": 0.9}
    run = load_run(muon_run(method=settings, lr=0.02, weight_decay=0.1))
    ours = optimizer_for(build_method(run), model, run)
    hidden = [p for n, p in ref.named_parameters()
              if p.dim() == 2 and "embed" not in n and "lm_head" not in n]
    muon = torch.optim.Muon(hidden, lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov,
                            ns_steps=4, adjust_lr_fn=adjust)
    adamw = adamw_on_the_rest(ref, hidden, lr=0.02, weight_decay=0.1)
    start = [p.detach().clone() for p in model.parameters()]

    def step() -> None:
        ours.step()
        muon.step()
        adamw.step()

    feed([model, ref], 5, step)
    for (name, p), q, p0 in zip(model.named_parameters(), ref.parameters(), start, strict=True):
        assert torch.equal(p, q), name
        assert (p - p0).abs().max() > 1e-3, name


def moonlight_step(params: dict[str, torch.nn.Parameter], state: dict, lr: float, wd: float,
                   betas: tuple[float, float] = (0.9, 0.95), mu: float = 0.95,
                   eps: float = 1e-8) -> None:
    """Moonlight's examples/toy_train.py `Muon.step`, written out from its text: one LR and one
    decay for every parameter; momentum B = μB + g, Nesterov g + μB; Newton–Schulz in bf16 on
    X / (‖X‖ + 1e-7); LR scaled by 0.2·√max(m, n); AdamW with ε outside the bias correction."""
    a, b, c = 3.4445, -4.7750, 2.0315
    for name, p in params.items():
        st, g = state.setdefault(name, {}), p.grad
        p.data.mul_(1 - lr * wd)
        if p.dim() == 2 and "embed_tokens" not in name and "lm_head" not in name:
            buf = st.setdefault("buf", torch.zeros_like(g)).mul_(mu).add_(g)
            x = g.add(buf, alpha=mu).bfloat16()
            tall = x.size(0) > x.size(1)
            x = x.T if tall else x
            x = x / (x.norm() + 1e-7)
            for _ in range(5):
                gram = x @ x.T
                x = a * x + (b * gram + c * gram @ gram) @ x
            p.data.add_(x.T if tall else x, alpha=-lr * 0.2 * math.sqrt(max(p.shape)))
            continue
        st["step"] = st.get("step", 0) + 1
        m = st.setdefault("m", torch.zeros_like(g)).lerp_(g, 1 - betas[0])
        v = st.setdefault("v", torch.zeros_like(g)).lerp_(g.square(), 1 - betas[1])
        scale = (1 - betas[0] ** st["step"]) / (1 - betas[1] ** st["step"]) ** 0.5
        p.data.add_(m / (eps + v.sqrt()), alpha=-lr / scale)


def test_moonlights_recipe_is_the_example_optimizers_update():
    """match_rms_adamw, decay on every parameter (decay_vectors), betas (0.9, 0.95), one LR.
    Not bitwise: torch's momentum is (1 - μ) times Moonlight's, which Newton–Schulz's
    normalization removes but bf16 rounds differently (Moonlight's optimizer against itself fed
    torch's scaled momentum: up to 3.8% of a matrix's motion in one element), and AdamW's ε sits
    elsewhere. Measured over 5 steps, the difference's norm over the motion's: 2.3% at most on
    a hidden matrix, 1.5e-5 on the AdamW tensors; bounds 5% and 1e-4. A wrong LR scaling
    (`original`: 1 instead of 0.2·√64 = 1.6 here) or no Nesterov term is tens of percent."""
    model, ref = micro_model(), micro_model()
    settings = {"decay_vectors": True, "betas": [0.9, 0.95]}
    run = load_run(muon_run(method=settings, lr=0.01, weight_decay=0.1))
    ours = optimizer_for(build_method(run), model, run)
    params, state = dict(ref.named_parameters()), {}
    start = [p.detach().clone() for p in model.parameters()]

    def step() -> None:
        ours.step()
        with torch.no_grad():
            moonlight_step(params, state, lr=0.01, wd=0.1)

    feed([model, ref], 5, step)
    for (name, p), q, p0 in zip(model.named_parameters(), ref.parameters(), start, strict=True):
        assert (p - p0).abs().max() > 1e-3, name
        bound = 5e-2 if p.dim() == 2 and "embed" not in name and "lm_head" not in name else 1e-4
        assert (p - q).norm() < bound * (q - p0).norm(), name


def test_split_and_state_bytes_of_llama_micro():
    """Hidden matrices one float32 momentum an element; the 7 other tensors two AdamW moments
    and torch's float32 step each; counted from the real tensors after a step and predicted
    from shapes alone."""
    model = micro_model()
    run = load_run(muon_run())
    method = build_method(run)
    optimizer = optimizer_for(method, model, run)
    ids = torch.randint(0, SAMPLE_VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    assert sum(p.numel() for p in model.parameters()) == HIDDEN + OTHER
    q = model.model.layers[0].self_attn.q_proj.weight
    assert set(optimizer.state[q]) == {"momentum_buffer"}
    assert set(optimizer.state[model.lm_head.weight]) == {"step", "exp_avg", "exp_avg_sq"}
    measured = memory_of(method).measure(model, optimizer)
    assert measured.optimizer_state_bytes == 4 * (HIDDEN + 2 * OTHER + 7)
    assert memory_of(method).estimate(param_shapes("llama_micro", SAMPLE_VOCAB), run) == measured


def test_each_groups_lr_and_decay_are_settable():
    run = load_run(muon_run(method={"muon_lr": 0.02, "adamw_lr": 3e-4, "muon_weight_decay": 0.1,
                                    "adamw_weight_decay": 0.01}, weight_decay=0.5))
    groups = build_method(run).groups(micro_model(), run)
    assert [(g["muon"], len(g["params"]), g["lr"], g["weight_decay"]) for g in groups] == [
        (True, 14, 0.02, 0.1), (False, 2, 3e-4, 0.01), (False, 5, 3e-4, 0.0)]


def test_paged_states_are_refused_with_the_reason():
    with pytest.raises(UserError, match=r"^method muon: its momentum is its own tensor"):
        load_run(muon_run(memory={"optimizer_offload": "paged"}))


@pytest.mark.parametrize(("state_dtype", "compensation", "dtype"),
                         [("float32", "kahan", torch.float32),
                          ("bfloat16", "none", torch.bfloat16),
                          ("float32", "stochastic_rounding", torch.float32)])
def test_bf16_true_honours_state_dtype_and_compensation(tmp_path, state_dtype, compensation,
                                                        dtype):
    run = load_run(muon_run(steps=2, precision="bf16-true", state_dtype=state_dtype,
                            update_compensation=compensation))
    method = build_method(run)
    model = micro_model().to(torch.bfloat16)
    optimizer = optimizer_for(method, model, run)
    ids = torch.randint(0, SAMPLE_VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    q = optimizer.state[model.model.layers[0].self_attn.q_proj.weight]
    assert q["momentum_buffer"].dtype == dtype
    assert (KAHAN in q) == (compensation == "kahan")
    summary = train(run, tmp_path / "t")
    assert summary["status"] == "ok", summary["error"]
    shapes = param_shapes("llama_micro", SAMPLE_VOCAB)
    assert_estimate_matches(memory_of(method).estimate(shapes, run), summary)


def test_resume_is_exact(tmp_path):
    data = muon_run(steps=4, precision="bf16-true", update_compensation="kahan")
    assert_resumes_exactly(load_run(data), tmp_path, stop=2)


@pytest.mark.parametrize("layerwise", [False, True], ids=["ddp", "ddp_layerwise"])
def test_two_processes_train_as_one(tmp_path, layerwise):
    data = {**muon_run(steps=3, total_batch_size=8), "memory": {"layerwise": layerwise}}
    assert_two_processes_train_as_one(data, tmp_path)


def test_bench_memory_counts_what_it_estimates(monkeypatch):
    """`harness bench memory`'s comparison, for muon plain and layer-wise: the counted state
    bytes are the hand count above in both."""
    from harness.bench import memory

    monkeypatch.setattr(memory, "METHODS", {"muon": {}, "muon_layerwise": {"method": "muon"}})
    records = memory.bench_memory("llama_micro", 3, 32, 2)
    assert len(records) == 2 * 5
    assert all(memory.met(r) for r in records), [r for r in records if not memory.met(r)]
    states = {r["name"].split("/")[2]: r["value"] for r in records
              if r["name"].endswith("optimizer_state_bytes")}
    assert states["muon"] == states["muon_layerwise"] == 4 * (HIDDEN + 2 * OTHER + 7)
