"""Adam-mini: the same updates as the authors' package (adam-mini 1.1.1) on the same gradients,
its partition of a LLaMA, exact state bytes (mn + one value per block), precisions and DDP, and
why the package itself is not wrapped (the memory modifiers: tests/method_matrix.py)."""

from __future__ import annotations

from types import SimpleNamespace
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
from torch import nn

from harness.errors import UserError
from harness.methods import build_memory, build_method, memory_of, optimizer_for
from harness.methods.resolve import load_run, modifier_support
from harness.models import param_shapes
from harness.modifiers.compensation import KAHAN
from harness.train import train

METHOD = {"name": "adam_mini"}


def mini_run(steps: int = 4, memory: dict[str, Any] | None = None, **train_keys: Any) -> dict:
    """4 steps of 2 micro-batches, no clipping (layer-wise clips each parameter on its own)."""
    data = micro_run(steps=steps, grad_clip=None, **train_keys)
    data["eval"] = {"every": 0, "tokens": 256}
    return {**data, "method": METHOD, "memory": memory or {}}


class GqaToy(nn.Module):
    """Attention with 4 query heads and 2 key/value heads (16 rows each), a biased query, an MLP
    and a norm: the names the reference recognises, and the kinds llama_micro lacks."""

    def __init__(self) -> None:
        super().__init__()
        self.config = SimpleNamespace(hidden_size=64, num_attention_heads=4)
        self.self_attn = nn.ModuleDict({
            "q_proj": nn.Linear(64, 64), "k_proj": nn.Linear(64, 32, False),
            "v_proj": nn.Linear(64, 32, False), "o_proj": nn.Linear(64, 64, False)})
        self.mlp = nn.ModuleDict({"up_proj": nn.Linear(64, 96, False)})
        self.norm = nn.Parameter(torch.ones(64))


def reference_pair(kind: str) -> tuple[nn.Module, nn.Module, dict[str, int]]:
    torch.manual_seed(0)
    model = micro_model() if kind == "llama_micro" else GqaToy()
    ref = micro_model() if kind == "llama_micro" else GqaToy()
    ref.load_state_dict(model.state_dict())
    heads = {"dim": 64, "n_heads": 2, "n_kv_heads": 2} if kind == "llama_micro" else {
        "dim": 64, "n_heads": 4, "n_kv_heads": 2}
    return model, ref, heads


@pytest.mark.parametrize("kind", ["llama_micro", "gqa_toy"])
def test_matches_the_reference_package_step_for_step(kind):
    from adam_mini import Adam_mini

    model, ref, heads = reference_pair(kind)
    run = load_run({**mini_run(lr=0.01, weight_decay=0.1),
                    "method": {**METHOD, "betas": [0.9, 0.95]}})
    ours = optimizer_for(build_method(run), model, run)
    reference = Adam_mini(ref.named_parameters(), lr=0.01, betas=(0.9, 0.95), eps=1e-8,
                          weight_decay=0.1, verbose=False, **heads)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):  # rows of very different scales, so the partition shows in the update
        for (_, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
            scale = torch.rand(p.shape[0], *[1] * (p.dim() - 1), generator=gen) * 10
            p.grad = torch.randn(p.shape, generator=gen) * scale
            q.grad = p.grad.clone()
        ours.step()
        reference.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5, msg=name)
        assert (p - start[name]).abs().max() > 1e-3, name
        # the same partition: as many second-moment values per parameter as the reference's
        ref_state = reference.state[q]
        v = ref_state["v"] if "v" in ref_state else ref_state["vmean"]
        assert ours.state[p]["exp_avg_sq"].numel() == v.numel(), name


def test_partition_of_llama_micro_and_its_state_bytes():
    """Per layer: q and k 2 heads each, v, o and down 64 rows, gate and up 176 rows, 2 norms one
    each; embeddings and lm_head one per token; the final norm one: 4 (mn + blocks) bytes."""
    model = micro_model()
    run = load_run(mini_run())
    method = build_method(run)
    optimizer = optimizer_for(method, model, run)
    ids = torch.randint(0, SAMPLE_VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    shapes = param_shapes("llama_micro", SAMPLE_VOCAB)
    n = sum(p.numel() for p in model.parameters())
    blocks = 2 * SAMPLE_VOCAB + 2 * (2 + 2 + 64 + 64 + 176 + 176 + 64 + 1 + 1) + 1
    measured = memory_of(method).measure(model, optimizer)
    assert measured.optimizer_state_bytes == 4 * (n + blocks) == 4 * (1_149_248 + 17_485)
    assert memory_of(method).estimate(shapes, run) == measured
    per_head = optimizer.state[model.model.layers[0].self_attn.q_proj.weight]["exp_avg_sq"]
    assert per_head.shape == (2, 1)
    assert optimizer.state[model.model.norm.weight]["exp_avg_sq"].shape == (1, 1)


def test_bench_memory_counts_what_it_estimates(monkeypatch):
    """`harness bench memory`'s comparison, for adam_mini plain and layer-wise."""
    from harness.bench import memory

    monkeypatch.setattr(memory, "METHODS", {"adam_mini": {},
                                            "adam_mini_layerwise": {"method": "adam_mini"}})
    records = memory.bench_memory("llama_micro", 3, 32, 2)
    assert len(records) == 2 * 5
    assert all(memory.met(r) for r in records), [r for r in records if not memory.met(r)]
    states = {r["name"].split("/")[2]: r["value"] for r in records
              if r["name"].endswith("optimizer_state_bytes")}
    assert states["adam_mini"] == states["adam_mini_layerwise"] == 4 * (1_149_248 + 17_485)


def test_paged_states_are_refused_with_the_reason():
    support = modifier_support("adam_mini")
    assert {k for k, v in support.items() if v} == {"optimizer_offload paged"}
    with pytest.raises(UserError, match=r"^method adam_mini: its per-block second moments are"):
        load_run(mini_run(memory={"optimizer_offload": "paged"}))


@pytest.mark.parametrize(("state_dtype", "compensation", "dtype"),
                         [("float32", "none", torch.float32),
                          ("bfloat16", "kahan", torch.bfloat16),
                          ("float32", "stochastic_rounding", torch.float32)])
def test_bf16_true_honours_state_dtype_and_compensation(tmp_path, monkeypatch, state_dtype,
                                                        compensation, dtype):
    from harness.methods import adam_mini

    seen: dict[str, Any] = {}
    real_add = adam_mini.add_update

    def spy(param, update, mode, state, decay=0.0):
        seen.update(param=param.dtype, mode=mode, m=state["exp_avg"].dtype,
                    v=state["exp_avg_sq"].dtype)
        real_add(param, update, mode, state, decay)
        seen["kahan"] = KAHAN in state

    monkeypatch.setattr(adam_mini, "add_update", spy)
    run = load_run(mini_run(steps=2, precision="bf16-true", state_dtype=state_dtype,
                            update_compensation=compensation))
    summary = train(run, tmp_path / "t")
    assert summary["status"] == "ok", summary["error"]
    assert seen == {"param": torch.bfloat16, "mode": compensation, "m": dtype, "v": dtype,
                    "kahan": compensation == "kahan"}
    estimate = build_memory(run).estimate(param_shapes("llama_micro", SAMPLE_VOCAB), run)
    assert_estimate_matches(estimate, summary)


def test_resume_keeps_float32_states_of_bf16_weights(tmp_path):
    data = mini_run(steps=4, precision="bf16-true", update_compensation="kahan")
    assert_resumes_exactly(load_run(data), tmp_path, stop=2)


@pytest.mark.parametrize("layerwise", [False, True], ids=["ddp", "ddp_layerwise"])
def test_two_processes_train_as_one(tmp_path, layerwise):
    """gloo on CPU: the gradients are averaged before the step, so Adam-mini needs no
    collective of its own; 2 processes of 2 micro-batches equal 1 process of 4."""
    data = {**micro_run(steps=3, total_batch_size=8), "method": METHOD,
            "memory": {"layerwise": layerwise}}
    assert_two_processes_train_as_one(data, tmp_path)


def test_the_package_fails_outside_a_process_group_when_two_gpus_are_visible(monkeypatch):
    """Why it is not wrapped: with two CUDA devices visible it gathers block sizes over a
    process group at its first step, which a single-process run has not created."""
    from adam_mini import Adam_mini

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    model = GqaToy()
    optimizer = Adam_mini(model.named_parameters(), dim=64, n_heads=4, n_kv_heads=2,
                          verbose=False)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    with pytest.raises((RuntimeError, ValueError), match="process group"):
        optimizer.step()
