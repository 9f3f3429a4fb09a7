"""Low-rank baseline: no full-rank W left, (m + n)·r parameters per matrix, it learns, its
memory estimate is the real tensors' byte for byte, and it resumes exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import SAMPLE_VOCAB, assert_estimate_matches, micro_model, micro_run
from torch import nn

from harness.errors import UserError
from harness.methods import build_memory, build_method, memory_of, optimizer_for
from harness.methods.lowrank import TARGETS, LowRankLinear
from harness.methods.resolve import load_run
from harness.models import PRESETS, param_shapes
from harness.train import train
from harness.trials import read_jsonl


def lowrank_run(rank: int = 8, **train_args) -> dict:
    return {**micro_run(**train_args), "method": {"name": "lowrank", "rank": rank}}


def losses(out: Path) -> list[float]:
    return [r["loss"] for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "train"]


def expected_params(preset: str, vocab: int, rank: int) -> int:
    """Table 1: a low-rank m×n matrix holds (m + n)·r; embeddings, head and norms are whole."""
    p = PRESETS[preset]
    h, f = p.hidden, p.intermediate
    per_layer = 4 * (h + h) * rank + 3 * (h + f) * rank + 2 * h  # q k v o, gate up down, norms
    return 2 * vocab * h + p.layers * per_layer + h


def test_targets_become_rank_r_factors_and_nothing_full_rank_is_left():
    run = load_run(lowrank_run(rank=8))
    model = build_method(run).prepare(micro_model(None, pad_id=0), run)
    factored = [n for n, m in model.named_modules() if isinstance(m, LowRankLinear)]
    assert len(factored) == 7 * PRESETS["llama_micro"].layers
    assert {n.rsplit(".", 1)[-1] for n in factored} == set(TARGETS)
    assert not any(
        isinstance(m, nn.Linear) and n.rsplit(".", 1)[-1] in TARGETS
        for n, m in model.named_modules()
    )
    up = model.model.layers[0].mlp.up_proj
    assert (up.A.shape, up.B.shape) == ((8, 64), (176, 8))
    params = list(model.parameters())
    assert all(p.requires_grad for p in params)
    assert sum(p.numel() for p in params) == expected_params("llama_micro", SAMPLE_VOCAB, 8)


def test_factor_init_keeps_the_full_rank_init_scale_and_the_forward_is_b_a():
    torch.manual_seed(0)
    layer = LowRankLinear(nn.Linear(512, 1376, bias=False), rank=128, std=0.02)
    w = layer.B @ layer.A
    assert w.std().item() == pytest.approx(0.02, rel=0.05)
    x = torch.randn(3, 512)
    torch.testing.assert_close(layer(x), x @ w.T)


def test_it_learns(tmp_path):
    run = load_run({**lowrank_run(rank=8, steps=40, lr=0.01), "eval": {"tokens": 256}})
    summary = train(run, tmp_path / "t")
    curve = losses(tmp_path / "t")
    assert summary["status"] == "ok" and len(curve) == 40
    assert sum(curve[-5:]) / 5 < sum(curve[:5]) / 5 - 1.0
    assert summary["trainable_params"] == expected_params("llama_micro", SAMPLE_VOCAB, 8)


def test_estimate_equals_the_real_tensors_after_a_step(tmp_path):
    run = load_run(lowrank_run(rank=8, steps=1))
    summary = train(run, tmp_path / "t")
    shapes = param_shapes(run.model, SAMPLE_VOCAB)
    estimate = build_memory(run).estimate(shapes, run)
    assert_estimate_matches(estimate, summary)
    assert summary["extra_bytes"] == 0


def test_estimate_equals_the_real_tensors_for_llama_60m_at_the_default_rank():
    run = load_run({"model": "llama_60m", "task": {"seq_len": 8}, "method": {"name": "lowrank"}})
    method = build_method(run)
    assert method.config.rank == 128
    model = method.prepare(micro_model(0, "llama_60m", seq_len=8, pad_id=0), run)
    optimizer = optimizer_for(method, model, run)
    ids = torch.randint(0, SAMPLE_VOCAB, (1, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    estimate = memory_of(method).estimate(param_shapes("llama_60m", SAMPLE_VOCAB), run)
    assert estimate == memory_of(method).measure(model, optimizer)
    assert estimate.weight_bytes == 4 * expected_params("llama_60m", SAMPLE_VOCAB, 128)


def test_resume_gives_the_same_losses_step_for_step(tmp_path):
    run = load_run(lowrank_run(rank=8, steps=6))
    straight = train(run, tmp_path / "straight")
    first = train(run, tmp_path / "resumed", should_stop=lambda step: step == 3)
    assert (first["status"], first["step"]) == ("interrupted", 3)
    second = train(run, tmp_path / "resumed")
    assert second["status"] == "ok" and second["step"] == 6
    assert losses(tmp_path / "resumed") == losses(tmp_path / "straight")
    assert second["eval_ppl"] == straight["eval_ppl"]


def test_an_unknown_target_is_refused_by_name():
    run = load_run({**lowrank_run(), "method": {"name": "lowrank", "target_modules": ["qproj"]}})
    method = build_method(run)
    with pytest.raises(UserError, match="no linear named qproj"):
        memory_of(method).estimate(param_shapes("llama_micro", SAMPLE_VOCAB), run)
    with pytest.raises(UserError, match="no linear named qproj"):
        method.prepare(micro_model(None, pad_id=0), run)
